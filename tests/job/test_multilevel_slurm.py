"""The redundant node-local tier on the multi-node local Slurm cluster (issue: multi-level).

heat2d runs on 3 nodes of 5 under ``hpcckpt srun --spare-nodes 2`` with
``HPCCKPT_CACHE=.../%n`` (a directory per node), redundancy across nodes and the drain
to the checkpoint directory only every 5th checkpoint (steps 49, 99, ...: the directory
is behind). A node "loses power" and its node-local directory is wiped
(``fail_node(wipe=...)``); the wrapper relaunches the step on a spare node. Each test
has two failures in one job, so both paths share one allocation:

1. the lost rank's data is rebuilt (XOR parity of its set of 3, or its partner's copy),
   the run resumes from the newest node-local checkpoint, newer than the directory's,
   losing at most one checkpoint interval;
2. the set cannot rebuild (XOR: a second member's directory is gone too) or the
   redundancy is damaged (partner: one flipped byte in the copy): the restore falls
   back to the directory, with a ``local_skipped`` event saying why.

Both end bit-identical to an uninterrupted run. Slurm needs ~25-30 s to see a node
down, which is most of each test's time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.report import analyze, format_report
from hpcckpt.rundir.events import read_events
from tests.mpi_helpers import EXAMPLES, ROOT, mpirun
from tests.slurm_helpers import cluster_env, follow, sbatch, wait_for_event

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

STEPS = 260
HEAT = ["--nx", "64", "--ny", "64", "--steps", str(STEPS), "--every", "10"]


def reference(tmp_path: Path) -> bytes:
    ref = tmp_path / "reference.npy"
    r = mpirun(3, [EXAMPLES / "heat2d.py", *HEAT, "--ckpt-dir", tmp_path / "ref", "--out", ref])
    assert r.returncode == 0, r.stderr
    return np.load(ref).tobytes()


def submit(tmp_path: Path, env: dict[str, str], scheme: str) -> tuple[str, Path, Path]:
    ckpt, log, local = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "local"
    script = tmp_path / "heat.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"export HPCCKPT_CACHE={local}/%n HPCCKPT_REDUNDANCY={scheme} HPCCKPT_DRAIN_EVERY=5\n"
        f"exec hpcckpt srun --ckpt-dir {ckpt} --spare-nodes 2 --min-progress 3600 -- "
        f"--mpi=pmix python {EXAMPLES}/heat2d.py {' '.join(HEAT)} --sleep 0.1 "
        f"--out {tmp_path}/out.npy\n"
    )
    script.chmod(0o755)
    job = sbatch(["-N", "5", "--ntasks-per-node=1", "--no-kill", "--requeue",
                  "--open-mode=append", f"--output={log}", script], env, cwd=str(ROOT))  # fmt: skip
    return job, ckpt, local


def local_checkpoint_after(ckpt: Path, step: int, job: str, env: dict[str, str]) -> None:
    """Wait for a node-local-only checkpoint past ``step`` (the next save is local too)."""
    wait_for_event(
        ckpt,
        lambda e: e.get("event") == "checkpoint" and e.get("tier") == "cache" and e["step"] > step,
        timeout=180,
        job=job,
        env=env,
    )


def node_of(local: Path, rank: int) -> str:
    """The node whose directory holds rank's newest sealed copy (where the rank runs now)."""
    found = sorted(local.glob(f"*/ckpt-*.rank{rank}.json"), key=lambda p: p.name)
    return found[-1].parent.name


def restores(ckpt: Path) -> list[dict]:
    return [e for e in read_events(ckpt) if e["event"] == "restore" and e.get("step") is not None]


def before_relaunches(evs: list[dict]) -> list[tuple[int, int]]:
    """Per relaunch: (newest checkpoint sealed anywhere, newest in the directory) before it."""
    out, sealed, committed = [], -1, -1
    for e in evs:
        if e["event"] in ("checkpoint", "checkpoint_staged"):
            sealed = max(sealed, e["step"])
        if e["event"] == "checkpoint" and e.get("tier") != "cache":
            committed = max(committed, e["step"])
        if e["event"] == "relaunch":
            out.append((sealed, committed))
    return out


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def wait_relaunched(ckpt: Path, count: int, job: str, env: dict[str, str]) -> None:
    wait_for_event(
        ckpt,
        lambda e: e.get("event") == "restore" and len(restores(ckpt)) >= count,
        timeout=180,
        job=job,
        env=env,
    )


def test_xor_sets_of_3_rebuild_a_lost_node_then_fall_back_when_two_are_lost(
    slurm_cluster_nodes, tmp_path
):
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(5)
    env = cluster_env(cluster)
    job, ckpt, local = submit(tmp_path, env, "xor:3")
    failed: list[str] = []
    try:
        local_checkpoint_after(ckpt, 49, job, env)  # 59 or later; the directory has 49
        failed.append(node_of(local, 1))
        cluster.fail_node(failed[-1], wait=False, wipe=[f"{local}/%n"])
        wait_relaunched(ckpt, 1, job, env)
        # second failure: rank 1's node again, and rank 2's node-local directory with it
        local_checkpoint_after(ckpt, max(restores(ckpt)[0]["step"], 99), job, env)
        failed.append(node_of(local, 1))
        other = node_of(local, 2)
        cluster.fail_node(failed[-1], wait=False, wipe=[f"{local}/%n"])
        shutil.rmtree(local / other)
        info = follow(job, env, timeout=420)
    finally:
        for node in failed:
            cluster.restore_node(node, timeout=60)
    text = log_of(tmp_path / "job.out")
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 0, text
    evs = list(read_events(ckpt))
    assert [e["node"] for e in evs if e["event"] == "relaunch"] == failed, evs
    (sealed, committed), (_, committed2) = before_relaunches(evs)
    first, second = restores(ckpt)
    # 1: rebuilt from XOR; resumed from the newest checkpoint (at most one interval lost),
    # which only the node-local tier had
    assert first["tier"] == "cache" and first["rebuilt_from"] == "xor", first
    assert first["rebuilt"] == [1], first
    assert first["step"] >= sealed > committed, (first, sealed, committed)
    # 2: two members of the set lost: the directory's newest, with the reason
    skipped = [e for e in evs if e["event"] == "local_skipped"]
    assert skipped and "both lost" in skipped[-1]["reason"], skipped
    assert second["tier"] == "directory" and second["step"] == committed2, (second, committed2)
    assert np.load(tmp_path / "out.npy").tobytes() == ref
    assert not list(local.glob("*/ckpt-*")), "finish() left node-local copies"


def test_partner_copy_rebuilds_a_lost_node_and_a_flipped_byte_is_never_restored(
    slurm_cluster_nodes, tmp_path
):
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(5)
    env = cluster_env(cluster)
    job, ckpt, local = submit(tmp_path, env, "partner")
    failed: list[str] = []
    try:
        local_checkpoint_after(ckpt, 49, job, env)
        failed.append(node_of(local, 1))  # not rank 0's: the batch script runs there
        cluster.fail_node(failed[-1], wait=False, wipe=[f"{local}/%n"])
        wait_relaunched(ckpt, 1, job, env)
        # second failure: rank 1's node; rank 2 keeps rank 1's partner copy: flip a byte
        local_checkpoint_after(ckpt, max(restores(ckpt)[0]["step"], 99), job, env)
        failed.append(node_of(local, 1))
        keeper = node_of(local, 2)
        cluster.fail_node(failed[-1], wait=False, wipe=[f"{local}/%n"])
        (copy,) = (local / keeper).glob("ckpt-*.rank2.partner")
        raw = bytearray(copy.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        copy.write_bytes(raw)
        info = follow(job, env, timeout=420)
    finally:
        for node in failed:
            cluster.restore_node(node, timeout=60)
    text = log_of(tmp_path / "job.out")
    assert info["JobState"] == "COMPLETED", text
    evs = list(read_events(ckpt))
    (sealed, committed), (_, committed2) = before_relaunches(evs)
    first, second = restores(ckpt)
    assert first["tier"] == "cache" and first["rebuilt_from"] == "partner", first
    assert first["rebuilt"] == [1] and first["step"] >= sealed > committed, (first, sealed)
    skipped = [e for e in evs if e["event"] == "local_skipped"]
    assert skipped and "does not match its checksum" in skipped[-1]["reason"], skipped
    assert second["tier"] == "directory" and second["step"] == committed2, (second, committed2)
    assert np.load(tmp_path / "out.npy").tobytes() == ref
    # the report says where each restore came from
    report = analyze(evs)
    assert [r["tier"] for r in report["restores"]] == ["cache (rebuilt from partner)", "directory"]
    assert "from the cache (rebuilt from partner), rank(s) 1 rebuilt" in format_report(report)


def test_requeue_without_the_old_node_local_directories_resumes_from_the_directory(
    slurm_cluster_nodes, tmp_path
):
    """A node fails after node-local-only checkpoints and Slurm requeues the job (no
    --no-kill); the requeued job gets fresh node-local directories (a per-restart path,
    as a per-job /dev/shm or other nodes would give): it resumes from the directory's
    checkpoint, bit-identical at the end."""
    ref = reference(tmp_path)
    cluster = slurm_cluster_nodes(5)
    env = cluster_env(cluster)
    ckpt, log, local = tmp_path / "ckpt", tmp_path / "job.out", tmp_path / "local"
    script = tmp_path / "heat.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f'export HPCCKPT_CACHE="{local}/${{SLURM_RESTART_COUNT:-0}}/%n" HPCCKPT_REDUNDANCY=xor '
        "HPCCKPT_DRAIN_EVERY=5\n"
        f"exec hpcckpt srun --ckpt-dir {ckpt} --min-progress 3600 -- --mpi=pmix python "
        f"{EXAMPLES}/heat2d.py {' '.join(HEAT)} --sleep 0.1 --out {tmp_path}/out.npy\n"
    )
    script.chmod(0o755)
    job = sbatch(["-N", "3", "--ntasks-per-node=1", "--requeue", "--open-mode=append",
                  f"--output={log}", script], env, cwd=str(ROOT))  # fmt: skip
    failed = None
    try:
        local_checkpoint_after(ckpt, 49, job, env)
        failed = node_of(local / "0", 1)
        cluster.fail_node(failed, wait=True, timeout=90)
        cluster.restore_node(failed, timeout=60)
        info = follow(job, env, timeout=300)
    finally:
        if failed:
            cluster.restore_node(failed, timeout=60)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED", text
    assert int(info["Restarts"]) == 1, text
    evs = list(read_events(ckpt))
    first = [e for e in evs if e.get("restart") == 0 and e["event"] == "checkpoint"]
    committed = max(e["step"] for e in first if not e.get("tier"))
    sealed = max(e["step"] for e in first)
    assert sealed > committed, first  # the node-local tier was ahead of the directory
    (resumed,) = restores(ckpt)
    assert (resumed["step"], resumed["tier"]) == (committed, "directory"), resumed
    assert np.load(tmp_path / "out.npy").tobytes() == ref
