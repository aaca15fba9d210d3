"""The documentation: links that resolve, a complete map, and an API reference in sync."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# [text](target) and ![alt](target), not inside `code`; reference-style links are unused.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _links(page: Path) -> list[str]:
    text = _FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return _LINK.findall(text)


def _relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) and not target.startswith("#")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(page: Path) -> None:
    missing = []
    for target in _links(page):
        if not _relative(target):
            continue
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


def test_the_map_lists_every_doc() -> None:
    linked = {
        (DOCS / t.split("#", 1)[0]).resolve() for t in _links(DOCS / "index.md") if _relative(t)
    }
    unlisted = [
        p.name for p in DOCS.glob("*.md") if p.name != "index.md" and p.resolve() not in linked
    ]
    assert not unlisted, f"docs/index.md does not link to {unlisted}: add them to the map"


def test_readme_documentation_section_lists_every_doc() -> None:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    unlisted = [p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in section]
    assert not unlisted, f"README.md's Documentation section misses {unlisted}"


def test_api_reference_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("gen_api_doc", ROOT / "scripts/gen_api_doc.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    expected = gen.render()
    current = (DOCS / "api.md").read_text()
    assert current == expected, (
        "docs/api.md is out of date with the docstrings: regenerate it with\n"
        "    .venv/bin/python scripts/gen_api_doc.py\n"
        "and commit the result"
    )


def _map_entries() -> set[str]:
    """Module paths the map's tree names: ``folder/`` lines open a folder (nested by their
    indent), ``name.py`` words below it are its modules (two may share a line)."""
    lines = (DOCS / "structure.md").read_text().split("```")[1].splitlines()
    found: set[str] = set()
    folders: list[tuple[int, str]] = []  # the open folders: (indent, name), outermost first
    for line in lines:
        indent = len(line) - len(line.lstrip())
        while folders and folders[-1][0] >= indent:
            folders.pop()
        head = re.match(r"^ *(\w+)/", line)
        if head:
            folders.append((indent, head.group(1)))
            continue
        prefix = "".join(name + "/" for _, name in folders[1:])  # below hpcckpt/
        for name in re.findall(r"\b([a-z_][a-z_0-9]*\.py)\b", line):
            found.add(prefix + name)
    return found


def test_the_map_names_every_module() -> None:
    """docs/structure.md's tree names every module of the package, under its folder."""
    package = ROOT / "hpcckpt"
    modules = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if p.name not in ("__init__.py", "_version.py")
    }
    missing = sorted(modules - _map_entries())
    assert not missing, f"docs/structure.md does not name these modules: {missing}"


def _test_files(named: str) -> list[Path]:
    """The test files a page's `tests/x/test_y.py` or plain `test_y.py` names."""
    if named.startswith("tests/"):
        return [ROOT / named] if (ROOT / named).is_file() else []
    return sorted((ROOT / "tests").rglob(Path(named).name))


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_the_tests_the_docs_name_exist(page: Path) -> None:
    """Each page names the test behind its promises (`tests/x.py::name`, `test_x.py::name`,
    or `::name` after one): each file and test is there, so renaming or removing a test
    a page cites fails here."""
    files: list[Path] | None = None
    missing = []
    pattern = r"`((?:tests/)?[\w/]*test_\w+\.py)?(?:::(\w+))?"
    for path, name in re.findall(pattern, page.read_text()):
        if path:
            files = _test_files(path)
            if not files:
                missing.append(path)
        if name and files is None:
            missing.append(f"::{name} (no test file named before it)")
        elif name and files and not any(f"def {name}(" in f.read_text() for f in files):
            missing.append(f"{path or files[0].name}::{name}")
    assert not missing, missing


def test_tiers_names_its_tests() -> None:
    """docs/tiers.md's promises each name a test (checked above to exist)."""
    assert re.search(r"`tests/[\w/]+\.py::\w+`", (DOCS / "tiers.md").read_text())
