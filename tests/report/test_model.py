"""The report's model (hpcckpt/report/model.py): attempts from events, the event file."""

from __future__ import annotations

from pathlib import Path

from hpcckpt.report import load_events, split_attempts

DATA = Path(__file__).parent / "data"


def ev(t: float, event: str, **fields: object) -> dict[str, object]:
    return {"time": 1000.0 + t, "event": event, "restart_count": 0, **fields}


def ck(t: float, event: str, **fields: object) -> dict[str, object]:
    return ev(t, event, source="checkpointer", nranks=4, **fields)


def save(t: float, step: int, cost: float, reason: str = "interval", **extra: object) -> list:
    """checkpoint_begin at t, checkpoint committed at t + cost."""
    return [
        ck(t, "checkpoint_begin", step=step, reason=reason),
        ck(t + cost, "checkpoint", step=step, seconds=cost, bytes=1000, reason=reason, **extra),
    ]


def wrapped_job() -> list[dict[str, object]]:
    """Three attempts of Slurm job 7: crashed, stopped by signal and requeued, finished.

    attempt 1: 0..100   start-up 5, work 5..35, ckpt 35..37, work 37..67, ckpt 67..69,
                        crash at 100 (31 s lost)
    queue:     100..160
    attempt 2: 160..230 start-up 160..170, work 170..200, ckpt 200..202, signal 215,
                        ckpt 215..217 (signal), stop 217, step_end 220, requeue 220
    queue:     220..400
    attempt 3: 400..470 start-up 400..410, work 410..440, ckpt 440..442, work 442..460,
                        finish 460, step_end 470
    """
    j = {"job_id": "7"}
    return [
        ev(0, "wrapper_start", attempt="a1", **j),
        ck(2, "start", policy="fixed every 30 s", **j),
        ck(5, "restore", step=None, **j),
        *save(35, 10, 2.0),
        *save(67, 20, 2.0),
        ev(100, "step_end", attempt="a1", outcome="crashed", exit_code=-9, **j),
        ev(100, "crashed", attempt="a1", exit_code=-9, **j),
        {**ev(160, "wrapper_start", attempt="a2", **j), "restart_count": 1},
        {**ck(165, "start", **j), "restart_count": 1},
        {**ck(170, "restore", step=20, **j), "restart_count": 1},
        *save(200, 30, 2.0),
        ev(215, "signal", attempt="a2", name="USR1", forwarded=True),
        *save(215, 35, 2.0, reason="signal"),
        ck(217, "stop", step=35, reason="signal", signal="SIGUSR1"),
        ev(220, "step_end", attempt="a2", outcome="stopped", step=35),
        ev(220, "requeue", attempt="a2", step=35, **j),
        {**ev(400, "wrapper_start", attempt="a3", **j), "restart_count": 2},
        ck(405, "start", **j),
        ck(410, "restore", step=35, **j),
        *save(440, 45, 2.0),
        ck(460, "finish", last_step=45),
        ev(470, "step_end", attempt="a3", outcome="finished", step=45),
        ev(470, "finished", attempt="a3", step=45),
    ]


def test_split_attempts_uses_tokens_for_wrapper_events() -> None:
    atts = split_attempts(wrapped_job())
    assert [a.token for a in atts] == ["a1", "a2", "a3"]
    assert [len(a.events) for a in atts] == [9, 11, 8]


# -- real event logs, recorded from the examples --------------------------------------------
def test_load_events_skips_a_torn_line(tmp_path: Path) -> None:
    text = (DATA / "slurm_signal_requeue.jsonl").read_text()
    (tmp_path / "events.jsonl").write_text(text + '{"time": 1, "ev')
    assert load_events(tmp_path) == load_events(DATA / "slurm_signal_requeue.jsonl")
    assert len(load_events(tmp_path)) == 15
