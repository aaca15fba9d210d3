"""hpcckpt mirror ls / verify / pull, and the tiers of hpcckpt ls / inspect, against a
real S3 server (tests/s3_server.py) and a directory mirror, on real checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from mpi4py import MPI

from hpcckpt.cli.main import cli
from hpcckpt.cli.mirror import COMMANDS, mirror_group
from hpcckpt.store.file import layout
from hpcckpt.store.mirror import copy as mirror
from hpcckpt.store.mirror.backend import open_backend
from hpcckpt.store.store import CheckpointStore

STEPS = (10, 20, 30)


def invoke(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env)


@pytest.fixture
def ckdir(tmp_path) -> Path:
    """Steps 10, 20, 30 of a small state, written in one process."""
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF)
    for step in STEPS:
        store.save(step, {"u": np.arange(50_000.0) * step, "step": step})
    return store.directory


@pytest.fixture(params=["s3", "directory"])
def mirrored(request, ckdir, tmp_path):
    """(mirror URL, the folder holding its objects on disk): every step of ``ckdir``
    uploaded (verified, manifest last) to an S3 bucket or a directory mirror."""
    if request.param == "s3":
        s3 = request.getfixturevalue("s3_mirror")
        url, on_disk = s3.url, s3.prefix_path
    else:
        on_disk = tmp_path / "project" / "mirror"
        on_disk.mkdir(parents=True)
        url = str(on_disk)
    backend = open_backend(url)
    for step in STEPS:
        mirror.upload(backend, ckdir / layout.checkpoint_name(step))
    return url, on_disk


def flip_byte(path: Path, offset: int = 4096) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_every_subcommand_teaches_with_examples_and_offers_json():
    assert [c.name for c in COMMANDS] == ["mirror"]
    assert "s3://bucket/prefix" in invoke("mirror", "--help").output
    for name in mirror_group.commands:
        out = invoke("mirror", name, "--help").output
        assert "Example" in out and "--json" in out and "MIRROR" in out, name


def test_ls_lists_oldest_first_as_the_directorys_ls_in_text_and_json(mirrored, ckdir):
    url, _ = mirrored
    r = invoke("mirror", "ls", url)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["STEP", "TIME", "(UTC)"]
    assert [line.split()[0] for line in lines[1:]] == ["10", "20", "30"]
    assert all(line.split()[-1] == "good" for line in lines[1:])
    rows = json.loads(invoke("mirror", "ls", url, "--json").output)
    assert [(m["step"], m["status"], m["chain"]) for m in rows] == [
        (10, "good", []),
        (20, "good", []),
        (30, "good", []),
    ]
    in_dir = json.loads(invoke("ls", ckdir, "--json").output)
    assert [m["step"] for m in rows] == [row["step"] for row in in_dir]
    assert all(m["checksum"].startswith("xxh3_64:") and m["mirrored_at"] > 0 for m in rows)


def test_verify_finds_a_flipped_byte_marks_it_and_ls_then_says_bad(mirrored):
    url, on_disk = mirrored
    r = invoke("mirror", "verify", url, "--json")
    assert r.exit_code == 0
    report = json.loads(r.output)
    assert report["good"] and [c["step"] for c in report["checkpoints"]] == [30]

    flip_byte(on_disk / layout.checkpoint_name(20))
    r = invoke("mirror", "verify", url, "20", "--no-mark")
    assert r.exit_code == 1 and "step 20: BAD" in r.output and "checksum" in r.output
    assert json.loads(invoke("mirror", "ls", url, "--json").output)[1]["status"] == "good"

    r = invoke("mirror", "verify", url, "--all", "--json")
    assert r.exit_code == 1
    report = json.loads(r.output)
    assert [(c["step"], c["good"], c["marked_bad"]) for c in report["checkpoints"]] == [
        (10, True, False),
        (20, False, True),
        (30, True, False),
    ]
    rows = json.loads(invoke("mirror", "ls", url, "--json").output)
    assert [m["status"] for m in rows] == ["good", "bad", "good"]
    assert "checksum" in rows[1]["reason"]
    r = invoke("mirror", "ls", url)
    assert "bad" in r.output.splitlines()[2]


def test_pull_fetches_the_newest_good_and_skips_a_damaged_copy(mirrored, ckdir, tmp_path):
    url, on_disk = mirrored
    original = {s: (ckdir / layout.checkpoint_name(s)).read_bytes() for s in STEPS}
    flip_byte(on_disk / layout.checkpoint_name(30))
    target = tmp_path / "fresh-scratch"
    r = invoke("mirror", "pull", url, "--to", target, "--json")
    assert r.exit_code == 0, r.output
    pulled = json.loads(r.output)
    assert pulled["step"] == 20 and len(pulled["skipped"]) == 1
    assert "marked bad" in pulled["skipped"][0]
    assert (target / layout.checkpoint_name(20)).read_bytes() == original[20]
    assert not (target / layout.checkpoint_name(30)).exists()
    assert not list(target.glob("*.pulling"))
    # the damaged copy is marked on the mirror; asking for it by step is an error
    assert json.loads(invoke("mirror", "ls", url, "--json").output)[-1]["status"] == "bad"
    r = invoke("mirror", "pull", url, "30", "--to", target)
    assert r.exit_code == 1 and "cannot be pulled" in r.output
    r = invoke("mirror", "pull", url, "10", "--to", target)
    assert r.exit_code == 0 and "pulled step 10" in r.output
    assert (target / layout.checkpoint_name(10)).read_bytes() == original[10]


def test_a_store_that_is_down_is_a_clear_error(own_s3_server, ckdir, tmp_path):
    own_s3_server.bucket("ckpts")
    url = "s3://ckpts/run"
    mirror.upload(open_backend(url), ckdir / layout.checkpoint_name(10))
    own_s3_server.stop()
    for args in (("ls", url), ("verify", url), ("pull", url, "--to", tmp_path / "x")):
        r = invoke("mirror", *args)
        assert r.exit_code == 1, args
        assert "connection refused at http://127.0.0.1:" in r.output, r.output
    r = invoke("ls", ckdir, "--mirror", url, "--json")
    assert r.exit_code == 0
    assert "the mirror could not be listed" in r.stderr and "connection refused" in r.stderr
    rows = json.loads(r.stdout)  # the directory is listed all the same
    assert {row["tiers"]["mirror"] for row in rows} == {"unreachable"}


def test_bad_urls_name_the_accepted_forms():
    r = invoke("mirror", "ls", "gs://bucket/x")
    assert r.exit_code == 1 and "s3://bucket/prefix" in r.output


def test_ls_and_inspect_show_each_checkpoints_tiers(ckdir, s3_mirror):
    backend = open_backend(s3_mirror.url)
    mirror.upload(backend, ckdir / layout.checkpoint_name(10))
    mirror.upload(backend, ckdir / layout.checkpoint_name(20))
    flip_byte(s3_mirror.prefix_path / layout.checkpoint_name(20))
    mirror.verify_mirrored(backend, layout.checkpoint_name(20))  # marks it bad there
    (ckdir / layout.checkpoint_name(10)).unlink()  # purged from scratch

    rows = json.loads(invoke("ls", ckdir, "--mirror", s3_mirror.url, "--json").output)
    assert [(r["step"], r["status"], r["tiers"]) for r in rows] == [
        (10, "absent", {"directory": None, "mirror": "good"}),
        (20, "good", {"directory": "good", "mirror": "bad"}),
        (30, "good", {"directory": "good", "mirror": None}),
    ]
    text = invoke("ls", ckdir, "--mirror", s3_mirror.url).output.splitlines()
    assert text[0].split()[-2:] == ["STATUS", "TIERS"]
    assert "absent" in text[1] and " mirror " in text[1] + " " and "mirror pull" in text[1]
    assert "dir mirror:bad" in text[2]
    assert text[3].rstrip().endswith("good      dir")
    # $HPCCKPT_MIRROR is the default; without a mirror the rows say only the directory
    rows = json.loads(invoke("ls", ckdir, "--json", env={"HPCCKPT_MIRROR": s3_mirror.url}).output)
    assert rows[0]["tiers"] == {"directory": None, "mirror": "good"}
    rows = json.loads(invoke("ls", ckdir, "--json", env={"HPCCKPT_MIRROR": ""}).output)
    assert [r["tiers"] for r in rows] == [{"directory": "good"}, {"directory": "good"}]

    info = json.loads(invoke("inspect", ckdir, "20", "--mirror", s3_mirror.url, "--json").output)
    assert info["tiers"]["directory"] == str(ckdir / layout.checkpoint_name(20))
    assert info["tiers"]["mirror"]["status"] == "bad"
    assert info["tiers"]["mirror"]["url"] == s3_mirror.url
    text = invoke("inspect", ckdir, "30", "--mirror", s3_mirror.url).output
    assert f"  mirror: {s3_mirror.url}: not mirrored" in text


def test_inspect_describes_a_step_only_the_mirror_holds(ckdir, tmp_path):
    on_disk = tmp_path / "project" / "mirror"
    on_disk.mkdir(parents=True)
    backend = open_backend(str(on_disk))
    for step in (10, 20):
        mirror.upload(backend, ckdir / layout.checkpoint_name(step))
    (ckdir / layout.checkpoint_name(10)).unlink()  # purged from scratch
    url = str(on_disk)

    r = invoke("inspect", ckdir, "10", "--mirror", url, "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert (info["step"], info["file"], info["kind"]) == (10, layout.checkpoint_name(10), "full")
    assert info["size"] == (on_disk / layout.checkpoint_name(10)).stat().st_size
    assert info["tiers"]["directory"] is None
    assert info["tiers"]["mirror"]["status"] == "good" and info["tiers"]["mirror"]["url"] == url
    assert info["tiers"]["mirror"]["checksum"].startswith("xxh3_64:")
    assert info["arrays"] is None
    text = invoke("inspect", ckdir, "10", "--mirror", url).output
    assert "step 10" in text and "only on the mirror" in text
    assert f"  mirror: {url}: good, mirrored" in text and "mirror pull" in text

    r = invoke("inspect", ckdir, "99", "--mirror", url)
    assert r.exit_code == 1 and "no checkpoint of step 99" in r.output
    assert f"nor on the mirror {url}" in r.output
    r = invoke("inspect", ckdir, "10", env={"HPCCKPT_MIRROR": ""})
    assert r.exit_code == 1 and "no checkpoint of step 10" in r.output
