"""The node-local tier with partner, XOR or no redundancy under real mpirun (3 and 4 ranks).

Each rank gets a fake node name (``Checkpointer(node_name=...)``) and the cache path
``.../%n``, so every "node" has its own directory on this one machine: wiping a
directory is losing that node's node-local storage, and giving a rank another node
name is relaunching it elsewhere. ``apps/redundancy_app.py`` saves a state that is a
pure function of (rank, step), with odd sizes, an empty and a non-contiguous array;
the restore checks it bit for bit. Saves at steps 0..6 with ``drain_every=5``: step 4
is drained to the directory, steps 5 and 6 are node-local only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.store.file import layout
from hpcckpt.store.tier import copies as fast_tier
from hpcckpt.store.tier import redundancy
from tests.mpi_helpers import mpirun

pytestmark = pytest.mark.mpi

APP = Path(__file__).parents[1] / "apps" / "redundancy_app.py"
STEPS = list(range(7))
DRAINED = 4  # the directory's newest; 5 and 6 are node-local only


def run(
    work: Path, n: int, mode: str, nodes: list[str], fault: str = "", **spec
) -> list[dict] | None:
    """Run the app; its results (None when ``fault`` killed it, as it must)."""
    out = work / f"{mode}-{len(list(work.glob('*.out')))}.out"
    doc = {
        "mode": mode,
        "dir": str(work / "ck"),
        "cache": str(work / "cache" / "%n"),
        "nodes": nodes,
        "steps": STEPS,
        "drain_every": 5,
        "out": str(out),
        **spec,
    }
    path = out.with_suffix(".json")
    path.write_text(json.dumps(doc))
    proc = mpirun(n, [APP, path], env={"HPCCKPT_FAULT": fault}, timeout=180)
    if fault:
        assert proc.returncode != 0 and "injected fault" in proc.stderr, proc.stderr
        return None
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert [r["error"] for r in results] == [None] * n, results
    return results


def restores(work: Path) -> list[dict]:
    return [e for e in read_events(work / "ck") if e["event"] == "restore"]


def wipe(work: Path, *nodes: str) -> None:
    for node in nodes:
        shutil.rmtree(work / "cache" / node)


def flip_byte(path: Path, at: int = 100) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(raw)


def test_xor_set_of_3_rebuilds_a_lost_node_onto_a_spare(tmp_path):
    # 1.2M rows: a rank's data (~10 MB) makes XOR chunks larger than one MPI piece
    big = 1_200_000
    run(tmp_path, 3, "save", ["n1", "n2", "n3"], redundancy="xor", set=3, big=big)
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [DRAINED]
    sizes = []
    for rank, node in enumerate(["n1", "n2", "n3"]):
        d = tmp_path / "cache" / node
        assert sorted(p.name for p in d.iterdir()) == sorted(
            [
                fast_tier.data_name(6, rank),
                fast_tier.manifest_name(6, rank),
                redundancy.file_name(6, rank, "xor"),
                redundancy.manifest_name(6, rank),
            ]
        )
        sizes.append((d / fast_tier.data_name(6, rank)).stat().st_size)
    half = -(-max(sizes) // 2)  # the largest data file in N-1 = 2 chunks
    chunk = -(-half // 8) * 8
    assert chunk > redundancy.PIECE  # several pieces per chunk
    for rank, node in enumerate(["n1", "n2", "n3"]):
        parity = tmp_path / "cache" / node / redundancy.file_name(6, rank, "xor")
        assert parity.stat().st_size == chunk  # B/(N-1), not B
    wipe(tmp_path, "n2")
    # relaunched on n1, n3, n4: rank 1 now runs on n3 (rank 2's old node), rank 2 on n4
    results = run(tmp_path, 3, "restore", ["n1", "n3", "n4"], redundancy="xor", set=3, big=big)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3
    (ev,) = restores(tmp_path)
    assert ev["tier"] == "cache" and ev["rebuilt"] == [1] and ev["rebuilt_from"] == "xor", ev
    assert ev["moved"] == [2], ev
    # the restored checkpoint was drained to the directory at once
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [6, DRAINED]


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_xor_set_of_4_rebuilds_any_one_member(tmp_path, lost):
    nodes = ["a", "b", "c", "d"]
    run(tmp_path, 4, "save", nodes, redundancy="xor", set=4)
    wipe(tmp_path, nodes[lost])
    moved = list(nodes)
    moved[lost] = "spare"
    results = run(tmp_path, 4, "restore", moved, redundancy="xor", set=4)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 4
    (ev,) = restores(tmp_path)
    assert (ev["tier"], ev["rebuilt"], ev["moved"]) == ("cache", [lost], []), ev


def test_two_lost_members_of_one_xor_set_fall_back_to_the_directory(tmp_path):
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy="xor", set=3)
    wipe(tmp_path, "n2", "n3")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n5"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    evs = list(read_events(tmp_path / "ck"))
    skipped = [e for e in evs if e["event"] == "local_skipped"]
    assert [e["step"] for e in skipped] == [6], skipped  # the one node-local copy kept
    assert "both lost" in skipped[0]["reason"], skipped
    (ev,) = restores(tmp_path)
    assert ev["tier"] == "directory" and "rebuilt" not in ev


@pytest.mark.parametrize("scheme", ["xor", "partner"])
def test_a_flipped_byte_in_the_redundancy_is_detected_and_never_restored(tmp_path, scheme):
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy=scheme, set=3)
    # rank 1 (on n2) is lost; its partner copy is kept by rank 2, the XOR rebuild of
    # its first chunk reads rank 2's parity: flip a byte of that file
    flip_byte(tmp_path / "cache" / "n3" / redundancy.file_name(6, 2, scheme))
    wipe(tmp_path, "n2")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n3"], redundancy=scheme, set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    skipped = [e for e in read_events(tmp_path / "ck") if e["event"] == "local_skipped"]
    assert [e["step"] for e in skipped] == [6], skipped  # the one node-local copy kept
    assert all("does not match its checksum" in e["reason"] for e in skipped), skipped
    (ev,) = restores(tmp_path)
    assert ev["tier"] == "directory"


def test_partner_rebuilds_a_lost_node_from_the_next_nodes_copy(tmp_path):
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy="partner", set=3, big=600_000)
    for rank, node in enumerate(nodes):
        copy = tmp_path / "cache" / node / redundancy.file_name(6, rank, "partner")
        left = tmp_path / "cache" / nodes[rank - 1] / fast_tier.data_name(6, (rank - 1) % 3)
        assert copy.read_bytes() == left.read_bytes()  # the previous rank's data, verbatim
    wipe(tmp_path, "n3")
    results = run(
        tmp_path, 3, "restore", ["n1", "n2", "n4"], redundancy="partner", set=3, big=600_000
    )
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3
    (ev,) = restores(tmp_path)
    assert (ev["rebuilt"], ev["rebuilt_from"]) == ([2], "partner"), ev


def test_two_ranks_per_node_form_sets_across_nodes_and_both_rebuild(tmp_path):
    # ranks 0,1 on node a; 2,3 on node b: sets {0,2} and {1,3} (fewer nodes than the
    # set size asked for: sets of 2). Losing b loses one member of each set.
    run(tmp_path, 4, "save", ["a", "a", "b", "b"], redundancy="xor", set=8)
    red = redundancy.read_redundancy(
        tmp_path / "cache" / "a" / redundancy.manifest_name(6, 0), tmp_path / "ck", 4
    )
    assert red is not None and red.sets == [[0, 2], [1, 3]], red
    wipe(tmp_path, "b")
    results = run(tmp_path, 4, "restore", ["a", "a", "c", "c"], redundancy="xor", set=8)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 4
    (ev,) = restores(tmp_path)
    assert sorted(ev["rebuilt"]) == [2, 3], ev


def test_requeue_onto_other_nodes_without_their_directories_resumes_from_the_directory(
    tmp_path,
):
    run(tmp_path, 3, "save", ["n1", "n2", "n3"], redundancy="xor", set=3)
    results = run(tmp_path, 3, "restore", ["m1", "m2", "m3"], redundancy="xor", set=3)
    # the old directories still exist but sit on nodes this run does not have
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    (ev,) = restores(tmp_path)
    assert ev["tier"] == "directory"


def test_nothing_lost_restores_the_node_local_copies_as_they_are(tmp_path):
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy="partner", set=3)
    results = run(tmp_path, 3, "restore", nodes, redundancy="partner", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3
    (ev,) = restores(tmp_path)
    assert (ev["tier"], ev["rebuilt"], ev["moved"]) == ("cache", [], []), ev


def test_a_save_killed_before_its_redundancy_is_sealed_is_never_rebuilt(tmp_path):
    # rank 1 dies at step 6 with its data and parity written and no manifest: step 6
    # never became good; with rank 1's node lost, step 5 is rebuilt, not 6
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, "redundancy.encoded:1:6", redundancy="xor", set=3)
    for rank, node in enumerate(nodes):
        assert (tmp_path / "cache" / node / redundancy.file_name(6, rank, "xor")).exists()
    wipe(tmp_path, "n2")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n3"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(5, True)] * 3
    (ev,) = restores(tmp_path)
    assert (ev["tier"], ev["rebuilt"]) == ("cache", [1]), ev


@pytest.mark.parametrize("end", ["finish", "close"])
def test_finish_or_close_drains_a_newest_checkpoint_only_the_node_local_tier_has(tmp_path, end):
    run(tmp_path, 3, end, ["n1", "n2", "n3"], redundancy="xor", set=3)
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [6, DRAINED]
    evs = list(read_events(tmp_path / "ck"))
    scavenged = [e for e in evs if e["event"] == "checkpoint" and e.get("reason") == "scavenge"]
    assert [e["step"] for e in scavenged] == [6], evs
    if end == "finish":
        assert not (tmp_path / "cache" / "n1").exists()  # finish() freed the node-local tier
    results = run(tmp_path, 3, "restore", ["n1", "n2", "n3"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3


@pytest.mark.parametrize("lost", [1, 2])
def test_a_rank_with_only_empty_arrays_is_rebuilt_and_rebuilds_others(tmp_path, lost):
    # rank 2 holds no element at all: its data file is empty, the XOR chunks are sized
    # by the largest member and padded (FTI's level 3 broke on such odd sizes)
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy="xor", set=3, empty_ranks=[2])
    assert (tmp_path / "cache" / "n3" / fast_tier.data_name(6, 2)).stat().st_size == 0
    wipe(tmp_path, nodes[lost])
    moved = ["n1", "n2", "n3"]
    moved[lost] = "n4"
    results = run(tmp_path, 3, "restore", moved, redundancy="xor", set=3, empty_ranks=[2])
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3
    (ev,) = restores(tmp_path)
    assert (ev["tier"], ev["rebuilt"]) == ("cache", [lost]), ev


def set_aside_files(work: Path) -> list[str]:
    """Every node-local file set aside, as "node/name"."""
    return sorted(f"{p.parent.name}/{p.name}" for p in (work / "cache").glob("*/*.bad"))


def events_of(work: Path, kind: str) -> list[dict]:
    return [e for e in read_events(work / "ck") if e["event"] == kind]


def test_without_redundancy_only_the_damaged_part_is_set_aside_with_its_event(tmp_path):
    # no redundancy: rank 0's damaged part of step 6 cannot be rebuilt, so the restore
    # falls back to the directory; only that part is set aside, and the event names it
    nodes = ["n1", "n2", "n3"]
    run(tmp_path, 3, "save", nodes)
    flip_byte(tmp_path / "cache" / "n1" / fast_tier.data_name(6, 0))
    results = run(tmp_path, 3, "restore", nodes)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    name = fast_tier.manifest_name(6, 0)
    (aside,) = events_of(tmp_path, "local_set_aside")
    assert (aside["step"], aside["node"], aside["file"]) == (6, "n1", name), aside
    assert "checksum" in aside["reason"], aside
    (skip,) = events_of(tmp_path, "local_skipped")
    assert skip["step"] == 6 and "checksum" in skip["reason"], skip
    assert set_aside_files(tmp_path) == [f"n1/{name}.bad"]  # the sound parts stay
    results = run(tmp_path, 3, "restore", nodes)  # not tried again
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    assert len(events_of(tmp_path, "local_set_aside")) == 1


@pytest.mark.parametrize("scheme", ["xor", "partner"])
def test_a_damaged_parity_or_partner_file_is_set_aside_and_never_tried_again(tmp_path, scheme):
    nodes, moved = ["n1", "n2", "n3"], ["n1", "n4", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy=scheme, set=3)
    flip_byte(tmp_path / "cache" / "n3" / redundancy.file_name(6, 2, scheme))
    wipe(tmp_path, "n2")
    results = run(tmp_path, 3, "restore", moved, redundancy=scheme, set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    name = redundancy.manifest_name(6, 2)
    (ev,) = events_of(tmp_path, "local_set_aside")
    assert (ev["step"], ev["node"], ev["file"]) == (6, "n3", name), ev
    assert "does not match its checksum" in ev["reason"], ev
    # only the damaged file: the copies and rank 0's parity verified and stay
    assert set_aside_files(tmp_path) == [f"n3/{name}.bad"]
    assert (tmp_path / "cache" / "n3" / redundancy.file_name(6, 2, scheme)).exists()
    assert (tmp_path / "cache" / "n1" / fast_tier.manifest_name(6, 0)).exists()
    # the next restart does not try it again: the plan refuses step 6 without reading
    results = run(tmp_path, 3, "restore", moved, redundancy=scheme, set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    assert len(events_of(tmp_path, "local_set_aside")) == 1
    second = events_of(tmp_path, "local_skipped")[-1]
    assert second["step"] == 6 and "checksum" not in second["reason"], second
    assert "is too" in second["reason"], second


def test_a_damaged_copy_of_a_survivor_is_set_aside_and_never_tried_again(tmp_path):
    nodes, moved = ["n1", "n2", "n3"], ["n1", "n4", "n3"]
    run(tmp_path, 3, "save", nodes, redundancy="xor", set=3)
    flip_byte(tmp_path / "cache" / "n1" / fast_tier.data_name(6, 0))
    wipe(tmp_path, "n2")
    results = run(tmp_path, 3, "restore", moved, redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    name = fast_tier.manifest_name(6, 0)
    (ev,) = events_of(tmp_path, "local_set_aside")
    assert (ev["step"], ev["node"], ev["file"]) == (6, "n1", name), ev
    assert "checksum" in ev["reason"], ev
    # rank 1's rebuilt copy failed too, but from rank 0's bytes: nothing else is set aside
    assert set_aside_files(tmp_path) == [f"n1/{name}.bad"]
    results = run(tmp_path, 3, "restore", moved, redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    assert len(events_of(tmp_path, "local_set_aside")) == 1
    second = events_of(tmp_path, "local_skipped")[-1]
    assert "both lost" in second["reason"], second


def test_copies_that_are_only_incomplete_or_of_other_nodes_are_never_set_aside(tmp_path):
    nodes = ["n1", "n2", "n3"]
    # step 6 died before its redundancy was sealed on rank 1 (newer than complete)
    run(tmp_path, 3, "save", nodes, "redundancy.encoded:1:6", redundancy="xor", set=3)
    wipe(tmp_path, "n2", "n3")  # and two members of the set lost: step 5 cannot rebuild
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n5"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    assert events_of(tmp_path, "local_skipped")  # not used, and not damaged:
    assert set_aside_files(tmp_path) == [] and events_of(tmp_path, "local_set_aside") == []
    # a requeue onto nodes that never held them leaves them alone as well
    results = run(tmp_path, 3, "restore", ["m1", "m2", "m3"], redundancy="xor", set=3)
    assert [r["step"] for r in results] == [DRAINED] * 3
    assert set_aside_files(tmp_path) == [] and events_of(tmp_path, "local_set_aside") == []


def test_until_the_restored_checkpoint_is_drained_a_second_loss_falls_back(tmp_path):
    # The rebuilt member's own parity is not written again at restore: until the drain of
    # the restored checkpoint commits, its set cannot survive a second loss.
    run(tmp_path, 3, "save", ["n1", "n2", "n3"], redundancy="xor", set=3)
    wipe(tmp_path, "n2")
    # rank 1 rebuilt on n4; the job dies while the restored step 6 drains
    run(tmp_path, 3, "restore", ["n1", "n4", "n3"], "drain.writing::6", redundancy="xor", set=3)
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [DRAINED]
    assert not (tmp_path / "cache" / "n4" / redundancy.manifest_name(6, 1)).exists()
    wipe(tmp_path, "n3")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n5"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(DRAINED, True)] * 3
    skipped = events_of(tmp_path, "local_skipped")[-1]
    assert skipped["step"] == 6 and "parity of rank 1" in skipped["reason"], skipped


def test_once_the_restored_checkpoint_is_drained_a_second_loss_loses_nothing(tmp_path):
    run(tmp_path, 3, "save", ["n1", "n2", "n3"], redundancy="xor", set=3)
    wipe(tmp_path, "n2")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n3"], redundancy="xor", set=3)
    assert [r["step"] for r in results] == [6] * 3
    assert [e.step for e in layout.scan(tmp_path / "ck")] == [6, DRAINED]  # drained
    wipe(tmp_path, "n3")
    results = run(tmp_path, 3, "restore", ["n1", "n4", "n5"], redundancy="xor", set=3)
    assert [(r["step"], r["same"]) for r in results] == [(6, True)] * 3
    assert restores(tmp_path)[-1]["tier"] == "directory"
