#!/usr/bin/env bash
# Upstream's two suites that 0005 wires the plugin into, run with `--pdb` and with pytest-xdist's `-n 2` on 0005's PR
# branch and on its base: the options with which an earlier version of 0005 changed the run (`--pdb` refused at the
# first test, crashed workers rerun to a pass). The branch must give what the base gives.
#
#   benchmarks/ports/wired_suites.sh CHECKOUT FABRIC_PYTHON PYTORCH_PYTHON
#
# CHECKOUT is an upstream checkout on 0005's PR branch (`python -m patchset upstream-pr 0005 --onto CHECKOUT`); its
# parent commit is the base. FABRIC_PYTHON and PYTORCH_PYTHON are interpreters with upstream's test requirements (the
# venvs `upstream-tests` makes). CHECKOUT's `src` goes first on PYTHONPATH, so the venvs may be editable installs of
# another checkout; pytest-xdist is taken from $XDIST_TARGET (`pip install --target`) when the venvs lack it.
#
# Upstream marks some tests `flaky`, and pytest-rerunfailures refuses `--pdb` when it reaches one ("--reruns
# incompatible with --pdb"), with or without the plugin: the `--pdb` runs deselect them with `-m "not flaky"`, and
# one run without `-m` shows that the refusal is the same on both. `--pdb` gets a `c` (continue) for every failure.
set -uo pipefail
checkout=$1 fabric=$2 pytorch=$3
export PYTHONPATH="$checkout/src${XDIST_TARGET:+:$XDIST_TARGET}"
cont=$(printf 'c\n%.0s' {1..500})
branch=$(git -C "$checkout" rev-parse --abbrev-ref HEAD)

run() {  # run NAME PYTHON DIR ARGS...
  local name=$1 python=$2 dir=$3
  shift 3
  local start=$SECONDS log="${WIRED_LOGS:-/tmp}/wired-$name-$label.log"
  (cd "$checkout/tests/$dir" && "$python" -m pytest -q -p no:cacheprovider --timeout=300 "$@" <<<"$cont") >"$log" 2>&1
  local rc=$?
  local summary
  summary=$(sed 's/\x1b\[[0-9;]*m//g' "$log" | grep -E '^=* ?[0-9]+ (passed|failed|skipped|error).* in [0-9.]+s|^ERROR: ' | tail -1)
  printf '| %s | %s | `%s` | exit %s | %s | %ss |\n' "$label" "$dir" "${*@Q}" "$rc" "$summary" $((SECONDS - start))
}

for label in branch base; do
  ref=$branch
  [ "$label" = base ] && ref="$branch~1"
  git -C "$checkout" checkout -q --force "$ref"
  echo "$label: $(git -C "$checkout" log -1 --format='%h (%s)')"
  run fabric-pdb-all "$fabric" tests_fabric --pdb utilities
  run fabric-pdb "$fabric" tests_fabric --pdb -m "not flaky" utilities strategies
  run fabric-xdist "$fabric" tests_fabric -n 2 utilities strategies
  run pytorch-pdb "$pytorch" tests_pytorch --pdb -m "not flaky" strategies
  run pytorch-xdist "$pytorch" tests_pytorch -n 2 strategies
done
git -C "$checkout" checkout -q --force "$branch"
