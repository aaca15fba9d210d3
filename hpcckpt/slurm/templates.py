"""Batch-script templates (``sbatch-templates/*.sbatch``) and how ``hpcckpt submit`` fills them.

A template is a complete, commented batch script that works as it is; rendering
changes only these lines (docs/templates.md):

- ``#SBATCH --OPTION=VALUE`` for the options given (``time``, ``nodes``, ``ntasks``,
  ``partition``, ``job-name``, ``output``, ``signal``...): the first such line gets the
  new value; an option the template lacks is added after its last ``#SBATCH`` line;
- ``NAME=...`` at the start of a line for every ``NAME=VALUE`` setting: the command
  becomes ``APP=(...)`` (a bash array, each word shell-quoted), the checkpoint directory
  ``export HPCCKPT_DIR=...``, the stop signal ``STOP_SIGNAL=...``. A setting whose line
  the template lacks is an error, so a typo cannot pass silently.
"""

from __future__ import annotations

import os
import re
import shlex
import site
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

from hpcckpt.rundir.env import TEMPLATES_ENV

SUFFIX = ".sbatch"

_SBATCH = re.compile(r"^#SBATCH\s+--([A-Za-z][A-Za-z0-9-]*)(?:[=\s]\S.*)?$")
_ASSIGN = re.compile(r"^(export\s+)?([A-Za-z_][A-Za-z0-9_]*)=")


class TemplateError(ValueError):
    """Unknown template, or a setting the template has no line for."""


def templates_dir() -> Path:
    """``$HPCCKPT_TEMPLATES``; else ``sbatch-templates/`` of the checkout the package runs
    from; else the copy an installed wheel put under its prefix (``share/hpcckpt/``, in
    the venv or, after ``pip install --user``, the user base)."""
    env = os.environ.get(TEMPLATES_ENV)
    if env:
        return Path(env)
    source = Path(__file__).resolve().parents[2] / "sbatch-templates"
    if source.is_dir():
        return source
    for base in (sysconfig.get_path("data"), site.getuserbase()):
        installed = Path(base) / "share" / "hpcckpt" / "sbatch-templates"
        if installed.is_dir():
            return installed
    return source


def available() -> list[str]:
    try:
        return sorted(p.stem for p in templates_dir().glob(f"*{SUFFIX}"))
    except OSError:
        return []


def find(name: str) -> Path:
    """A template by name (``requeue``) or path (``./my.sbatch``)."""
    path = Path(name)
    if path.suffix == SUFFIX and path.is_file():
        return path
    candidate = templates_dir() / f"{name.removesuffix(SUFFIX)}{SUFFIX}"
    if candidate.is_file():
        return candidate
    names = ", ".join(available()) or f"none found in {templates_dir()}"
    raise TemplateError(f"no template {name!r}: choose one of {names}, or give a path")


def bash_array(words: Sequence[str]) -> str:
    """``(python 'my app.py')``: a bash array literal of the words, each shell-quoted."""
    return "(" + " ".join(shlex.quote(w) for w in words) + ")"


def render(
    text: str,
    *,
    sbatch: Mapping[str, str] | None = None,
    settings: Mapping[str, str] | None = None,
) -> str:
    """The template ``text`` with ``#SBATCH`` options and ``NAME=`` settings replaced.

    ``settings`` values are inserted verbatim (quote them with :func:`shlex.quote`).
    """
    lines = text.splitlines()
    todo_sbatch = dict(sbatch or {})
    todo_set = dict(settings or {})
    last_sbatch = -1
    for i, line in enumerate(lines):
        m = _SBATCH.match(line)
        if m:
            last_sbatch = i
            key = m.group(1)
            if key in todo_sbatch:
                lines[i] = f"#SBATCH --{key}={todo_sbatch.pop(key)}"
            continue
        a = _ASSIGN.match(line)
        if a and a.group(2) in todo_set:
            lines[i] = f"{a.group(1) or ''}{a.group(2)}={todo_set.pop(a.group(2))}"
    if todo_set:
        raise TemplateError(
            "the template has no line for " + ", ".join(f"{k}=" for k in sorted(todo_set))
        )
    if todo_sbatch:
        extra = [f"#SBATCH --{k}={v}" for k, v in todo_sbatch.items()]
        at = (
            last_sbatch + 1
            if last_sbatch >= 0
            else (1 if lines[:1] and lines[0][:2] == "#!" else 0)
        )
        lines[at:at] = extra
    return "\n".join(lines) + "\n"


def signal_spec(value: str) -> tuple[str, str]:
    """``USR2@90`` → (``B:USR2@90``, ``USR2``); ``B:`` is added when missing."""
    spec = value.strip()
    body = spec[2:] if spec.upper().startswith("B:") else spec
    name, _, lead = body.partition("@")
    name = name.upper().removeprefix("SIG")
    if not name or (lead and not lead.isdigit()):
        raise TemplateError(f"--signal {value!r}: write SIG@SECONDS, e.g. USR1@120")
    return f"B:{name}" + (f"@{lead}" if lead else ""), name
