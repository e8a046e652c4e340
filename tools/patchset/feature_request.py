"""The feature request that a patch adding a feature needs upstream before its PR: upstream's form, filled in.

Upstream's contributor guide asks for an agreed issue before a feature. A patch whose feature has no upstream issue
names the request's text with ``Feature-Request: <file>``: a Markdown file of the project with one ``## <field>``
section per field of upstream's feature request form (``.github/ISSUE_TEMPLATE/*.yaml`` with the ``feature`` label, as
the upstream checkout has it at the PR's base): the problem with a runnable reproduction, the rule and the API, the
alternatives weighed and what they cost. ``upstream-pr`` writes the filled form beside the PR's description, and the
PR's text refers to the request instead of claiming an issue.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from patchset import PatchsetError
from patchset.fork_metadata import fork_url
from patchset.gitops import git
from patchset.series import Patch

TEMPLATES = ".github/ISSUE_TEMPLATE"
_SECTION = re.compile(r"^## (.+?)\s*$", re.M)


@dataclass(frozen=True)
class Field:
    """A text field of upstream's issue form: its label, and whether the form requires it."""

    label: str
    required: bool


def form_fields(form: str) -> list[Field]:
    """The ``textarea`` and ``input`` fields of a GitHub issue form, in order (read without a YAML parser)."""
    fields = []
    for item in re.split(r"^\s*- type:\s*", form, flags=re.M)[1:]:
        kind = item.split(None, 1)[0]
        label = re.search(r"^\s*label:\s*(.+?)\s*$", item, flags=re.M)
        if kind in ("textarea", "input") and label:
            required = re.search(r"^\s*required:\s*true\s*$", item, flags=re.M) is not None
            fields.append(Field(label.group(1).strip("\"'"), required))
    return fields


def read_form(onto: Path, base: str) -> tuple[str, list[Field]]:
    """The path and fields of upstream's feature request form at ``base``: the issue form labelled ``feature``."""
    listing = git(onto, "ls-tree", "--name-only", f"{base}:{TEMPLATES}", check=False, isolated=False)
    names = listing.stdout.decode("utf-8").split() if listing.returncode == 0 else []
    for name in sorted(n for n in names if n.endswith((".yaml", ".yml"))):
        text = git(onto, "show", f"{base}:{TEMPLATES}/{name}", isolated=False).stdout.decode("utf-8")
        labels = re.search(r"^labels:\s*\[(.*)\]\s*$", text, flags=re.M)
        if labels and "feature" in re.findall(r"[\w-]+", labels.group(1)):
            return f"{TEMPLATES}/{name}", form_fields(text)
    raise PatchsetError(f"{onto} has no issue form labelled `feature` in {TEMPLATES} at {base}")


def request_path(project: Path, patch: Patch) -> Path | None:
    """The project's file that the patch's ``Feature-Request:`` field names, or ``None`` without the field."""
    value = patch.field("Feature-Request").strip()
    if not value:
        return None
    path = project / value
    if not path.is_file():
        raise PatchsetError(f"{patch.name}: Feature-Request: {value} is not a file of the project")
    return path


def request_url(project: Path, patch: Patch) -> str | None:
    """Where the request's text is published: its file in the fork's repository."""
    path = request_path(project, patch)
    return None if path is None else f"{fork_url(project)}/blob/main/{path.relative_to(project).as_posix()}"


def fill_form(fields: list[Field], text: str, where: str) -> str:
    """The issue's body: each field of the form with its section of ``text`` (``where`` names the file)."""
    parts = _SECTION.split(text)
    sections = {label.strip(): body.strip() for label, body in zip(parts[1::2], parts[2::2], strict=True)}
    labels = {f.label for f in fields}
    unknown = [label for label in sections if label not in labels]
    if unknown:
        raise PatchsetError(f"{where}: no field {unknown[0]!r} in upstream's form (it has {', '.join(sorted(labels))})")
    missing = [f.label for f in fields if f.required and not sections.get(f.label)]
    if missing:
        raise PatchsetError(f"{where}: upstream's form requires {missing[0]!r}; add a `## {missing[0]}` section")
    return "\n\n".join(f"### {f.label}\n\n{sections.get(f.label) or '_No response_'}" for f in fields) + "\n"


def feature_request(project: Path, patch: Patch, onto: Path, base: str) -> str | None:
    """The filled feature request of ``patch``, with its title, or ``None`` if the patch names none."""
    path = request_path(project, patch)
    if path is None:
        return None
    _, fields = read_form(onto, base)
    text = path.read_text(encoding="utf-8")
    title = re.search(r"^# (.+?)\s*$", text, flags=re.M)
    if title is None:
        raise PatchsetError(f"{path.relative_to(project)}: the request's title, a `# ` line, is missing")
    return f"# {title.group(1)}\n\n" + fill_form(fields, text[title.end() :], str(path.relative_to(project)))


def default_request_path(project: Path, patch: Patch) -> Path:
    """Where ``upstream-pr`` writes the filled request: beside the PR's description."""
    return project / ".work" / "pr" / (patch.name.removesuffix(".patch") + ".feature-request.md")
