"""A rank's node-local data file kept mapped between saves (hpcckpt/store/tier/data_map.py):
the copy is written through the map, bit for bit, into the same pages save after save."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.store.io import blocks, filesystem
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier.data_map import DataMap, maps_well

BLOCK = 4096


@pytest.fixture
def shm():
    """A directory on /dev/shm (tmpfs on every Linux this runs on), removed after."""
    path = Path("/dev/shm") / f"hpcckpt-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def arrays_of(k: float) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(int(k))
    return {
        "u": rng.random(300001) * k,
        "t": (np.arange(7 * 9, dtype=np.int16).reshape(7, 9) * int(k)).T,  # not contiguous
        "e": np.empty((0, 3)),
        "s": np.array(k),
    }


def file_bytes(path: Path, offsets: dict[str, int], arrays: dict[str, np.ndarray]) -> dict:
    raw = path.read_bytes()
    return {n: raw[offsets[n] : offsets[n] + a.nbytes] for n, a in arrays.items()}


def test_memory_file_systems_are_mapped_and_disks_are_not(shm, tmp_path):
    assert maps_well(shm) and maps_well(shm / "not-made-yet")
    expected = filesystem.mountinfo_type(tmp_path) in ("tmpfs", "ramfs")
    assert maps_well(tmp_path) == expected


def test_written_through_the_map_bit_for_bit_hashed_like_block_hashes(shm):
    dm = DataMap()
    src = arrays_of(3.0)
    views, hashes, offsets = dm.write(shm, 5, 0, src, BLOCK, 0o600, hashed=True)
    path = shm / fast_tier.data_name(5, 0)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert all(off % fast_tier.ALIGN == 0 for off in offsets.values())
    on_disk = file_bytes(path, offsets, src)
    for name, a in src.items():
        assert on_disk[name] == np.ascontiguousarray(a).tobytes()
        assert views[name].tobytes() == np.ascontiguousarray(a).tobytes()
        assert not views[name].flags.writeable
        assert np.array_equal(hashes[name], blocks.block_hashes(a, BLOCK))
    before = src["u"].copy()
    src["u"][:] = -1.0  # the application goes on: the copy keeps the values at the save
    assert views["u"].tobytes() == before.tobytes()


def test_a_recycled_file_is_written_in_the_same_mapping_and_a_new_one_is_mapped_anew(shm):
    dm = DataMap()
    first, _, _ = dm.write(shm, 1, 0, arrays_of(1.0), BLOCK, 0o600, hashed=False)
    area, inode = dm._area, os.stat(shm / fast_tier.data_name(1, 0)).st_ino
    fast_tier.recycle(shm, 0, 2)  # what the tier does once the directory holds step 1
    src = arrays_of(2.0)
    views, hashes, offsets = dm.write(shm, 2, 0, src, BLOCK, 0o600, hashed=False, reuse=True)
    path = shm / fast_tier.data_name(2, 0)
    assert hashes == {} and dm._area is area and os.stat(path).st_ino == inode
    assert file_bytes(path, offsets, src)["u"] == src["u"].tobytes()
    bigger = {"u": np.arange(400000.0)}  # another size: truncated and mapped again
    fast_tier.recycle(shm, 0, 3)
    views, _, offsets = dm.write(shm, 3, 0, bigger, BLOCK, 0o600, hashed=False, reuse=True)
    path = shm / fast_tier.data_name(3, 0)
    assert dm._area is not area and os.stat(path).st_size == -(-3200000 // 4096) * 4096
    assert views["u"].tobytes() == bigger["u"].tobytes() == path.read_bytes()[:3200000]
    other, _, _ = dm.write(shm, 4, 0, bigger, BLOCK, 0o600, hashed=False)  # a new file
    assert os.stat(shm / fast_tier.data_name(4, 0)).st_ino != os.stat(path).st_ino
    assert other["u"].tobytes() == bigger["u"].tobytes()


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs at tmp_path/fs, unmounted afterwards."""
    import subprocess

    mnt = tmp_path / "fs"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root / CAP_SYS_ADMIN): {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_tmpfs_fails_the_copy_with_enospc_not_a_sigbus(small_tmpfs):
    """Every page is allocated before the file is mapped: a copy larger than the tmpfs is
    an OSError (ENOSPC) the save reports, never a SIGBUS that kills the process; a
    reservation that does not fit is let go, and the copy that fits is written."""
    import errno

    dm = DataMap()
    too_big = {"u": np.ones((6 << 20) // 8)}
    with pytest.raises(OSError) as raised:
        dm.write(small_tmpfs, 1, 0, too_big, BLOCK, 0o600, hashed=False)
    assert raised.value.errno == errno.ENOSPC
    assert dm.reserve(small_tmpfs / "c", 0, 6 << 20, 0o600) is None  # no such directory
    (small_tmpfs / "c").mkdir()
    assert dm.reserve(small_tmpfs / "c", 0, 6 << 20, 0o600) is not None  # made, sparse
    dm.close()  # waits for the thread: its allocation failed, the mapping is let go
    assert dm._key is None and dm._area is None
    fits = {"u": np.arange((1 << 20) // 8, dtype=np.float64)}
    views, _, _ = dm.write(small_tmpfs / "c", 2, 0, fits, BLOCK, 0o600, hashed=False)
    assert views["u"].tobytes() == fits["u"].tobytes()
