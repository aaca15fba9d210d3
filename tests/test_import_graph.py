"""The shape of the package, checked statically: no import cycles, each folder imports only
the folders below it (docs/architecture.md), the wrapper never loads HDF5 or MPI.

Every ``import`` counts, in a function too; a function-level import of an hpcckpt module
or of a heavy library is allowed only where :data:`LAZY` says why (start-up time).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpcckpt"

#: What each room may import from hpcckpt (itself always). The leaves (``procfs``,
#: ``libc``, ``signames``, ``_version``, ``rundir.env``) are listed where they are used.
MAY_IMPORT: dict[str, set[str]] = {
    "hpcckpt._version": set(),
    "hpcckpt.signames": set(),
    "hpcckpt.procfs": set(),
    "hpcckpt.libc": set(),
    "hpcckpt.rundir.env": set(),
    "hpcckpt.policy": set(),
    "hpcckpt.slurm": {"hpcckpt.rundir.env", "hpcckpt.signames"},
    "hpcckpt.rundir": {"hpcckpt.slurm", "hpcckpt.signames"},
    "hpcckpt.store": {"hpcckpt.procfs", "hpcckpt.libc", "hpcckpt._version"},
    "hpcckpt.report": {"hpcckpt.rundir", "hpcckpt.slurm", "hpcckpt.policy", "hpcckpt.signames"},
    "hpcckpt.cluster": {"hpcckpt.slurm", "hpcckpt.rundir", "hpcckpt.procfs", "hpcckpt.signames"},
    "hpcckpt.coord": {
        "hpcckpt.store",
        "hpcckpt.policy",
        "hpcckpt.rundir",
        "hpcckpt.slurm",
        "hpcckpt.procfs",
        "hpcckpt.signames",
        "hpcckpt._version",
    },
    "hpcckpt.job": {
        "hpcckpt.rundir",
        "hpcckpt.slurm",
        "hpcckpt.policy",
        "hpcckpt.procfs",
        "hpcckpt.libc",
        "hpcckpt.signames",
    },
    "hpcckpt.cli": {"*"},
    "hpcckpt": {"hpcckpt.coord", "hpcckpt._version"},
}

#: Libraries that load HDF5 or MPI: the wrapper's process must never import them.
HEAVY = ("h5py", "mpi4py")
#: Rooms that must stay free of them (transitively): the wrapper and what it uses.
LIGHT = ("hpcckpt.job", "hpcckpt.rundir", "hpcckpt.slurm", "hpcckpt.report", "hpcckpt.cluster")

#: Function-level imports allowed, (importer, imported prefix) -> why. The importer is a
#: module's name, or ``package.*`` for every module of a package.
LAZY: dict[tuple[str, str], str] = {
    # `import hpcckpt` must not load MPI and HDF5: the Checkpointer comes on first use
    ("hpcckpt", "hpcckpt.coord"): "hpcckpt.Checkpointer loads MPI/HDF5 on first use",
    # each `hpcckpt` command loads only the layers it needs (the wrapper starts in ~0.1 s)
    ("hpcckpt.cli.*", ""): "a command imports its layers when it runs",
    # the validator is imported by `import hpcckpt`; keeping a rejected file needs the store
    ("hpcckpt.coord.validate", "hpcckpt.store"): "numpy-only until a state is rejected",
    ("hpcckpt.coord.validate", "mpi4py"): "numpy-only until the collective check runs",
    # numpy for the Monte-Carlo simulator only
    ("hpcckpt.policy", "hpcckpt.policy.simulate"): "policy stays numpy-free until simulate",
    # checksums (xxhash) only for applications with restart files
    ("hpcckpt.job.appmode", "hpcckpt.job.restart_files"): "xxhash only with --restart-files",
    ("hpcckpt.job.stops", "hpcckpt.job.ownschedule"): "xxhash only with --restart-files",
    # the plot's matplotlib only for --plot
    ("hpcckpt.report.plot", "matplotlib"): "matplotlib only when a plot is drawn",
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, importer: str) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names)
        return
    base = node.module or ""
    if node.level:
        parts = importer.split(".")
        if not MODULES[importer].name == "__init__.py":
            parts = parts[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join([*parts, base] if base else parts)
    for alias in node.names:
        full = f"{base}.{alias.name}"
        yield full if full in MODULES else base


def imports(name: str) -> Iterator[tuple[str, bool, int]]:
    """(imported module, at function level?, line) of every import in module ``name``
    that runs (not those under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(MODULES[name].read_text())
    top = {id(n) for n in tree.body}
    typing_only = {
        id(sub)
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in typing_only:
            for target in _targets(node, name):
                yield target, id(node) not in top, node.lineno


def _with_parents(target: str, importer: str = "") -> list[str]:
    """Importing ``a.b.c`` runs ``a``, ``a.b`` and ``a.b.c``: the hpcckpt modules among
    them, except the packages holding ``importer`` (they ran before it)."""
    parts = target.split(".")
    names = [".".join(parts[: i + 1]) for i in range(len(parts))]
    return [n for n in names if n in MODULES and not importer.startswith(n + ".")]


def room(name: str) -> str:
    """The longest key of MAY_IMPORT that ``name`` belongs to."""
    keys = [k for k in MAY_IMPORT if name == k or name.startswith(k + ".")]
    return max(keys, key=len)


def lazy_allowed(importer: str, target: str) -> bool:
    return any(
        (importer == a or (a.endswith(".*") and importer.startswith(a[:-1])))
        and target.startswith(b)
        for a, b in LAZY
    )


GRAPH = {
    name: sorted(
        {dep for target, _, _ in imports(name) for dep in _with_parents(target, name)} - {name}
    )
    for name in MODULES
}


def test_no_import_cycle_between_hpcckpt_modules():
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in GRAPH[node]:
            if state.get(dep) == 1:
                cycles.append([*stack[stack.index(dep) :], dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_each_room_imports_only_the_rooms_below_it():
    wrong = []
    for name in MODULES:
        mine = room(name)
        allowed = MAY_IMPORT[mine]
        for target, _, line in imports(name):
            for dep in _with_parents(target, name):
                same_room = room(dep) == mine or (
                    mine == _folder(name) and _folder(dep) == mine  # not from a leaf
                )
                if dep == "hpcckpt" or same_room or "*" in allowed:
                    continue
                inside = any(dep == a or dep.startswith(a + ".") for a in allowed)
                holds = any(a.startswith(dep + ".") for a in allowed)  # a package's __init__
                if not (inside or holds):
                    wrong.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {dep}")
    assert not wrong, "imports against docs/architecture.md:\n" + "\n".join(sorted(set(wrong)))


def _folder(name: str) -> str:
    """``hpcckpt.rundir`` for ``hpcckpt.rundir.events``; a top-level module is its own."""
    return ".".join(name.split(".")[:2])


def test_store_imports_nothing_of_coord_or_job():
    bad = [
        f"{name} -> {dep}"
        for name in MODULES
        if name.startswith("hpcckpt.store")
        for dep in GRAPH[name]
        if dep.startswith(("hpcckpt.coord", "hpcckpt.job", "hpcckpt.cli", "hpcckpt.slurm"))
    ]
    assert not bad, bad


def _reach(name: str) -> set[str]:
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


@pytest.mark.parametrize("light", LIGHT)
def test_the_wrapper_side_never_imports_hdf5_or_mpi(light):
    bad = []
    for name in MODULES:
        if not (name == light or name.startswith(light + ".")):
            continue
        for mod in {name, *_reach(name)}:
            for target, _, line in imports(mod):
                if target.split(".")[0] in HEAVY:
                    bad.append(f"{name} reaches {mod}:{line} importing {target}")
    assert not bad, "\n".join(bad)


def test_function_level_imports_are_listed_with_a_reason():
    unlisted = []
    for name in MODULES:
        for target, lazy, line in imports(name):
            heavy = target.split(".")[0] in (*HEAVY, "numpy", "matplotlib", "xxhash")
            if lazy and (target.startswith("hpcckpt") or heavy):
                if not lazy_allowed(name, target):
                    unlisted.append(f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}")
    assert not unlisted, (
        "function-level imports not in LAZY (import at the top, or say why):\n"
        + "\n".join(unlisted)
    )


def test_the_checker_sees_a_cycle_and_a_wrong_import():
    """The checks above can fail: a made-up cycle and a store importing the wrapper."""
    fake = dict(GRAPH)
    fake["hpcckpt.rundir.env"] = ["hpcckpt.rundir.events"]
    assert "hpcckpt.rundir.env" in _cycle_members(fake)
    assert not any(dep.startswith("hpcckpt.job") for dep in GRAPH["hpcckpt.store.catalog"])
    assert room("hpcckpt.store.catalog") == "hpcckpt.store"
    assert "hpcckpt.job" not in MAY_IMPORT["hpcckpt.store"]


def _cycle_members(graph: dict[str, list[str]]) -> set[str]:
    members: set[str] = set()
    for start in graph:
        todo, seen = list(graph[start]), set()
        while todo:
            node = todo.pop()
            if node == start:
                members.add(start)
                break
            if node not in seen and node in graph:
                seen.add(node)
                todo.extend(graph[node])
    return members
