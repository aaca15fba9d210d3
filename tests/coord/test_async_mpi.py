"""Staged saves under real mpirun: ``async_save=True`` and ``cache=PATH``.

Every run of ``apps/async_app.py`` is compared with an uninterrupted synchronous run
of the same state evolution (sha256 of every rank's final state). Saves come every 5
steps (4, 9, 14, ...); faults are injected into the save of step 14, so the previous
durable checkpoint is step 9.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.main import cli
from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.tier import copies as fast_tier
from tests.mpi_helpers import mpirun

pytestmark = pytest.mark.mpi

APP = Path(__file__).parent / "apps" / "async_app.py"
STEPS = 30
SAVED = [4, 9, 14, 19, 24, 29]
FAULT_STEP = 14
DURABLE = 9  # the checkpoint committed before FAULT_STEP's
ROWS = 1024  # the app's default: u is 4 MiB over all ranks


def run(
    n: int,
    mode: str,
    work: Path,
    *extra: str,
    out: str = "result.json",
    fault: str | None = None,
    timeout: float = 150,
):
    """Run the app on ``n`` ranks in ``work``; (result dict or None, CompletedProcess)."""
    args = [APP, mode, work / "ck", "--out", work / out, "--steps", STEPS, "--every", 5]
    if mode == "cache":
        args += ["--cache", work / "cache"]
    env = {"HPCCKPT_FAULT": fault} if fault else {"HPCCKPT_FAULT": ""}
    proc = mpirun(n, [*args, *extra], env=env, timeout=timeout)
    path = work / out
    result = json.loads(path.read_text()) if path.exists() else None
    return result, proc


def ok(result, proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    assert result is not None, proc.stderr
    assert result["errors"] == [None] * result["nranks"], result["errors"]
    return result


class References:
    """Synchronous, uninterrupted runs, computed once per rank count."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.done: dict[int, tuple[dict, Path]] = {}

    def get(self, n: int) -> tuple[dict, Path]:
        if n not in self.done:
            work = self.root / f"ref{n}"
            work.mkdir()
            result = ok(*run(n, "sync", work))
            assert result["restored"] is None and result["last_step"] == STEPS - 1
            assert [s["step"] for s in result["saves"]] == SAVED
            assert not any(s["staged"] for s in result["saves"])
            self.done[n] = (result, work / "ck")
            other = next((r for m, (r, _) in self.done.items() if m != n), None)
            if other is not None:  # u and the shared scalars do not depend on the rank count
                assert other["global"] == result["global"]
        return self.done[n]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("async-ref"))


def same_final_state(result: dict, reference: dict) -> None:
    assert result["last_step"] == reference["last_step"] == STEPS - 1
    assert result["global"] == reference["global"]
    assert result["ranks"] == reference["ranks"]


def events(d: Path) -> list[dict]:
    return list(read_events(d))


def restore_event(d: Path) -> dict:
    """The restore of the latest run in ``d``."""
    return [e for e in events(d) if e["event"] == "restore"][-1]


def verify_all(d: Path) -> dict:
    r = CliRunner().invoke(cli, ["verify", str(d), "--all", "--json"])
    report = json.loads(r.stdout)
    assert r.exit_code == 0 and report["good"], r.output
    return report


def listing(d: Path) -> list[dict]:
    r = CliRunner().invoke(cli, ["ls", str(d), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def committed_steps(d: Path) -> list[int]:
    return sorted(e.step for e in layout.scan(d))


# -- 1-2. the same checkpoints and the same result as synchronous saves ---------------------
# Async on 3 ranks and cache on 2 are compared with the reference in tests 3-5.
STAGED_CASES = [("async", 2), ("cache", 3)]


@pytest.fixture(scope="module")
def staged_runs(tmp_path_factory) -> dict:
    """Each (mode, ranks) run once; shared by the tests below."""
    root = tmp_path_factory.mktemp("async-staged")
    done: dict = {}

    def get(mode: str, n: int) -> tuple[dict, Path, Path]:
        if (mode, n) not in done:
            work = root / f"{mode}{n}"
            work.mkdir()
            # --settle: every rank's write is done before the due() after a save, so the
            # due() after that commits it; step 9 is committed by wait() instead.
            result = ok(*run(n, mode, work, "--settle", "--wait-at", "9"))
            done[(mode, n)] = (result, work / "ck", work / "cache")
        return done[(mode, n)]

    return get


@pytest.mark.parametrize("mode,n", STAGED_CASES, ids=lambda v: str(v))
def test_staged_saves_give_the_synchronous_result_and_checkpoints(staged_runs, references, mode, n):
    result, d, cache = staged_runs(mode, n)
    reference, ref_dir = references.get(n)
    assert result["restored"] is None
    same_final_state(result, reference)

    saves = result["saves"]
    assert [s["step"] for s in saves] == SAVED
    assert all(s["ok"] and s["staged"] for s in saves)

    # Every checkpoint is committed, verifies, and holds what the synchronous run wrote.
    assert committed_steps(d) == SAVED and layout.partials(d) == []
    report = verify_all(d)
    assert sorted(c["step"] for c in report["checkpoints"]) == SAVED
    rows = listing(d)
    assert [r["step"] for r in rows] == SAVED and {r["status"] for r in rows} == {"good"}
    kinds = [r["kind"] for r in rows]
    assert kinds == [s["kind"] for s in reference["saves"]]
    assert kinds[0] == "full" and "incremental" in kinds
    # What save() said: in memory, and through a cache without redundancy, the ranks
    # decide the kind in the background ("staged" until the commit); the first save
    # too, since a restore came before it.
    assert [s["kind"] for s in saves] == ["staged"] * len(kinds)
    for step in SAVED:
        name = layout.checkpoint_name(step)
        with CheckpointReader(d / name) as got, CheckpointReader(ref_dir / name) as want:
            assert got.nranks == want.nranks == n and got.kind == want.kind
            assert got.rows("u", 0, ROWS).tobytes() == want.rows("u", 0, ROWS).tobytes()
            for rank in range(n):
                assert got.tree(rank) == want.tree(rank)
                assert got.rank_array("p", rank).tobytes() == want.rank_array("p", rank).tobytes()

    if mode == "cache":  # finish(): the node-local copies are no longer needed
        assert not cache.exists() or list(cache.iterdir()) == []


@pytest.mark.parametrize("mode,n", STAGED_CASES, ids=lambda v: str(v))
def test_a_staged_save_is_committed_later_and_only_then_visible(staged_runs, mode, n):
    result, d, _ = staged_runs(mode, n)
    # Right after save() returned: the checkpoint is not there (the ranks create its
    # file in the background, the first save's too: a restore came before it).
    assert not any(s["visible"] for s in result["saves"])
    # wait() committed step 9; the due() two steps after each other save committed it
    # (the ranks' writes were done); finish() committed the last one.
    assert result["waited"] == [{"step": 9, "committed": 9, "visible": True}]
    assert result["committed_in_due"] == [4, 14, 19, 24]

    evs = [e for e in events(d) if e["event"] in ("checkpoint_staged", "checkpoint")]
    assert [(e["event"], e["step"]) for e in evs] == [
        (kind, step) for step in SAVED for kind in ("checkpoint_staged", "checkpoint")
    ]  # one background write at a time: each is committed before the next is staged
    for staged, committed in zip(evs[::2], evs[1::2], strict=True):
        assert staged["staging"] == ("memory" if mode == "async" else "cache")
        assert staged["blocked_seconds"] >= 0
        if staged["save_kind"] == "staged":  # rank 0's at staging; the slowest rank's here
            assert committed["blocked_seconds"] >= staged["blocked_seconds"] - 1e-6
            assert staged["bytes"] is None and committed["bytes"] > 0
        else:
            assert committed["blocked_seconds"] == pytest.approx(
                staged["blocked_seconds"], abs=1e-5
            )
            assert committed["save_kind"] == staged["save_kind"]
        assert committed["path"] == layout.checkpoint_name(staged["step"])
        assert committed["nranks"] == n
    assert not [e for e in events(d) if e["event"] == "checkpoint_failed"]


# -- 3. a background write that fails -------------------------------------------------------
def test_background_write_failure_raises_on_every_rank(tmp_path, references):
    result, proc = run(
        2, "async", tmp_path, "--settle", fault=f"drain.eio:1:{FAULT_STEP}", timeout=120
    )
    assert proc.returncode != 0, proc.stderr
    assert result is not None, proc.stderr
    errors = result["errors"]
    # Both ranks raised CheckpointError at the same call: the due() that would commit.
    assert all(errors), errors
    assert {(e["where"], e["step"]) for e in errors} == {("due", FAULT_STEP + 2)}
    for e in errors:
        assert f"step {FAULT_STEP} in the background" in e["error"]
        assert "rank 1" in e["error"] and "rank 0" not in e["error"]
    d = tmp_path / "ck"
    assert committed_steps(d) == [4, DURABLE]
    assert not (d / layout.checkpoint_name(FAULT_STEP)).exists()
    assert layout.partials(d) == []
    verify_all(d)
    failed = [e for e in events(d) if e["event"] == "checkpoint_failed"]
    assert [(e["step"], e.get("background")) for e in failed] == [(FAULT_STEP, True)]
    assert not [e for e in events(d) if e["event"] == "checkpoint" and e["step"] == FAULT_STEP]


def test_background_write_failure_with_warn_goes_on(tmp_path, references):
    result, proc = run(
        2, "cache", tmp_path, "--on-save-error", "warn", fault=f"drain.eio:1:{FAULT_STEP}"
    )
    result = ok(result, proc)
    same_final_state(result, references.get(2)[0])
    d = tmp_path / "ck"
    assert "going on (on_save_error='warn')" in proc.stderr
    failed = [e for e in events(d) if e["event"] == "checkpoint_failed"]
    assert [(e["step"], e.get("background")) for e in failed] == [(FAULT_STEP, True)]
    assert "rank 1" in failed[0]["error"]
    # The failed one never became a checkpoint; the later ones did, and verify.
    assert committed_steps(d) == [s for s in SAVED if s != FAULT_STEP]
    assert layout.partials(d) == []
    verify_all(d)
    done = [e["step"] for e in events(d) if e["event"] == "checkpoint"]
    assert done == [s for s in SAVED if s != FAULT_STEP]


# -- 4. a rank killed in the middle of the drain, with a node-local cache ---------------------
@pytest.fixture(scope="module")
def killed_with_cache(tmp_path_factory):
    """A 2-rank cache run killed while draining step 14; a snapshot of what it left.

    ``restore_snapshot()`` puts the directory and the cache back at their own paths
    (the manifests name the checkpoint directory, so the paths must not change).
    """
    work = tmp_path_factory.mktemp("async-killed-cache")
    _, proc = run(2, "cache", work, out="crashed.json", fault=f"drain.writing:1:{FAULT_STEP}")
    assert proc.returncode != 0, "the injected kill must fail the run"
    assert f"injected fault drain.writing (step {FAULT_STEP})" in proc.stderr, proc.stderr
    d, cache = work / "ck", work / "cache"
    assert committed_steps(d) == [4, DURABLE]
    assert [p.name for p in layout.partials(d)] == [layout.checkpoint_name(FAULT_STEP) + ".partial"]
    # Both ranks sealed their node-local copy of step 14 before the drain began.
    for rank in (0, 1):
        assert [c.step for c in fast_tier.scan(cache, d, rank, 2)] == [FAULT_STEP]
    snap = work / "snapshot"
    shutil.copytree(d, snap / "ck", symlinks=True)
    shutil.copytree(cache, snap / "cache", symlinks=True)

    def restore_snapshot() -> tuple[Path, Path]:
        for path in (d, cache):
            shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(snap / "ck", d, symlinks=True)
        shutil.copytree(snap / "cache", cache, symlinks=True)
        return d, cache

    return work, restore_snapshot


def flip_a_byte(cache: Path, rank: int) -> None:
    data = cache / fast_tier.data_name(FAULT_STEP, rank)
    raw = bytearray(data.read_bytes())
    raw[1000] ^= 0x01  # inside "u" (the first array, at offset 0)
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("case", ["node-lost", "cache-kept", "cache-corrupt"])
def test_kill_mid_drain_with_cache_then_rerun(killed_with_cache, references, case):
    work, restore_snapshot = killed_with_cache
    d, cache = restore_snapshot()
    if case == "node-lost":
        shutil.rmtree(cache)
    elif case == "cache-corrupt":
        flip_a_byte(cache, 1)

    result, proc = run(2, "cache", work, out=f"{case}.json")
    result = ok(result, proc)
    same_final_state(result, references.get(2)[0])
    event = restore_event(d)
    if case == "cache-kept":
        assert result["restored"] == FAULT_STEP
        assert event["step"] == FAULT_STEP and event["tier"] == "cache"
        assert "restored step 14 from node-local copy" in proc.stderr
        # The copy was taken, not set aside, and drained again at once, as a full
        # checkpoint: the directory holds the newest durable state again.
        assert fast_tier.manifest_name(FAULT_STEP, 1) in result["cache_after_restore"]
        redrain = [
            e for e in events(d) if e["event"] == "checkpoint" and e.get("reason") == "restored"
        ]
        assert [(e["step"], e["save_kind"]) for e in redrain] == [(FAULT_STEP, "full")]
    else:
        assert result["restored"] == DURABLE
        assert event["step"] == DURABLE and event["tier"] == "directory"
    if case == "cache-corrupt":
        assert "node-local copy of step 14 not used" in proc.stderr
        assert "checksum" in proc.stderr
        left = result["cache_after_restore"]
        damaged = fast_tier.manifest_name(FAULT_STEP, 1)
        assert damaged + ".bad" in left and damaged not in left  # the damaged part only:
        assert fast_tier.manifest_name(FAULT_STEP, 0) in left  # never whole again, it stays
        (aside,) = [e for e in events(d) if e["event"] == "local_set_aside"]
        assert (aside["step"], aside["file"]) == (FAULT_STEP, damaged), aside
        assert "checksum" in aside["reason"], aside
    if case == "node-lost":
        assert result["cache_after_restore"] is None
    # The leftover .partial of step 14 was removed; every checkpoint verifies.
    assert layout.partials(d) == []
    assert committed_steps(d) == SAVED  # cache-kept: step 14 by the drain after restore
    verify_all(d)


# -- 5. a rank killed in the middle of the drain, no cache -----------------------------------
def test_kill_mid_drain_async_resumes_from_the_durable_checkpoint(tmp_path, references):
    n = 3
    _, proc = run(n, "async", tmp_path, out="crashed.json", fault=f"drain.writing:2:{FAULT_STEP}")
    assert proc.returncode != 0, "the injected kill must fail the run"
    assert f"injected fault drain.writing (step {FAULT_STEP})" in proc.stderr, proc.stderr
    d = tmp_path / "ck"
    assert committed_steps(d) == [4, DURABLE]
    partial = d / (layout.checkpoint_name(FAULT_STEP) + layout.PARTIAL)
    assert layout.partials(d) == [partial]
    assert [r["status"] for r in listing(d)] == ["good", "good", "partial"]

    result = ok(*run(n, "async", tmp_path))
    assert result["restored"] == DURABLE  # the partial is not a checkpoint
    assert restore_event(d)["tier"] == "directory"
    same_final_state(result, references.get(n)[0])
    assert layout.partials(d) == []  # removed by the next save
    assert committed_steps(d) == SAVED
    verify_all(d)


# -- 6. a node-local copy of another rank count ----------------------------------------------
@pytest.mark.parametrize("saved_n,n", [(2, 3), (3, 2)], ids=["2-to-3", "3-to-2"])
def test_a_node_local_copy_of_another_rank_count_is_ignored(tmp_path, references, saved_n, n):
    fault = f"drain.writing:1:{FAULT_STEP}"
    _, proc = run(saved_n, "cache", tmp_path, "--reshardable", out="crashed.json", fault=fault)
    assert proc.returncode != 0, "the injected kill must fail the run"
    d, cache = tmp_path / "ck", tmp_path / "cache"
    assert committed_steps(d) == [4, DURABLE]
    for rank in range(saved_n):
        assert [c.step for c in fast_tier.scan(cache, d, rank, saved_n)] == [FAULT_STEP]

    result = ok(*run(n, "cache", tmp_path, "--reshardable"))
    # Not the copy of step 14 (written by another rank count): step 9 from the directory,
    # split over the new rank count. The copy was ignored, not judged bad: with 3 -> 2,
    # ranks 0 and 1 both hold a part of it, which must not even be tried.
    assert result["restored"] == DURABLE
    event = restore_event(d)
    assert event["tier"] == "directory" and event["nranks"] == n
    left = result["cache_after_restore"]
    assert [fast_tier.manifest_name(FAULT_STEP, r) in left for r in range(saved_n)] == [
        True
    ] * saved_n
    assert not [name for name in left if name.endswith(".bad")]
    assert "node-local copy" not in proc.stderr
    # u and the shared scalars evolve alike with or without the per-rank extras, on any
    # rank count: the whole --reshardable state is in the reference's "global" digest.
    assert result["last_step"] == STEPS - 1
    assert result["global"] == references.get(n)[0]["global"]
    assert committed_steps(d) == SAVED
    verify_all(d)
    # finish() freed the node: the copies of ranks this run does not have went too.
    assert not cache.exists(), sorted(p.name for p in cache.iterdir())


# -- values at save() while training goes on ---------------------------------------------------
VALUES_APP = Path(__file__).parent / "apps" / "values_app.py"


def test_values_at_save_stay_exact_while_training_changes_them_at_once(tmp_path):
    """2 ranks, numpy and torch CPU state: every array and tensor is changed in place
    right after ``save()`` returns, while the background write is still held back;
    each checkpoint restores the values at ``save()``, and the staging holds one copy
    of the state, never more (within the budget)."""
    out = tmp_path / "values.json"
    proc = mpirun(2, [VALUES_APP, tmp_path / "ck", "--out", out, "--saves", 3], timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    saves = doc["saves"]
    assert [s["step"] for s in saves] == [s["restored"] for s in saves] == [0, 1, 2]
    assert [s["committed"] for s in saves] == [0, 1, 2]
    assert all(s["held"] for s in saves), "the changes must come before the write"
    assert all(s["same"] for s in saves), saves
    assert [s["kind"] for s in saves] == ["full", "incremental", "incremental"]
    # save() said so of the first; the later ones' kind the ranks decided in the background
    assert [s["said"] for s in saves] == ["full", "staged", "staged"]
    for s in saves:
        assert s["staging_bytes"] == s["staging_peak"] == doc["state_bytes"] <= doc["budget"]
