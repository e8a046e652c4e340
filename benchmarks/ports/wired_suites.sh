#!/usr/bin/env bash
# Upstream's two suites that 0005 wires the plugin into, run with `--pdb` and with pytest-xdist's `-n 2`: the options
# with which an earlier version of 0005 changed the run (`--pdb` refused, crashed workers rerun to a pass).
#
#   benchmarks/ports/wired_suites.sh CHECKOUT FABRIC_PYTHON PYTORCH_PYTHON [PYTORCH_SELECTION...]
#
# CHECKOUT is an upstream checkout on 0005's PR branch (`python -m patchset upstream-pr 0005 --onto CHECKOUT`);
# FABRIC_PYTHON and PYTORCH_PYTHON are interpreters with upstream's test requirements (the venvs `upstream-tests`
# makes). CHECKOUT's `src` goes first on PYTHONPATH, so the venvs may be editable installs of another checkout, and
# pytest-xdist is taken from $XDIST_TARGET (`pip install --target`) when the venv lacks it. Each run prints pytest's
# closing line and exit code; `--pdb` gets a `c` (continue) for every failure on standard input.
set -uo pipefail
checkout=$1 fabric=$2 pytorch=$3
shift 3
selection=("${@:-strategies}")
export PYTHONPATH="$checkout/src${XDIST_TARGET:+:$XDIST_TARGET}"
cont=$(printf 'c\n%.0s' {1..200})

run() {  # run NAME PYTHON DIR ARGS...
  local name=$1 python=$2 dir=$3
  shift 3
  local start=$SECONDS
  (cd "$checkout/tests/$dir" && "$python" -m pytest -q -p no:cacheprovider --timeout=120 "$@" <<<"$cont") >"/tmp/wired-$name.log" 2>&1
  local rc=$?
  printf '%-28s exit %s in %4ss: %s\n' "$name" "$rc" $((SECONDS - start)) "$(grep -E '^=+ .* in [0-9.]+s' "/tmp/wired-$name.log" | tail -1)"
}

git -C "$checkout" log -1 --format='branch %D at %h (%s)'
run fabric-pdb "$fabric" tests_fabric --pdb
run fabric-xdist "$fabric" tests_fabric -n 2
run pytorch-pdb "$pytorch" tests_pytorch --pdb "${selection[@]}"
run pytorch-xdist "$pytorch" tests_pytorch -n 2 "${selection[@]}"
