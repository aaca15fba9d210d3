"""The one atomic write: whole or not at all, the mode asked, fsynced file and directory;
and no module of the package renames a file by itself."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hpcckpt import atomicfile
from hpcckpt.atomicfile import atomic_file, atomic_path, atomic_write, rename

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpcckpt"
HOME = PKG / "atomicfile.py"


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


# -- whole or not at all -------------------------------------------------------------------
def test_the_new_contents_appear_only_when_the_block_ends(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b"old")
    with atomic_file(path, mode=0o600) as out:
        out.write(b"new ")
        out.flush()
        assert path.read_bytes() == b"old"
        (temp,) = set(names(tmp_path)) - {"f.json"}
        assert temp.startswith(".f.json.") and temp.endswith(".tmp")
        out.write(b"contents")
    assert path.read_bytes() == b"new contents"
    assert names(tmp_path) == ["f.json"]


@pytest.mark.parametrize("error", [ValueError("a bug"), OSError(28, "No space left on device")])
@pytest.mark.parametrize("how", ["file", "path"])
def test_a_failure_leaves_the_old_file_and_no_temporary(tmp_path, error, how):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(type(error)):
        if how == "file":
            with atomic_file(path, mode=0o600, temp="f.part") as out:
                out.write(b"half")
                raise error
        else:
            with atomic_path(path, mode=0o600, temp="f.part") as tmp:
                tmp.write_bytes(b"half")
                raise error
    assert path.read_bytes() == b"old"
    assert names(tmp_path) == ["f"]


def test_a_failed_rename_leaves_no_temporary(tmp_path):
    path = tmp_path / "d"
    path.mkdir()
    (path / "inside").write_text("a directory in the way")
    with pytest.raises(OSError):
        atomic_write(path, b"new", mode=0o600)
    assert names(tmp_path) == ["d"] and names(path) == ["inside"]


def test_a_writer_that_creates_nothing_publishes_nothing(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(FileNotFoundError):
        with atomic_path(path, mode=None):
            pass
    assert path.read_bytes() == b"old" and names(tmp_path) == ["f"]


def test_a_process_killed_mid_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"old" * 1000)
    code = (
        "import os, signal, sys\n"
        "from hpcckpt.atomicfile import atomic_file\n"
        "with atomic_file(sys.argv[1], mode=0o600, temp='f.tmp') as out:\n"
        "    out.write(b'x' * (1 << 20)); out.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert path.read_bytes() == b"old" * 1000
    assert (tmp_path / "f.tmp").stat().st_size == 1 << 20  # the cut write stays unnamed
    atomic_write(path, b"next", mode=0o600, temp="f.tmp")  # and is no obstacle to the next
    assert path.read_bytes() == b"next" and names(tmp_path) == ["f"]


def test_a_link_planted_at_the_temporary_name_is_never_followed(tmp_path):
    victim = tmp_path / "precious"
    victim.write_text("keep me")
    d = tmp_path / "d"
    d.mkdir()
    os.symlink(victim, d / "f.tmp")
    os.symlink(victim, d / "g.tmp")
    atomic_write(d / "f", "data", mode=0o600, temp="f.tmp")
    with atomic_path(d / "g", mode=0o600, temp="g.tmp") as tmp:
        tmp.write_text("more")  # a writer that follows links finds none there
    assert victim.read_text() == "keep me"
    assert (d / "f").read_text() == "data" and not (d / "f").is_symlink()
    assert names(d) == ["f", "g"]


def test_text_is_written_as_utf8(tmp_path):
    atomic_write(tmp_path / "f", "é\n", mode=None)
    assert (tmp_path / "f").read_bytes() == "é\n".encode()


# -- modes ---------------------------------------------------------------------------------
@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_to(mask: int) -> None:
        os.umask(mask)

    yield set_to
    os.umask(old)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o000])
@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_the_mode_asked_whatever_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    atomic_write(tmp_path / "a", b"x", mode=mode)
    with atomic_path(tmp_path / "b", mode=mode) as tmp:
        tmp.write_bytes(b"x")  # created by its writer with 0o666 less the umask
    assert mode_of(tmp_path / "a") == mode and mode_of(tmp_path / "b") == mode


@pytest.mark.parametrize("mask", [0o022, 0o077])
def test_no_mode_is_what_open_gives(tmp_path, umask, mask):
    umask(mask)
    atomic_write(tmp_path / "a", b"x", mode=None)
    with atomic_path(tmp_path / "b", mode=None) as tmp:
        shutil.copyfile(tmp_path / "a", tmp)
    os.chmod(tmp_path / "a", 0o604)
    with atomic_path(tmp_path / "c", mode=None) as tmp:
        shutil.copy2(tmp_path / "a", tmp)  # a writer's own mode is kept
    assert mode_of(tmp_path / "b") == 0o666 & ~mask
    assert mode_of(tmp_path / "c") == 0o604


# -- durability ----------------------------------------------------------------------------
@pytest.fixture
def syncs(monkeypatch):
    """The fsyncs and renames made, in order: ("fsync", name, mode) and ("rename", a, b)."""
    calls: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        calls.append(("fsync", target.name, stat.S_IMODE(os.fstat(fd).st_mode)))
        real_fsync(fd)

    def replace(src, dst):
        calls.append(("rename", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    return calls


@pytest.mark.parametrize("how", ["write", "file", "path"])
def test_the_file_is_fsynced_with_its_mode_before_the_rename_then_the_directory(
    tmp_path, syncs, how
):
    d = tmp_path / "d"
    d.mkdir()
    if how == "write":
        atomic_write(d / "f", b"x", mode=0o640, temp="f.tmp")
    elif how == "file":
        with atomic_file(d / "f", mode=0o640, temp="f.tmp") as out:
            out.write(b"x")
    else:
        with atomic_path(d / "f", mode=0o640, temp="f.tmp") as tmp:
            tmp.write_bytes(b"x")
    assert syncs == [
        ("fsync", "f.tmp", 0o640),
        ("rename", "f.tmp", "f"),
        ("fsync", "d", mode_of(d)),
    ]


def test_not_durable_renames_without_any_fsync(tmp_path, syncs):
    atomic_write(tmp_path / "f", b"x", mode=None, durable=False, temp="f.tmp")
    with atomic_path(tmp_path / "g", mode=0o600, durable=False, temp="g.tmp") as tmp:
        tmp.write_bytes(b"x")
    rename(tmp_path / "g", tmp_path / "h", durable=False)
    assert syncs == [("rename", "f.tmp", "f"), ("rename", "g.tmp", "g"), ("rename", "g", "h")]


def test_a_durable_rename_fsyncs_the_new_names_directory(tmp_path, syncs):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x")
    rename(tmp_path / "a" / "f", tmp_path / "b" / "g", durable=True)
    assert syncs == [("rename", "f", "g"), ("fsync", "b", mode_of(tmp_path / "b"))]


def test_the_system_calls_in_order(tmp_path):
    """The same seen by the kernel (strace): fsync of the file, rename, fsync of the
    directory, each on the right descriptor."""
    strace = shutil.which("strace")
    if strace is None:
        pytest.fail("strace not found: install it (apt-get install strace)")
    d = tmp_path / "d"
    d.mkdir()
    log = tmp_path / "strace.log"
    code = (
        "import sys\nfrom hpcckpt.atomicfile import atomic_write\n"
        "atomic_write(sys.argv[1], b'x', mode=0o600, temp='f.tmp')\n"
    )
    argv = [
        strace,
        "-f",
        "-y",
        "-o",
        str(log),
        "-e",
        "trace=fsync,fdatasync,rename,renameat,renameat2",
    ]
    # -B: Python's own renames (of .pyc files it caches) stay out of the log
    subprocess.run([*argv, sys.executable, "-B", "-c", code, str(d / "f")], cwd=ROOT, check=True)
    calls = [
        line.split(None, 1)[1].split(" = ")[0]
        for line in log.read_text().splitlines()
        if str(d) in line and "resumed" not in line
    ]
    assert len(calls) == 3, calls
    assert calls[0].startswith("fsync(") and calls[0].endswith(f"<{d / 'f.tmp'}>)"), calls
    assert calls[1].startswith("rename") and "f.tmp" in calls[1], calls
    assert calls[2].startswith("fsync(") and calls[2].endswith(f"<{d}>)"), calls


# -- one home ------------------------------------------------------------------------------
#: Receivers whose ``.replace(x)`` is not a file's (``dataclasses.replace(obj)``).
NOT_FILES = {"dataclasses"}


def renames(source: str) -> list[tuple[int, str]]:
    """(line, call) of every rename in ``source``: ``os.replace``/``os.rename``/
    ``os.renames``, ``from os import replace``, ``x.rename(...)`` (a Path's) and
    ``x.replace(y)`` with one argument (a Path's; ``str.replace`` takes two)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            found += [
                (node.lineno, f"from os import {a.name}")
                for a in node.names
                if a.name in ("replace", "rename", "renames")
            ]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        attr, owner = node.func.attr, node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else None
        if owner_name == "os" and attr in ("replace", "rename", "renames"):
            found.append((node.lineno, f"os.{attr}"))
        elif attr == "rename":
            found.append((node.lineno, f"{ast.unparse(owner)}.rename"))
        elif (
            attr == "replace"
            and len(node.args) == 1
            and not node.keywords
            and owner_name not in NOT_FILES
        ):
            found.append((node.lineno, f"{ast.unparse(owner)}.replace"))
    return found


def test_no_module_renames_a_file_but_through_atomicfile():
    """A file is published by :mod:`hpcckpt.atomicfile` only: a rename written by hand
    forgets an fsync, the clean-up or the mode (as eight of them once did)."""
    found = [
        f"{path.relative_to(ROOT)}:{line}: {call}"
        for path in sorted(PKG.rglob("*.py"))
        if path != HOME
        for line, call in renames(path.read_text())
    ]
    assert not found, (
        "files renamed by hand (use hpcckpt.atomicfile: atomic_write, atomic_file, "
        "atomic_path or rename):\n" + "\n".join(found)
    )


def test_the_rename_check_sees_every_form():
    source = (
        "import os, dataclasses\nfrom os import replace\n"
        "os.replace(a, b)\nos.rename(a, b)\ntmp.rename(final)\nPath(t).replace(final)\n"
        "s.replace('-', '')\ndataclasses.replace(r)\nd.replace(year=1)\n"
    )
    assert renames(source) == [
        (2, "from os import replace"),
        (3, "os.replace"),
        (4, "os.rename"),
        (5, "tmp.rename"),
        (6, "Path(t).replace"),
    ]


def test_the_store_uses_the_same_functions():
    from hpcckpt.store.io import durability

    assert durability.atomic_write is atomic_write and durability.rename is rename
    assert durability.fsync_path is atomicfile.fsync_path
