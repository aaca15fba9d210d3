"""``hpcckpt report DIR [--plot FILE] [--json]`` on recorded event logs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.report import COMMANDS, report
from hpcckpt.report.format import dur, size

DATA = Path(__file__).resolve().parents[1] / "report" / "data"


@pytest.fixture
def ckpt_dir(tmp_path: Path) -> Path:
    """A checkpoint directory holding a real event log (wrapper: crash, USR1, finish)."""
    d = tmp_path / "ckpt"
    d.mkdir()
    shutil.copy(DATA / "wrapper_crash_stop_finish.jsonl", d / "events.jsonl")
    return d


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(report, list(args))
    return result.exit_code, result.output


def test_exported_for_the_cli_group() -> None:
    assert [c.name for c in COMMANDS] == ["report"]


def test_text_report(ckpt_dir: Path) -> None:
    code, out = run(str(ckpt_dir))
    assert code == 0, out
    assert out.startswith("3 attempts, 7 checkpoints, 1 failure; useful-work efficiency 78.5%")
    assert "crashed" in out and "stopped (signal SIGUSR1)" in out and "finished" in out
    assert "7 committed (interval 6, signal 1)" in out
    assert "lost to failures (redone)         2.49 s" in out
    assert "Young 1.25 s, Daly 1.23 s" in out


def test_json_report(ckpt_dir: Path) -> None:
    code, out = run(str(ckpt_dir), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert set(data) == {
        "directory",
        "events",
        "unknown_events",
        "attempts",
        "checkpoints",
        "time",
        "efficiency",
        "failures",
        "node_failures",
        "interval",
        "restores",
        "gave_up",
        "mirror",
    }
    assert data["gave_up"] is None and data["mirror"] is None  # no give-up, no mirror
    assert data["directory"] == str(ckpt_dir)
    assert [a["outcome"] for a in data["attempts"]] == ["crashed", "stopped", "finished"]
    assert data["checkpoints"]["count"] == 7
    assert data["failures"]["count"] == 1
    assert data["time"]["lost_seconds"] == pytest.approx(2.488, abs=0.01)
    assert data["efficiency"]["run"] == pytest.approx(0.785, abs=0.001)
    kinds = {s["kind"] for a in data["attempts"] for s in a["segments"]}
    assert kinds == {"overhead", "compute", "checkpoint", "lost", "queue"}


def test_events_file_given_directly() -> None:
    code, out = run(str(DATA / "slurm_signal_requeue.jsonl"), "--json")
    assert code == 0, out
    data = json.loads(out)
    assert [a["job_id"] for a in data["attempts"]] == ["1", "1"]
    assert data["failures"]["note"] == "no failure observed"


def test_plot_is_a_png(ckpt_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "timeline.png"
    code, out = run(str(ckpt_dir), "--plot", str(png))
    assert code == 0, out
    assert f"Plot written to {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000  # bars, labels, legend and the side panel: not an empty figure


def test_plot_and_json_together(ckpt_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    svg = tmp_path / "t.svg"
    code, out = run(str(ckpt_dir), "--json", "--plot", str(svg))
    assert code == 0, out
    json.loads(out)  # nothing but JSON on stdout
    assert svg.stat().st_size > 10_000


def test_plot_into_a_missing_directory_fails_cleanly(ckpt_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    code, out = run(str(ckpt_dir), "--plot", str(tmp_path / "no" / "such" / "t.png"))
    assert code == 1
    assert "cannot write the plot" in out


def test_directory_without_events(tmp_path: Path) -> None:
    code, out = run(str(tmp_path))
    assert code == 1
    assert "no events.jsonl in" in out


# -- a real run: what each figure measures, and that they add up ----------
def real_run(directory: Path, steps: int = 200, every: int = 60) -> None:
    """A Checkpointer in this process (MPI.COMM_SELF): saves at steps 59, 119, 179, the
    loop runs on to step 199, then finish()."""
    import numpy as np
    from mpi4py import MPI

    from hpcckpt.coord.checkpointer import Checkpointer

    ck = Checkpointer(directory, MPI.COMM_SELF, every_steps=every)
    state = {"u": np.zeros(2), "t": 0.0}
    ck.restore(state)
    for step in range(steps):
        state["u"] += 1
        state["t"] = float(step)
        if ck.due(step):
            ck.save(step, state)
    ck.finish()


def test_a_real_run_reads_restored_reached_and_saved(tmp_path: Path) -> None:
    real_run(tmp_path / "ck")
    code, out = run(str(tmp_path / "ck"))
    assert code == 0, out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("#"))
    assert "  restored  reached    saved ckpts" in header, header
    row = lines[lines.index(header) + 1]
    assert "       new      199      179     3 " in row, row  # ran to 199, saved 179
    data = json.loads(run(str(tmp_path / "ck"), "--json")[1])
    attempt = data["attempts"][0]
    assert (attempt["reached_step"], attempt["last_saved_step"]) == (199, 179)


def test_a_real_run_names_its_bytes_and_its_checkpoint_time_adds_up(tmp_path: Path) -> None:
    real_run(tmp_path / "ck")
    events = [json.loads(x) for x in (tmp_path / "ck" / "events.jsonl").read_text().splitlines()]
    saves = [e for e in events if e["event"] == "checkpoint"]
    data = json.loads(run(str(tmp_path / "ck"), "--json")[1])
    ck, t = data["checkpoints"], data["time"]
    out = run(str(tmp_path / "ck"))[1]
    mean_bytes = sum(e["bytes"] for e in saves) // len(saves)
    assert (
        f"  written per save: mean {size(mean_bytes)} (array data and state trees of all "
        f"ranks), {size(ck['total_bytes'])} in all"
    ) in out, out
    assert (
        f"  3 committed (steps 3); cost (the store's write and commit of one save) mean "
        f"{dur(ck['mean_seconds'])}, max {dur(ck['max_seconds'])}"
    ) in out, out
    # The time in save() = the store's part (the costs: 3 x the mean) + the rest around it.
    store, other = t["checkpoint_store_seconds"], t["checkpoint_other_seconds"]
    assert store == pytest.approx(sum(e["seconds"] for e in saves), abs=2e-3)
    assert store + other == pytest.approx(t["checkpoint_seconds"], abs=2e-3)
    assert (
        f"    the store {dur(store)} (the saves' costs; staged: the time blocked), around it "
        f"{dur(other)} (state check, pruning, heartbeats, events)"
    ) in out, out


def test_behind_counts_the_checkpoints_still_in_the_directory(tmp_path: Path) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpcckpt.store.store import CheckpointStore

    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, incremental=False)
    for step in range(1, 6):
        store.save(step, {"u": np.arange(10.0) * step})
    store.prune(keep_last=2)  # 4 and 5 stay
    events = [{"event": "start", "time": 100.0, "source": "checkpointer"}]
    events += [{"event": "checkpoint", "time": 100.0 + s, "step": s} for s in range(1, 6)]
    events.append({"event": "mirror_failed", "time": 106.0, "step": 5, "reason": "refused",
                   "count": 9, "since": 101.5, "mirror": "s3://b/run"})  # fmt: skip
    (store.directory / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    code, out = run(str(store.directory))
    assert code == 0, out
    assert "behind: 2 committed checkpoint(s) not on the mirror, steps 4, 5" in out
    assert "3 more committed checkpoint(s) never reached the mirror" in out
    assert "9 failed cop(ies)" in out
    code, out = run(str(store.directory), "--json")
    mirror = json.loads(out)["mirror"]
    assert mirror["behind"] == [4, 5] and mirror["behind_deleted"] == 3
