"""Write docs/api.md, the Python API reference, from the docstrings and signatures.

    .venv/bin/python scripts/gen_api_doc.py           # regenerate docs/api.md
    .venv/bin/python scripts/gen_api_doc.py --check   # exit 1 if docs/api.md is stale

tests/test_docs.py runs the check, so the reference cannot drift from the code: after
changing a public signature or docstring, run this script and commit docs/api.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "api.md"

#: (section title, module, public names in the order shown, introduction).
SECTIONS: list[tuple[str, str, list[str], str]] = [
    (
        "Checkpointing: `hpcckpt.Checkpointer`",
        "hpcckpt.coord.checkpointer",
        ["Checkpointer"],
        "The one class an application needs (`import hpcckpt; hpcckpt.Checkpointer(...)`). "
        "Every method is collective: all ranks of the communicator call it, in the same "
        "order, with the same step.",
    ),
    (
        "What `save` returns and what it raises",
        "hpcckpt.store",
        ["SaveResult", "CheckpointError"],
        "",
    ),
    (
        "Choosing an interval: `hpcckpt.policy`",
        "hpcckpt.policy.formulas",
        [
            "young",
            "daly",
            "optimal_interval",
            "efficiency",
            "expected_waste",
            "expected_makespan",
            "job_mtbf",
            "DEFAULT_NODE_MTBF",
        ],
        "Pure functions, all in seconds; also importable from `hpcckpt.policy`.",
    ),
    (
        "Durations",
        "hpcckpt.policy.durations",
        ["parse_duration", "format_duration", "format_hms"],
        "",
    ),
    (
        "The event log: `hpcckpt.rundir.events`",
        "hpcckpt.rundir.events",
        ["append_event", "read_events"],
        "`DIR/events.jsonl` is written by the wrapper and by the Checkpointer's rank 0; "
        "the events are listed in [wrapper.md](wrapper.md#events) and "
        "[getting-started.md](getting-started.md#what-happened-hpcckpt-report).",
    ),
    (
        "Reports: `hpcckpt.report`",
        "hpcckpt.report",
        ["load_events", "analyze", "format_report"],
        "What `hpcckpt report` computes, as functions over the event list. "
        "`hpcckpt.report.plot.plot_report(report, path)` draws the timeline "
        "(needs matplotlib).",
    ),
]

_ROLE = re.compile(r":(?:class|func|meth|attr|data|mod|exc):`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def _markdown(doc: str) -> str:
    """reST inline markup to Markdown: ``x`` -> `x`, :func:`~a.b` -> `a.b`."""
    doc = _ROLE.sub(lambda m: f"`{m.group(1)}`", doc)
    return _LITERAL.sub(lambda m: f"`{m.group(1)}`", doc)


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    if inspect.isclass(obj) and doc.startswith(f"{obj.__name__}("):
        doc = ""  # the signature a dataclass makes up when it has no docstring
    # Keep literal blocks and indentation: the docstrings are written to read as text.
    out: list[str] = []
    in_block = False
    for line in doc.splitlines():
        if line.strip() == "\\b":
            continue
        indented = line.startswith("    ")
        if indented and not in_block:
            out.append("```text")
            in_block = True
        elif not indented and in_block and line.strip():
            out.append("```")
            in_block = False
        out.append(line[4:] if in_block and indented else _markdown(line))
    if in_block:
        while out and not out[-1].strip():
            out.pop()
        out.append("```")
    return "\n".join(out).strip()


def _signature(name: str, obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts: list[str] = []
    star_done = False
    for p in params:
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
            star_done = True
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        if p.kind is p.VAR_POSITIONAL:
            star_done = True
        text = prefix + p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
            if p.default is not p.empty:
                text += f" = {p.default!r}"
        elif p.default is not p.empty:
            text += f"={p.default!r}"
        parts.append(text)
    ret = ""
    if sig.return_annotation is not inspect.Signature.empty:
        ret = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(parts)}){ret}"
    if len(one_line) <= 88:
        return one_line
    # One parameter per line, like ruff formats a long def.
    body = "".join(f"    {p},\n" for p in parts)
    return f"{name}(\n{body}){ret}"


def _annotation(ann: Any) -> str:
    """Annotations are strings here (``from __future__ import annotations``): show them bare."""
    return ann if isinstance(ann, str) else inspect.formatannotation(ann)


def _member_lines(cls: type) -> list[str]:
    lines: list[str] = []
    for attr, value in cls.__dict__.items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            lines += [f"#### `{cls.__name__}.{attr}` (property)", "", _doc(value), ""]
        elif isinstance(value, (staticmethod, classmethod)):
            func = value.__func__
            lines += [
                "```python",
                f"{cls.__name__}.{_signature(attr, func)}",
                "```",
                "",
                _doc(func),
                "",
            ]
        elif inspect.isfunction(value):
            lines += [
                f"#### `{cls.__name__}.{attr}`",
                "",
                "```python",
                _signature(attr, value),
                "```",
                "",
                _doc(value),
                "",
            ]
    return lines


def _object_lines(module: Any, name: str) -> list[str]:
    obj = getattr(module, name)
    lines: list[str] = []
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
        lines += [f"### `{name}`", "", _doc(obj), "", "| field | type |", "|---|---|"]
        for f in dataclasses.fields(obj):
            lines.append(f"| `{f.name}` | `{f.type}` |")
        lines.append("")
        lines += _member_lines(obj)
    elif inspect.isclass(obj) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        lines += [f"### `{name}({bases})`", "", _doc(obj), ""]
    elif inspect.isclass(obj):
        lines += [
            f"### `{name}`",
            "",
            "```python",
            _signature(name, obj.__init__),
            "```",
            "",
            _doc(obj),
            "",
        ]
        lines += _member_lines(obj)
    elif callable(obj):
        lines += [
            f"### `{name}`",
            "",
            "```python",
            _signature(name, obj),
            "```",
            "",
            _doc(obj),
            "",
        ]
    else:
        lines += [f"### `{name} = {obj!r}`", ""]
        doc = _attribute_doc(module, name)
        if doc:
            lines += [_markdown(doc), ""]
    return lines


def _attribute_doc(module: Any, name: str) -> str:
    """The string literal right after ``NAME: type = value`` in the module's source."""
    source = inspect.getsource(module)
    m = re.search(rf'^{name}\b[^\n]*\n"""(.*?)"""', source, re.S | re.M)
    return inspect.cleandoc(m.group(1)) if m else ""


def render() -> str:
    """The whole of docs/api.md."""
    lines = [
        "# Python API reference",
        "",
        "<!-- Generated by scripts/gen_api_doc.py from the docstrings: do not edit by hand.",
        "     Regenerate with: .venv/bin/python scripts/gen_api_doc.py -->",
        "",
        "The command line is described in [getting-started.md](getting-started.md) and "
        "`hpcckpt --help`; the wrapper in [wrapper.md](wrapper.md).",
        "",
        "Contents:",
        "",
    ]
    for title, _mod, _names, _intro in SECTIONS:
        anchor = re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")
        lines.append(f"- [{title}](#{anchor})")
    lines.append("")
    for title, modname, names, intro in SECTIONS:
        module = importlib.import_module(modname)
        lines += [f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        lines.append(f"Module `{modname}`.")
        lines.append("")
        for name in names:
            lines += _object_lines(module, name)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is stale")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    text = render()
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(
                "docs/api.md is out of date: run .venv/bin/python scripts/gen_api_doc.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
