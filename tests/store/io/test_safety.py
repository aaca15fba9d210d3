"""``hpcckpt.store.io.safety`` on its own: exact modes whatever the umask, no write or delete
through a planted link or into a directory, a full disk or file size limit named."""

from __future__ import annotations

import errno
import os
import resource
import stat

import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.io import safety


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode_of(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_modes_are_owner_only_or_group_readable():
    assert safety.modes(False) == (0o600, 0o700)
    assert safety.modes(True) == (0o640, 0o750)


def test_write_private_gives_the_exact_mode_and_never_writes_through_a_link(tmp_path, loose_umask):
    outside = tmp_path / "outside"
    outside.write_text("keep")
    planted = tmp_path / "f"
    planted.symlink_to(outside)
    safety.write_private(planted, "new", 0o640)
    assert outside.read_text() == "keep" and not planted.is_symlink()
    assert planted.read_text() == "new" and mode_of(planted) == 0o640
    with pytest.raises(FileExistsError):  # how a lock file is taken
        safety.write_private(planted, "again", replace=False)
    assert planted.read_text() == "new"


def test_create_private_fails_on_any_existing_name(tmp_path, loose_umask):
    path = tmp_path / "f"
    safety.create_private(path)
    assert path.read_bytes() == b"" and mode_of(path) == safety.FILE_MODE
    with pytest.raises(FileExistsError):
        safety.create_private(path)


def test_remove_leftover_unlinks_files_and_links_never_directories(tmp_path):
    target = tmp_path / "target"
    target.write_text("keep")
    link, plain, directory = tmp_path / "l.partial", tmp_path / "p.partial", tmp_path / "d.partial"
    link.symlink_to(target)
    plain.write_text("x")
    directory.mkdir()
    for path in (link, plain, directory, tmp_path / "missing.partial"):
        safety.remove_leftover(path)
    assert not os.path.lexists(link) and not plain.exists() and directory.is_dir()
    assert target.read_text() == "keep"


def test_set_mode_does_not_follow_a_link(tmp_path):
    target = tmp_path / "target"
    target.write_text("x")
    target.chmod(0o600)
    link = tmp_path / "link"
    link.symlink_to(target)
    safety.set_mode(link, 0o644)
    assert mode_of(target) == 0o600
    safety.set_mode(target, 0o640)
    assert mode_of(target) == 0o640


def test_make_directory_sets_its_mode_and_keeps_an_existing_ones(tmp_path, loose_umask):
    new = tmp_path / "a" / "b"
    safety.make_directory(new, 0o750)
    assert mode_of(new) == 0o750
    new.chmod(0o755)
    safety.make_directory(new, 0o700)
    assert mode_of(new) == 0o755


def test_check_regular_file_refuses_links_and_fifos(tmp_path):
    regular = tmp_path / "ckpt.h5"
    regular.write_bytes(b"x")
    safety.check_regular_file(regular)
    link = tmp_path / "link.h5"
    link.symlink_to(regular)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        safety.check_regular_file(link)
    fifo = tmp_path / "fifo.h5"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        safety.check_regular_file(fifo)
    with pytest.raises(CorruptCheckpoint, match="unreadable"):
        safety.check_regular_file(tmp_path / "missing.h5")


def test_check_free_space_names_enospc_and_the_file_size_limit(tmp_path, monkeypatch):
    safety.check_free_space(tmp_path, 1)
    monkeypatch.setattr(safety, "free_bytes", lambda directory: 1000)
    with pytest.raises(OSError, match="ENOSPC") as got:
        safety.check_free_space(tmp_path, 1 << 20)
    assert got.value.errno == errno.ENOSPC and str(tmp_path) in str(got.value)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (3000, resource.RLIM_INFINITY))
    with pytest.raises(OSError, match="ulimit -f") as got:
        safety.check_free_space(tmp_path, 1)
    assert got.value.errno == errno.EFBIG
