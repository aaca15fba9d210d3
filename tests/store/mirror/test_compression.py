"""Compressed copies on the mirror (hpcckpt/store/mirror/compression.py through
hpcckpt/store/mirror/copy.py): zstd with byte-grouped floats, smaller on the store,
verified end to end against the checkpoint's own hash, pulled back bit-identical, a
damaged object refused; "auto" compresses only where the store is slower than the
compressor."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.file import layout
from hpcckpt.store.mirror import compression
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import DirectoryBackend, Throttle
from hpcckpt.store.mirror.options import MirrorOptions
from hpcckpt.store.mirror.s3 import S3Backend
from hpcckpt.store.mirror.source import SourceCheck
from hpcckpt.store.store import CheckpointStore

ROOT = Path(__file__).resolve().parents[3]


def smooth_checkpoint(tmp_path: Path, step: int = 1) -> Path:
    """A checkpoint of a smooth float64 field and float32 moments (compressible, as
    real state is; random bytes would not be)."""
    x = np.linspace(0, 8 * np.pi, 2_000_000)
    state = {
        "u": np.sin(x) * np.exp(-x / 10) + step,
        "m": (np.cos(x[:500_000]) * 1e-3).astype(np.float32),
        "step": step,
    }
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    store.save(step, state)
    return store.directory / layout.checkpoint_name(step)


def test_grouping_and_frames_round_trip():
    data = np.random.default_rng(0).random(100_003).tobytes() + b"tail"
    for width in (0, 2, 4, 8):
        assert compression.unshuffle(compression.shuffle(data, width), width) == data
    enc = compression.Encoder(lambda off: (8, 400_000) if off < 400_000 else (0, 1 << 62))
    blob = b"".join(enc.encode([data[:300_000], data[300_000:]]))
    out: list[bytes] = []
    assert compression.decode(io.BytesIO(blob), out.append) == len(data)
    assert b"".join(out) == data and enc.raw == len(data) and enc.out == len(blob)
    with pytest.raises(ValueError, match="cut"):
        compression.decode(io.BytesIO(blob[:-5]), out.append)
    with pytest.raises(ValueError, match="not an hpcckpt zstd object"):
        compression.decode(io.BytesIO(b"plain bytes"), out.append)


def test_the_floats_are_grouped_by_their_width(tmp_path):
    path = smooth_checkpoint(tmp_path)
    check = SourceCheck(path)
    widths = sorted({check.width_at(r.start)[0] for r in check.runs})
    assert widths == [4, 8]
    assert check.width_at(0) == (0, check.runs[0].start)  # HDF5's own header: not grouped


@pytest.mark.parametrize("where", ["directory", "s3"])
def test_a_compressed_copy_is_smaller_verified_and_pulled_back_identical(tmp_path, where, request):
    path = smooth_checkpoint(tmp_path)
    if where == "s3":
        s3_mirror = request.getfixturevalue("s3_mirror")
        backend = S3Backend(s3_mirror.url, compress="zstd")
        stored = s3_mirror.prefix_path / path.name
    else:
        (tmp_path / "m").mkdir()
        backend = DirectoryBackend(tmp_path / "m", compress="zstd")
        stored = tmp_path / "m" / path.name
    up = mirror.upload(backend, path)
    assert up.bytes == path.stat().st_size
    manifest = json.loads(backend.get_bytes(path.name + ".manifest.json"))
    assert manifest["encoding"] == compression.ENCODING
    assert manifest["checksum"] == mirror.file_checksum(path)  # the checkpoint's own bytes
    assert manifest["size"] == path.stat().st_size
    assert manifest["stored_size"] == stored.stat().st_size < 0.7 * path.stat().st_size
    assert stored.read_bytes().startswith(compression.MAGIC)
    (m,) = mirror.list_mirrored(backend)
    assert m.good and m.encoding == compression.ENCODING
    assert mirror.verify_mirrored(backend, path.name).good
    pulled = mirror.pull(backend, path.name, tmp_path / "back")
    assert pulled.read_bytes() == path.read_bytes()


def test_a_damaged_compressed_copy_is_refused_and_marked_bad(tmp_path):
    path = smooth_checkpoint(tmp_path)
    (tmp_path / "m").mkdir()
    backend = DirectoryBackend(tmp_path / "m", compress="zstd")
    mirror.upload(backend, path)
    obj = tmp_path / "m" / path.name
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x40
    obj.write_bytes(bytes(data))
    with pytest.raises(mirror.MirrorCopyBad):
        mirror.pull(backend, path.name, tmp_path / "back")
    assert not (tmp_path / "back" / path.name).exists()
    assert mirror.list_mirrored(backend)[0].status == "bad"


def test_restore_takes_a_compressed_copy_when_the_directory_was_emptied(tmp_path):
    path = smooth_checkpoint(tmp_path, step=3)
    (tmp_path / "m").mkdir()
    mirror.upload(DirectoryBackend(tmp_path / "m", compress="zstd"), path)
    want = path.read_bytes()
    path.unlink()
    store = CheckpointStore(
        tmp_path / "ck", MPI.COMM_SELF, mirror=str(tmp_path / "m"), mirror_compress="zstd"
    )
    x = np.linspace(0, 8 * np.pi, 2_000_000)
    got = {"u": np.zeros(2_000_000), "m": np.zeros(500_000, np.float32), "step": 0}
    result = store.restore(got)
    assert result.step == 3 and result.source == "mirror" and got["step"] == 3
    assert np.array_equal(got["u"], np.sin(x) * np.exp(-x / 10) + 3)
    assert path.read_bytes() == want


def test_auto_compresses_only_where_the_store_is_slower_than_the_compressor(tmp_path):
    rates = compression.Rates()
    assert not rates.pays(None)  # nothing measured yet: as the plain copy
    assert rates.pays(50e6)  # a cap of 50 MB/s: far below the compressor
    assert not rates.pays(5e9)  # a store faster than the compressor
    rates.note(10 << 30, 10 << 30, 1.0, None)  # a copy measured at 10 GiB/s
    assert not rates.pays(None)
    rates.note(100 << 20, 100 << 20, 2.0, None)  # 52 MB/s measured
    assert rates.pays(None)
    rates.ratio = 0.99  # data that does not compress
    assert not rates.pays(None)
    # through upload: a capped directory mirror compresses, an uncapped one does not (yet)
    path = smooth_checkpoint(tmp_path)
    for name, cap, encoded in (("slow", 40e6, True), ("fast", None, False)):
        (tmp_path / name).mkdir()
        backend = DirectoryBackend(tmp_path / name, Throttle(cap), compress="auto")
        mirror.upload(backend, path)
        manifest = json.loads(backend.get_bytes(path.name + ".manifest.json"))
        assert ("encoding" in manifest) is encoded


def test_the_options_check_the_settings():
    assert MirrorOptions().mirror_compress == "auto"
    assert MirrorOptions(mirror_compress="none").mirror_compress is None
    assert MirrorOptions(mirror_compress="ZSTD").mirror_compress == "zstd"
    assert MirrorOptions(mirror_verify="readback").mirror_verify == "readback"
    with pytest.raises(ValueError, match="mirror_compress"):
        MirrorOptions(mirror_compress="gzip")
    with pytest.raises(ValueError, match="mirror_verify"):
        MirrorOptions(mirror_verify="sometimes")


def test_without_zstandard_zstd_is_refused_with_the_install_line_and_auto_copies_plain(
    tmp_path,
):
    code = """
import sys
sys.modules["zstandard"] = None
from hpcckpt.store.mirror.options import MirrorOptions
try:
    MirrorOptions(mirror_compress="zstd")
except ValueError as exc:
    print("REFUSED", exc)
from hpcckpt.store.mirror import compression
print("AVAILABLE", compression.available())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    assert "REFUSED" in out and "hpcckpt[compress]" in out and "AVAILABLE False" in out
