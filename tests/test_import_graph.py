"""The shape of the package, checked statically: no import cycles, each folder imports only
the folders below it (docs/architecture.md), the wrapper never loads HDF5 or MPI, no
module reaches into another's private names.

Every ``import`` counts, in a function too; a function-level import of an hpcckpt module
or of a heavy library is allowed only where :data:`LAZY` says why (start-up time). Imports
under ``if TYPE_CHECKING:`` count for cycles and rooms (they are dependencies of the
design, and the first step to a runtime cycle), not for what a process loads.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpcckpt"

#: What each room may import from hpcckpt (itself always). The leaves (``procfs``,
#: ``libc``, ``signames``, ``atomicfile``, ``_version``, ``rundir.env``) are listed where
#: they are used.
MAY_IMPORT: dict[str, set[str]] = {
    "hpcckpt._version": set(),
    "hpcckpt.signames": set(),
    "hpcckpt.procfs": set(),
    "hpcckpt.libc": set(),
    "hpcckpt.atomicfile": set(),
    "hpcckpt.rundir.env": set(),
    "hpcckpt.policy": set(),
    "hpcckpt.slurm": {"hpcckpt.rundir.env", "hpcckpt.signames"},
    "hpcckpt.rundir": {"hpcckpt.slurm", "hpcckpt.signames", "hpcckpt.atomicfile"},
    "hpcckpt.store": {"hpcckpt.procfs", "hpcckpt.libc", "hpcckpt.atomicfile", "hpcckpt._version"},
    "hpcckpt.report": {"hpcckpt.rundir", "hpcckpt.slurm", "hpcckpt.policy", "hpcckpt.signames"},
    "hpcckpt.cluster": {
        "hpcckpt.slurm",
        "hpcckpt.rundir",
        "hpcckpt.procfs",
        "hpcckpt.signames",
        "hpcckpt.atomicfile",
    },
    "hpcckpt.coord": {
        "hpcckpt.store",
        "hpcckpt.policy",
        "hpcckpt.rundir",
        "hpcckpt.slurm",
        "hpcckpt.procfs",
        "hpcckpt.signames",
        "hpcckpt.atomicfile",
        "hpcckpt._version",
    },
    "hpcckpt.job": {
        "hpcckpt.rundir",
        "hpcckpt.slurm",
        "hpcckpt.policy",
        "hpcckpt.procfs",
        "hpcckpt.libc",
        "hpcckpt.signames",
        "hpcckpt.atomicfile",
    },
    "hpcckpt.cli": {"*"},
    "hpcckpt": {"hpcckpt.coord", "hpcckpt._version"},
}

#: The store's rooms from the bottom up (docs/architecture.md, "Inside the store"): a front
#: module directly under ``store/`` or a sub-package (a subject). A module of the store
#: imports only its own room and the rooms before it.
STORE_ORDER = [
    "hpcckpt.store.comm",
    "hpcckpt.store.errors",
    "hpcckpt.store.io",
    "hpcckpt.store.agreement",
    "hpcckpt.store.tree",
    "hpcckpt.store.results",
    "hpcckpt.store.file",
    "hpcckpt.store.retention",
    "hpcckpt.store.mirror",
    "hpcckpt.store.tier",
    "hpcckpt.store.save",
    "hpcckpt.store.restore",
    "hpcckpt.store.export",
    "hpcckpt.store.options",
    "hpcckpt.store.store",
    "hpcckpt.store.catalog",
]
#: The front: the modules directly under ``store/`` besides ``__init__`` (the public API).
STORE_FRONT = {
    "hpcckpt.store.store",
    "hpcckpt.store.options",
    "hpcckpt.store.results",
    "hpcckpt.store.errors",
    "hpcckpt.store.agreement",
    "hpcckpt.store.retention",
    "hpcckpt.store.catalog",
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
    # each transport of the communicator loads its library only when it is the one used
    ("hpcckpt.store.comm", "hpcckpt.store.comm.mpi"): "mpi4py (an MPI library) only for MPI",
    ("hpcckpt.store.comm", "hpcckpt.store.comm.torch_dist"): "torch only for torch.distributed",
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


class Import(NamedTuple):
    target: str  # the module imported, or the module a name is imported from
    lazy: bool  # at function level
    line: int
    typing: bool  # under ``if TYPE_CHECKING:``: never runs


def imports(name: str, *, typing: bool = True) -> Iterator[Import]:
    """Every import in module ``name``; those under ``if TYPE_CHECKING:`` only with
    ``typing`` (they are at the top, not function-level, but never run)."""
    tree = ast.parse(MODULES[name].read_text())
    top = {id(n) for n in tree.body}
    typing_only = {
        id(sub)
        for node in tree.body
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            only = id(node) in typing_only
            if only and not typing:
                continue
            for target in _targets(node, name):
                yield Import(target, id(node) not in top and not only, node.lineno, only)


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


def _graph(typing: bool) -> dict[str, list[str]]:
    return {
        name: sorted(
            {dep for imp in imports(name, typing=typing) for dep in _with_parents(imp.target, name)}
            - {name}
        )
        for name in MODULES
    }


#: Module -> the hpcckpt modules it imports, those under ``if TYPE_CHECKING:`` too.
GRAPH = _graph(typing=True)
#: The same without them: what importing a module runs.
RUNTIME_GRAPH = _graph(typing=False)


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
        for target, _, line, _ in imports(name):
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
    """The hpcckpt modules importing ``name`` runs."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        for dep in RUNTIME_GRAPH[todo.pop()]:
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
            for target, _, line, _ in imports(mod, typing=False):
                if target.split(".")[0] in HEAVY:
                    bad.append(f"{name} reaches {mod}:{line} importing {target}")
    assert not bad, "\n".join(bad)


#: The one module that may import mpi4py: the communicator's MPI transport.
MPI_HOME = "hpcckpt.store.comm.mpi"


def mpi_importers() -> list[str]:
    """Modules other than :data:`MPI_HOME` that import mpi4py (at the top or in a function)."""
    return sorted(
        f"{MODULES[name].relative_to(ROOT)}:{line} imports {target}"
        for name in MODULES
        if name != MPI_HOME
        for target, _, line, _ in imports(name)
        if target.split(".")[0] == "mpi4py"
    )


def test_only_the_communicators_mpi_transport_imports_mpi4py():
    """Everything else talks to other ranks through hpcckpt.store.comm's interface, so a
    torch job without an MPI library never loads mpi4py."""
    assert not mpi_importers(), "\n".join(mpi_importers())
    assert any(t.startswith("mpi4py") for t, *_ in imports(MPI_HOME)), "the MPI transport moved"


def test_the_mpi4py_check_sees_an_import(monkeypatch):
    """The check above can fail: another module with the MPI transport's imports."""
    monkeypatch.setitem(MODULES, "hpcckpt.store.agreement_copy", MODULES[MPI_HOME])
    assert any("imports mpi4py" in line for line in mpi_importers())


def test_function_level_imports_are_listed_with_a_reason():
    unlisted = []
    for name in MODULES:
        for target, lazy, line, _ in imports(name):
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


def store_room(name: str) -> str | None:
    """The room of STORE_ORDER that store module ``name`` belongs to (None: not in one)."""
    return next((r for r in STORE_ORDER if name == r or name.startswith(r + ".")), None)


def store_violations(graph: dict[str, list[str]]) -> list[str]:
    """Imports against the store's order, and imports of the store's insides from outside."""
    wrong = []
    for name, deps in graph.items():
        inside = name.startswith("hpcckpt.store.")
        for dep in deps:
            if not dep.startswith("hpcckpt.store"):
                continue
            if not inside:
                if dep != "hpcckpt.store" and dep not in STORE_FRONT:
                    wrong.append(f"{name} imports {dep}: import it from hpcckpt.store")
                continue
            if dep == "hpcckpt.store":
                wrong.append(f"{name} imports the public API: import the defining module")
                continue
            mine, theirs = store_room(name), store_room(dep)
            if mine is None or theirs is None:
                wrong.append(f"{name} -> {dep}: a module of the store outside STORE_ORDER")
            elif STORE_ORDER.index(theirs) > STORE_ORDER.index(mine):
                wrong.append(f"{name} ({mine}) imports {dep} ({theirs}), a room above it")
    return sorted(wrong)


def test_the_store_rooms_import_only_the_rooms_below_them():
    """Sub-packages and front modules of the store in one order, one way (STORE_ORDER)."""
    assert not store_violations(GRAPH), "\n".join(store_violations(GRAPH))


def test_every_module_directly_under_store_is_the_front():
    """Only the front lies directly under store/: every other module is in a sub-package."""
    direct = {
        name
        for name, path in MODULES.items()
        if name.startswith("hpcckpt.store.")
        and path.parent == PKG / "store"
        and path.name != "__init__.py"
    }
    assert direct == STORE_FRONT, sorted(direct ^ STORE_FRONT)
    packages = {
        name
        for name, path in MODULES.items()
        if name.startswith("hpcckpt.store.") and path.name == "__init__.py"
    }
    assert packages <= set(STORE_ORDER), sorted(packages - set(STORE_ORDER))


def test_the_public_api_names_resolve():
    """Every name hpcckpt.store exports is found where its table says."""
    import hpcckpt.store as api

    missing = [name for name in api.__all__ if getattr(api, name, None) is None]
    assert not missing, missing


def test_the_store_check_sees_an_upward_import_and_a_reach_inside():
    """The checks above can fail: io importing the commit, coord reaching into a package."""
    fake = {
        "hpcckpt.store.io.blocks": ["hpcckpt.store.save.commit"],
        "hpcckpt.coord.checkpointer": ["hpcckpt.store.mirror.worker", "hpcckpt.store.options"],
        "hpcckpt.store.save.commit": ["hpcckpt.store"],
    }
    assert store_violations(fake) == [
        "hpcckpt.coord.checkpointer imports hpcckpt.store.mirror.worker: import it from "
        "hpcckpt.store",
        "hpcckpt.store.io.blocks (hpcckpt.store.io) imports hpcckpt.store.save.commit "
        "(hpcckpt.store.save), a room above it",
        "hpcckpt.store.save.commit imports the public API: import the defining module",
    ]


#: The most lines a module may have: past it, a module holds more than one idea (split it
#: along a seam, as docs/structure.md's map shows).
MAX_LINES = 700


def test_no_module_is_over_the_line_limit():
    long = {
        str(path.relative_to(ROOT)): n
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` of a chain of attributes on a name; None for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def private_crossings(name: str) -> Iterator[str]:
    """Where module ``name`` takes a private name of another hpcckpt module: ``from
    hpcckpt.x import _y``, or ``x._y`` on a name bound to an hpcckpt module."""
    tree = ast.parse(MODULES[name].read_text())
    where = MODULES[name].relative_to(ROOT)
    bound: dict[str, str] = {}  # local name -> the hpcckpt module it is
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            for alias, target in zip(node.names, _targets(node, name), strict=True):
                if not target.startswith("hpcckpt") or target == name:
                    continue
                if target.endswith("." + alias.name):  # a module
                    bound[alias.asname or alias.name] = target
                elif _private(alias.name):
                    yield f"{where}:{node.lineno} imports {alias.name} from {target}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            dotted = _dotted(node.value)
            if dotted is None or dotted.split(".")[0] not in bound:
                continue
            first, *rest = dotted.split(".")
            module = ".".join([bound[first], *rest])
            if module in MODULES and module != name:
                yield f"{where}:{node.lineno} uses {module}.{node.attr}"


def test_no_module_takes_another_modules_private_names():
    """A leading underscore means "this module only": another module that needs the
    name needs it made public (or the code moved), not reached into."""
    found = [crossing for name in MODULES for crossing in private_crossings(name)]
    assert not found, "private names used across modules:\n" + "\n".join(found)


def test_the_private_name_check_sees_both_kinds(tmp_path, monkeypatch):
    """The check above can fail: an import of a private name and an attribute access."""
    fake = tmp_path / "hpcckpt" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(
        "from hpcckpt.store.io.safety import _exact_mode, write_private\n"
        "from hpcckpt.store.io import safety\n"
        "import hpcckpt.store.file.layout as lay\n"
        "import hpcckpt.store.file.reader\n"
        "safety._exact_mode(0, 0o600); lay._x; safety.__name__; safety.modes\n"
        "hpcckpt.store.file.reader._y\n"
    )
    monkeypatch.setitem(MODULES, "hpcckpt.fake", fake)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    found = sorted(private_crossings("hpcckpt.fake"))
    assert found == [
        "hpcckpt/fake.py:1 imports _exact_mode from hpcckpt.store.io.safety",
        "hpcckpt/fake.py:5 uses hpcckpt.store.file.layout._x",
        "hpcckpt/fake.py:5 uses hpcckpt.store.io.safety._exact_mode",
        "hpcckpt/fake.py:6 uses hpcckpt.store.file.reader._y",
    ]
