"""``hpcckpt report DIR [--plot FILE] [--json]`` on recorded event logs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.report import COMMANDS, report

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
    }
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
