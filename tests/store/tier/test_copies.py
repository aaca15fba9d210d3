"""Node-local copies (the fast tier): write, seal, scan, load, remove; what scan must ignore."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.store.errors import CorruptCheckpoint
from hpcckpt.store.io import blocks
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tree.state_tree import decode_into, encode

BLOCK = 4096
MODE = 0o600


def make_state(step: int, rank: int = 0) -> dict:
    rng = np.random.default_rng(100 * step + rank)
    big = rng.standard_normal((3 * 512 + 77,))  # 3 blocks and a short one
    big[5] = np.nan
    return {
        "u": big,
        "grid": {"v": rng.integers(-(2**40), 2**40, (33, 17)), "mask": rng.random((9, 5)) > 0.5},
        "strided": np.arange(400, dtype=np.float32).reshape(20, 20)[::2, 3:],  # not contiguous
        "z": (np.arange(6) * (1 + 2j)).astype(np.complex64),
        "empty": np.empty((0, 4), dtype=np.int16),
        "t": 0.5 * step,
        "step": step,
        "rng": np.random.default_rng(rank),
    }


def stage(
    cache: Path, directory: Path, step: int, rank: int = 0, nranks: int = 2, uid: str = "u1"
) -> tuple[dict, Path]:
    """write_data + seal of one rank's state; (state, manifest path)."""
    state = make_state(step, rank)
    tree, arrays = encode(state)
    maps, hashes, offsets = fast_tier.write_data(cache, step, rank, arrays, BLOCK, MODE)
    path = fast_tier.seal(
        cache,
        step=step,
        uid=uid,
        rank=rank,
        nranks=nranks,
        directory=directory,
        block_size=BLOCK,
        tree=tree,
        arrays=arrays,
        hashes=hashes,
        offsets=offsets,
        mode=MODE,
    )
    return state, path


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path]:
    cache, directory = tmp_path / "cache", tmp_path / "ckpt"
    cache.mkdir()
    directory.mkdir()
    return cache, directory


def c_bytes(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# -- round trip ----------------------------------------------------------------------------
def test_write_data_gives_maps_hashes_and_aligned_offsets(dirs):
    cache, _ = dirs
    _, arrays = encode(make_state(3))
    maps, hashes, offsets = fast_tier.write_data(cache, 3, 1, arrays, BLOCK, MODE)
    data = cache / fast_tier.data_name(3, 1)
    assert data.name == "ckpt-0000000003.rank1.data"
    assert data.stat().st_mode & 0o777 == MODE
    assert set(maps) == set(hashes) == set(offsets) == set(arrays)
    for name, src in arrays.items():
        assert offsets[name] % fast_tier.ALIGN == 0
        assert maps[name].shape == src.shape and maps[name].dtype == src.dtype
        assert c_bytes(maps[name]) == c_bytes(src)
        assert np.array_equal(hashes[name], blocks.block_hashes(src, BLOCK))
        assert not maps[name].flags.writeable or src.size == 0  # read-only maps of the file
    ends = sorted((offsets[n], offsets[n] + a.nbytes) for n, a in arrays.items() if a.size)
    pairs = zip(ends, ends[1:], strict=False)
    assert all(end <= start for (_, end), (start, _) in pairs)  # no overlap
    assert data.stat().st_size % fast_tier.ALIGN == 0


def test_seal_scan_load_round_trip_is_bitwise(dirs):
    cache, directory = dirs
    state, manifest = stage(cache, directory, 7, rank=1, nranks=2)
    assert manifest.name == "ckpt-0000000007.rank1.json"
    assert not list(cache.glob("*.tmp"))
    (copy,) = fast_tier.scan(cache, directory, 1, 2)
    assert (copy.step, copy.uid, copy.rank, copy.nranks) == (7, "u1", 1, 2)
    assert copy.host == fast_tier.host()
    assert copy.directory == str(directory.absolute())
    assert copy.data_path == cache / fast_tier.data_name(7, 1)
    arrays = fast_tier.load(copy)
    _, expected = encode(state)
    assert set(arrays) == set(expected)
    for name, a in expected.items():
        assert arrays[name].dtype == a.dtype and arrays[name].shape == a.shape
        assert arrays[name].tobytes() == c_bytes(a), name

    target = {
        "u": np.zeros_like(state["u"]),
        "grid": {"v": np.zeros((33, 17), dtype=np.int64), "mask": np.zeros((9, 5), bool)},
        "strided": np.zeros((10, 17), np.float32),
        "z": np.zeros(6, np.complex64),
        "empty": np.empty((0, 4), np.int16),
        "t": None,
        "step": None,
        "rng": None,
    }
    held = target["u"]
    decode_into(target, copy.tree, arrays)
    assert target["u"] is held  # filled in place
    assert target["u"].tobytes() == state["u"].tobytes()  # NaN payload included
    assert target["t"] == 3.5 and target["step"] == 7
    assert target["rng"].random() == state["rng"].random()


def test_scan_lists_newest_first_and_load_reads_each(dirs):
    cache, directory = dirs
    states = {s: stage(cache, directory, s, rank=0, uid=f"u{s}")[0] for s in (3, 12, 8)}
    found = fast_tier.scan(cache, directory, 0, 2)
    assert [c.step for c in found] == [12, 8, 3]
    for copy in found:
        assert copy.uid == f"u{copy.step}"
        assert fast_tier.load(copy)["u"].tobytes() == states[copy.step]["u"].tobytes()


def test_scan_of_a_missing_cache_is_empty(tmp_path):
    assert fast_tier.scan(tmp_path / "nope", tmp_path, 0, 1) == []


# -- what scan ignores ---------------------------------------------------------------------
def edit_manifest(path: Path, **changes) -> None:
    doc = json.loads(path.read_text())
    doc.update(changes)
    path.write_text(json.dumps(doc))


def test_scan_ignores_other_ranks_rank_counts_and_directories(dirs, tmp_path):
    cache, directory = dirs
    stage(cache, directory, 5, rank=1, nranks=2)
    assert [c.step for c in fast_tier.scan(cache, directory, 1, 2)] == [5]
    assert fast_tier.scan(cache, directory, 0, 2) == []  # another rank's copy
    assert fast_tier.scan(cache, directory, 1, 3) == []  # written by 2 ranks, not 3
    assert fast_tier.scan(cache, tmp_path / "other", 1, 2) == []  # another job's directory
    other = tmp_path / "other"
    stage(cache, other, 6, rank=1, nranks=2)
    assert [c.step for c in fast_tier.scan(cache, directory, 1, 2)] == [5]
    assert [c.step for c in fast_tier.scan(cache, other, 1, 2)] == [6]


def test_scan_ignores_a_copy_made_on_another_host(dirs):
    cache, directory = dirs
    _, manifest = stage(cache, directory, 5)
    edit_manifest(manifest, host=fast_tier.host() + "-elsewhere")
    assert fast_tier.read_manifest(manifest) is not None  # readable, just not ours
    assert fast_tier.scan(cache, directory, 0, 2) == []


def test_scan_ignores_a_manifest_whose_content_disagrees_with_its_name(dirs):
    cache, directory = dirs
    _, manifest = stage(cache, directory, 5)
    os.replace(manifest, cache / fast_tier.manifest_name(9, 0))  # step 5 inside, 9 outside
    assert fast_tier.scan(cache, directory, 0, 2) == []
    _, manifest = stage(cache, directory, 4)
    os.replace(manifest, cache / fast_tier.manifest_name(4, 1))  # rank 0 inside, 1 outside
    assert fast_tier.scan(cache, directory, 1, 2) == []
    assert fast_tier.scan(cache, directory, 0, 2) == []


def test_scan_ignores_unsealed_data(dirs):
    cache, directory = dirs
    _, arrays = encode(make_state(5))
    fast_tier.write_data(cache, 5, 0, arrays, BLOCK, MODE)  # killed before seal
    (cache / (fast_tier.manifest_name(5, 0) + ".tmp")).write_text("{")  # a torn rename
    assert fast_tier.scan(cache, directory, 0, 2) == []


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json at all",
        "[1, 2, 3]",
        '{"format": "hpcckpt-local"}',
        "\0" * 100,
        '{"format": "something-else", "format_version": 1}',
    ],
    ids=["empty", "text", "list", "incomplete", "nul", "foreign"],
)
def test_scan_ignores_garbage_manifests(dirs, text):
    cache, directory = dirs
    stage(cache, directory, 3)
    (cache / fast_tier.manifest_name(8, 0)).write_text(text)
    assert [c.step for c in fast_tier.scan(cache, directory, 0, 2)] == [3]


@pytest.mark.parametrize(
    "change",
    [
        {"format_version": fast_tier.FORMAT_VERSION + 1},
        {"block_size": 100},  # not a valid block size
        {"tree": {"$t": "pickle", "v": "x"}},
        {"arrays": {"u": {"dtype": "|O", "shape": [3], "offset": 0, "checksum": 1}}},
        {"arrays": {"u": {"dtype": "<f8", "shape": [-3], "offset": 0, "checksum": 1}}},
        {"arrays": {"u": {"dtype": "<f8", "shape": [3], "offset": -8, "checksum": 1}}},
        {"arrays": {"u": {"dtype": "<f8", "shape": [3], "offset": 0}}},
        {"arrays": {"u": {"dtype": "<U3", "shape": [3], "offset": 0, "checksum": 1}}},
        {"step": "five"},
    ],
    ids=[
        "version",
        "block-size",
        "tree",
        "object-dtype",
        "negative-shape",
        "negative-offset",
        "no-checksum",
        "str-dtype",
        "step-text",
    ],
)
def test_read_manifest_rejects_bad_fields(dirs, change):
    cache, directory = dirs
    _, manifest = stage(cache, directory, 5)
    edit_manifest(manifest, **change)
    assert fast_tier.read_manifest(manifest) is None
    assert fast_tier.scan(cache, directory, 0, 2) == []


def test_scan_ignores_a_symlink_manifest(dirs, tmp_path):
    cache, directory = dirs
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _, real = stage(elsewhere, directory, 5)  # a valid manifest, outside the cache
    shutil.copy(elsewhere / fast_tier.data_name(5, 0), cache / fast_tier.data_name(5, 0))
    link = cache / fast_tier.manifest_name(5, 0)
    link.symlink_to(real)
    assert fast_tier.read_manifest(link) is None
    assert fast_tier.scan(cache, directory, 0, 2) == []
    assert [c.step for c in fast_tier.scan(elsewhere, directory, 0, 2)] == [5]


def test_scan_ignores_a_directory_or_fifo_named_like_a_manifest(dirs):
    cache, directory = dirs
    (cache / fast_tier.manifest_name(5, 0)).mkdir()
    os.mkfifo(cache / fast_tier.manifest_name(6, 0))
    assert fast_tier.scan(cache, directory, 0, 2) == []  # and does not block on the FIFO


# -- load verifies -------------------------------------------------------------------------
def test_load_raises_on_a_flipped_byte(dirs):
    cache, directory = dirs
    stage(cache, directory, 5)
    (copy,) = fast_tier.scan(cache, directory, 0, 2)
    offset = copy.arrays["grid/v"]["offset"] + 3 * 8 + 2  # inside the array, not the padding
    data = copy.data_path
    raw = bytearray(data.read_bytes())
    raw[offset] ^= 0x10
    data.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="grid/v.*checksum"):
        fast_tier.load(copy)


def test_load_raises_on_a_truncated_data_file(dirs):
    cache, directory = dirs
    stage(cache, directory, 5)
    (copy,) = fast_tier.scan(cache, directory, 0, 2)
    last = max(
        (info for info in copy.arrays.values() if np.prod(info["shape"]) > 0),
        key=lambda info: info["offset"],
    )
    os.truncate(copy.data_path, last["offset"] + 4)
    with pytest.raises(ValueError, match="past the end"):
        fast_tier.load(copy)


def test_load_raises_on_a_missing_or_linked_data_file(dirs, tmp_path):
    cache, directory = dirs
    stage(cache, directory, 5)
    (copy,) = fast_tier.scan(cache, directory, 0, 2)
    moved = tmp_path / "moved.data"
    os.replace(copy.data_path, moved)
    with pytest.raises((OSError, ValueError, CorruptCheckpoint)):
        fast_tier.load(copy)
    copy.data_path.symlink_to(moved)
    with pytest.raises(CorruptCheckpoint, match="symbolic link"):
        fast_tier.load(copy)


def test_set_aside_hides_a_copy(dirs):
    cache, directory = dirs
    stage(cache, directory, 5)
    stage(cache, directory, 4)
    newest = fast_tier.scan(cache, directory, 0, 2)[0]
    assert fast_tier.set_aside_file(newest.path)
    assert (cache / (fast_tier.manifest_name(5, 0) + ".bad")).is_file()
    assert not newest.path.exists()
    assert [c.step for c in fast_tier.scan(cache, directory, 0, 2)] == [4]
    assert not fast_tier.set_aside_file(newest.path)  # already gone: no error


# -- remove --------------------------------------------------------------------------------
def test_remove_keeps_one_step_and_other_ranks(dirs):
    cache, directory = dirs
    for step in (3, 5, 7):
        stage(cache, directory, step, rank=0)
    stage(cache, directory, 3, rank=1)
    (cache / (fast_tier.manifest_name(9, 0) + ".tmp")).write_text("{")
    (cache / (fast_tier.manifest_name(2, 0) + ".bad")).write_text("{}")
    (cache / "notes.txt").write_text("not ours")
    (cache / "ckpt-0000000003.rank0.data.keep").write_text("not ours either")

    fast_tier.remove(cache, 0, keep=5)
    assert sorted(p.name for p in cache.iterdir()) == [
        "ckpt-0000000003.rank0.data.keep",
        "ckpt-0000000003.rank1.data",
        "ckpt-0000000003.rank1.json",
        "ckpt-0000000005.rank0.data",
        "ckpt-0000000005.rank0.json",
        "notes.txt",
    ]
    assert [c.step for c in fast_tier.scan(cache, directory, 0, 2)] == [5]
    assert [c.step for c in fast_tier.scan(cache, directory, 1, 2)] == [3]

    fast_tier.remove(cache, 0)  # no keep: every copy of rank 0
    assert fast_tier.scan(cache, directory, 0, 2) == []
    assert not list(cache.glob("*.rank0.data")) and not list(cache.glob("*.rank0.json"))
    assert (cache / "ckpt-0000000003.rank1.data").exists()
    # A run of one rank also removes what rank 1 (which it does not have) left behind.
    stage(cache, directory, 3, rank=1)
    fast_tier.remove(cache, 0, nranks=1)
    assert not [p.name for p in cache.iterdir() if ".rank1." in p.name]


def test_remove_deletes_manifests_before_data(dirs, monkeypatch):
    cache, directory = dirs
    for step in (3, 5, 7, 11):
        stage(cache, directory, step)
    order = []
    real = fast_tier.safety.remove_leftover

    def spy(path):
        order.append(path.name)
        real(path)

    monkeypatch.setattr(fast_tier.safety, "remove_leftover", spy)
    fast_tier.remove(cache, 0)
    manifests = [i for i, n in enumerate(order) if n.endswith(".json")]
    data = [i for i, n in enumerate(order) if n.endswith(".data")]
    assert len(manifests) == len(data) == 4
    assert max(manifests) < min(data)  # a half-done remove never leaves a sealed copy
    assert list(cache.iterdir()) == []


def test_remove_never_deletes_a_directory_and_survives_a_missing_cache(dirs, tmp_path):
    cache, _ = dirs
    (cache / fast_tier.data_name(3, 0)).mkdir()
    fast_tier.remove(cache, 0)
    assert (cache / fast_tier.data_name(3, 0)).is_dir()
    fast_tier.remove(tmp_path / "missing", 0)


def test_write_data_replaces_a_leftover_link_without_following_it(dirs, tmp_path):
    cache, _ = dirs
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (cache / fast_tier.data_name(5, 0)).symlink_to(target)
    _, arrays = encode(make_state(5))
    fast_tier.write_data(cache, 5, 0, arrays, BLOCK, MODE)
    assert target.read_bytes() == b"precious"
    assert not (cache / fast_tier.data_name(5, 0)).is_symlink()


# -- the cache directory -------------------------------------------------------------------
def test_check_cache_dir_refuses_the_checkpoint_directory(tmp_path, monkeypatch):
    d = tmp_path / "ckpt"
    with pytest.raises(ValueError, match="checkpoint directory itself"):
        fast_tier.check_cache_dir(d, d)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="node-local"):
        fast_tier.check_cache_dir(Path("ckpt"), d)  # relative and absolute spellings
    with pytest.raises(ValueError):
        fast_tier.check_cache_dir(Path("ckpt/"), Path("./ckpt"))
    fast_tier.check_cache_dir(tmp_path / "cache", d)  # anything else is accepted
    fast_tier.check_cache_dir(d / "cache", d)


def test_node_path_gives_each_node_its_own_directory():
    assert fast_tier.node_path("/dev/shm/job/%n", "n3") == "/dev/shm/job/n3"
    assert fast_tier.node_path("/x/%n-%%n", "n3") == "/x/n3-%n"
    assert fast_tier.node_path("/dev/shm/job", "n3") == "/dev/shm/job"


# -- recycling the previous copy's data file ------------------------------------------------
def test_recycle_gives_the_newest_data_file_to_the_next_step_its_manifest_gone_first(dirs):
    cache, directory = dirs
    stage(cache, directory, 4)
    stage(cache, directory, 5)
    inode = os.stat(cache / fast_tier.data_name(5, 0)).st_ino
    other_rank = stage(cache, directory, 5, rank=1)[1]
    assert fast_tier.recycle(cache, 0, 6)
    assert not (cache / fast_tier.manifest_name(5, 0)).exists()  # never counts again
    assert not (cache / fast_tier.data_name(5, 0)).exists()
    assert os.stat(cache / fast_tier.data_name(6, 0)).st_ino == inode  # its pages, reused
    assert other_rank.exists(), "another rank's copy is left alone"
    assert [c.step for c in fast_tier.scan(cache, directory, 0, 2)] == [4]

    # Written over in place, smaller than before, without hashes: then hashed and sealed.
    state = make_state(6)
    state["u"] = state["u"][:100]
    tree, arrays = encode(state)
    maps, hashes, offsets = fast_tier.write_data(
        cache, 6, 0, arrays, BLOCK, MODE, hashed=False, reuse=True
    )
    assert hashes == {}
    path = cache / fast_tier.data_name(6, 0)
    assert os.stat(path).st_ino == inode and os.stat(path).st_mode & 0o777 == MODE
    align = fast_tier.ALIGN
    assert os.path.getsize(path) == sum(-(-a.nbytes // align) * align for a in arrays.values())
    hashes = {n: blocks.block_hashes(m, BLOCK) for n, m in maps.items()}
    fast_tier.seal(
        cache, step=6, uid="u6", rank=0, nranks=2, directory=directory, block_size=BLOCK,
        tree=tree, arrays=arrays, hashes=hashes, offsets=offsets, mode=MODE,
    )  # fmt: skip
    copy = fast_tier.scan(cache, directory, 0, 2)[0]
    back = make_state(0)
    back["u"] = np.zeros(100)
    decode_into(back, copy.tree, fast_tier.load(copy))
    assert c_bytes(back["u"]) == c_bytes(state["u"])
    assert c_bytes(back["grid"]["v"]) == c_bytes(state["grid"]["v"])


def test_recycle_without_a_file_or_with_a_link_does_nothing(dirs, tmp_path):
    cache, directory = dirs
    assert not fast_tier.recycle(cache, 0, 3)
    assert not fast_tier.recycle(tmp_path / "missing", 0, 3)
    target = tmp_path / "elsewhere"
    target.write_bytes(b"x" * 100)
    os.symlink(target, cache / fast_tier.data_name(2, 0))
    assert not fast_tier.recycle(cache, 0, 3), "a link is never followed nor moved"
    assert not (cache / fast_tier.data_name(3, 0)).exists()
    assert target.read_bytes() == b"x" * 100
