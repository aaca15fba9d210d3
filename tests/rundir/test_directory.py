"""What is wrong with a checkpoint directory, and the fix (hpcckpt/rundir/directory.py):
real paths that are not directories, and directories refused even to root (immutable)."""

from __future__ import annotations

import errno
import os

import pytest

from hpcckpt.rundir import directory
from tests.permission_helpers import immutable, who


def test_a_usable_directory_passes_the_probe_and_keeps_nothing(tmp_path):
    directory.probe(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_file(tmp_path):
    (tmp_path / "ck").write_text("x")
    msg = directory.explain(tmp_path / "ck", FileExistsError(errno.EEXIST, "File exists"))
    assert msg == (
        f"the checkpoint directory {tmp_path / 'ck'} exists and is not a directory (it is a "
        "regular file): choose another --ckpt-dir, or move the file away"
    )


def test_a_named_pipe_and_the_option_named(tmp_path):
    os.mkfifo(tmp_path / "ck")
    msg = directory.explain(tmp_path / "ck", OSError(errno.EEXIST, "x"), option="directory")
    assert "(it is a named pipe): choose another directory, or move the named pipe away" in msg


def test_a_dangling_symbolic_link(tmp_path):
    (tmp_path / "ck").symlink_to(tmp_path / "gone")
    msg = directory.explain(tmp_path / "ck", FileExistsError(errno.EEXIST, "File exists"))
    assert msg == (
        f"the checkpoint directory {tmp_path / 'ck'} is a symbolic link to {tmp_path / 'gone'}, "
        f"which does not exist: create {tmp_path / 'gone'}, or choose another --ckpt-dir"
    )


def test_a_file_where_a_parent_should_be(tmp_path):
    (tmp_path / "f").write_text("x")
    path = tmp_path / "f" / "ck"
    with pytest.raises(OSError) as err:
        path.mkdir(parents=True)
    assert directory.explain(path, err.value) == (
        f"cannot create the checkpoint directory {path}: {tmp_path / 'f'} exists and is not a "
        "directory; choose another --ckpt-dir"
    )


def test_a_parent_refused_even_to_root(tmp_path):
    parent = tmp_path / "p"
    parent.mkdir(mode=0o755)
    path = parent / "a" / "ck"
    with immutable(parent):
        with pytest.raises(OSError) as err:
            path.mkdir(parents=True)
        msg = directory.explain(path, err.value)
    assert msg.startswith(
        f"cannot create the checkpoint directory {path}: the directory above it {parent} "
        f"exists but cannot be written by user {who(os.geteuid())}: Operation not permitted "
        f"(mode 0755, owner {who(os.geteuid())}, group {who(os.getegid(), 'gid')}): it may be "
        f"immutable (lsattr -d {parent} shows an i"
    ), msg


def test_a_read_only_file_system(tmp_path, monkeypatch):
    def refused(_directory):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(directory, "probe", refused)
    msg = directory.explain(tmp_path, OSError(errno.EROFS, "Read-only file system"))
    assert msg == (
        f"the checkpoint directory {tmp_path} exists but cannot be written by user "
        f"{who(os.geteuid())}: it is on a read-only file system. Choose a --ckpt-dir on a "
        "writable file system"
    )


def test_a_writable_directory_with_another_error_says_that_error(tmp_path):
    error = OSError(errno.EIO, "Input/output error")
    assert directory.explain(tmp_path, error) == (
        f"cannot use the checkpoint directory {tmp_path}: [Errno 5] Input/output error"
    )
