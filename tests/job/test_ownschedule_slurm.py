"""Applications that take no signal and write restart files on their own schedule, on the
local Slurm cluster, with ``stopapp series`` (a new numbered file per write, the newest
one read at the start, like a molecular-dynamics code) and ``stopapp periodic`` (a fixed
set rewritten in place). Each case compares the final field with an uninterrupted run.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

import pytest

from hpcckpt.job.stalled import MAX_STALLED_STOPS
from tests.job.test_stops_slurm import (
    HPCCKPT,
    cluster_env,
    drive,
    events_of,
    log_of,
    reference,
    write_script,
)
from tests.slurm_helpers import sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]


def series_job(tmp_path: Path, stopapp: Path, mode: list[str], *, header: str = "",
               wrapper_opts: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """The restart-files template's line without --app-signal: ``restart.*.bin``."""
    kind, steps, sleep, *rest = mode
    app = [str(stopapp), kind, steps, sleep, str(tmp_path / "restart"),
           str(tmp_path / "out.bin"), *rest]  # fmt: skip
    glob = f"{tmp_path}/restart.*.bin" if kind == "series" else f"{tmp_path}/restart.*"
    wrapper = [HPCCKPT, "srun", "--ckpt-dir", str(tmp_path / "ckpt"), *wrapper_opts,
               "--restart-files", glob, "--", "-n", "2", "--mpi=pmix", *app]  # fmt: skip
    return write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper), header)


def keep_log(tmp_path: Path, name: str) -> None:
    """With HPCCKPT_TEST_KEEP_LOG=DIR, the job's log as a user reads it and its event log
    are copied to DIR/<name>.log and DIR/<name>.events.jsonl (for the notes of a change)."""
    where = os.environ.get("HPCCKPT_TEST_KEEP_LOG")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tmp_path / "job.out", Path(where) / f"{name}.log")
        shutil.copyfile(tmp_path / "ckpt" / "events.jsonl", Path(where) / f"{name}.events.jsonl")


def submit(script: Path, tmp_path: Path, env: dict[str, str], *extra: str) -> str:
    log = tmp_path / "job.out"
    return sbatch(["--time=1", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                   *extra, script], env, cwd=str(tmp_path))  # fmt: skip


def test_series_shorter_writes_than_the_run_continues_across_segments(
    slurm_cluster, tmp_path, stopapp
):
    """(a) The issue's script: --time=1, --signal=B:USR1@30, a new file every ~6 s. The
    wrapper keeps one set per write, ends each segment right after a complete write when
    the next could not end in time (the USR1 waits for that), requeues; result identical."""
    mode = ["series", "1500", "50", "100", "100"]  # 75 s of work, a write every 5 s
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt = tmp_path / "ckpt"
    script = series_job(tmp_path, stopapp, mode, wrapper_opts=("--signal", "USR1"))
    job = submit(script, tmp_path, env, "--signal=B:USR1@30")
    info = drive(job, env, ckpt, timeout=300)
    text = log_of(tmp_path / "job.out")
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert info["JobState"] == "COMPLETED" and len(ends) >= 2, text
    assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, text
    requeues = events_of(ckpt, "requeue")
    assert [e["cause"] for e in requeues] == ["stop"] * (len(ends) - 1), text
    assert all(e.get("progress", True) for e in requeues) and not events_of(ckpt, "give_up")
    stops = [e for e in events_of(ckpt, "end_time_stop") if e.get("own_schedule")]
    assert len(stops) == len(ends) - 1, text
    assert all(e["lost"] < 5 and e["left"] > 0 for e in stops), stops  # right after a write
    assert text.count("stopped after checkpoint") == len(ends) - 1, text
    sets = events_of(ckpt, "restart_set")
    assert sets and all(e["files"] == 1 and e["began"] <= e["ended"] for e in sets), sets
    kept = sorted((ckpt / "restart-sets").glob("[0-9]*"))
    assert len(kept) == 2, kept  # bounded retention of the kept copies
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()
    keep_log(tmp_path, "series-across-segments")


def test_series_first_write_later_than_a_run_gives_up_after_three_runs(
    slurm_cluster, tmp_path, stopapp
):
    """(b) The first write comes after 90 s, the job has 60 s: every run ends with nothing
    kept; after the third in a row the wrapper gives up with the numbers and the fix,
    never requeues for ever, and never says "after checkpoint"."""
    mode = ["series", "4000", "50", "1800"]  # a write after 90 s
    env = cluster_env(slurm_cluster)
    ckpt = tmp_path / "ckpt"
    job = submit(series_job(tmp_path, stopapp, mode), tmp_path, env)
    info = drive(job, env, ckpt, timeout=330)
    text = log_of(tmp_path / "job.out")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "4:0", (info, text)
    assert int(info["Restarts"]) == MAX_STALLED_STOPS - 1, text
    requeues = events_of(ckpt, "requeue")
    assert [e.get("progress") for e in requeues] == [False] * (MAX_STALLED_STOPS - 1), text
    (give_up,) = events_of(ckpt, "give_up")
    assert give_up["cause"] == "no_progress" and give_up["stalled_runs"] == MAX_STALLED_STOPS
    assert give_up["first_write"] is None and give_up["run_seconds"] > 40, give_up
    assert "giving up: 3 runs in a row ended before the application wrote a restart set" in text
    assert "no restart write of the application was seen" in text and "longer --time" in text
    assert "after checkpoint" not in text and "nothing new was kept" in text, text
    assert not events_of(ckpt, "restart_set") and not list(tmp_path.glob("restart.*.bin"))
    keep_log(tmp_path, "series-gives-up")


def test_series_file_cut_by_slurms_term_is_moved_aside_and_the_run_resumes(
    slurm_cluster, tmp_path, stopapp
):
    """(c) The first run cannot read its end time (squeue fails), so only Slurm's TERM at
    the limit ends it, in the middle of a slow write: at the next start that file is moved
    into restart-sets/cut/ (event restart_files_cut), the code resumes from the previous
    file; result identical."""
    mode = ["series", "1200", "50", "100", "100"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt = tmp_path / "ckpt"
    first_run = (
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then\n'
        "    export HPCCKPT_SQUEUE=/bin/false STOPAPP_SLOW_STEP=800\n"  # 70 s from ~45 s on
        "fi\n"
    )
    job = submit(series_job(tmp_path, stopapp, mode, header=first_run), tmp_path, env)
    info = drive(job, env, ckpt, timeout=330)
    text = log_of(tmp_path / "job.out")
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, text
    term = [e for e in events_of(ckpt, "signal") if e["name"] == "TERM" and e["restart"] == 0]
    assert term and "note: no end-time stop" in text, text
    (cut,) = events_of(ckpt, "restart_files_cut")
    assert cut["restart"] == 1 and cut["files"] == [str(tmp_path / "restart.800.bin")], cut
    aside = Path(cut["moved_to"][0])
    assert aside.parent.parent == ckpt / "restart-sets" / "cut" and aside.is_file()
    assert aside.stat().st_size < (tmp_path / "restart.700.bin").stat().st_size
    assert "stopapp: resuming after step 700" in text, text
    assert "the application takes no signal, so a stop ends it by a kill" in text, text
    assert "after its restart files were complete" not in text, text  # a write was cut
    assert (tmp_path / "restart.100.bin").exists()  # the application's older files stay
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def test_fixed_set_rewritten_in_place_still_continues_across_segments(
    slurm_cluster, tmp_path, stopapp
):
    """(d) A fixed set (restart.0, restart.1) rewritten in place every 5 s: kept whole,
    the step ended right after a complete write, requeued, resumed; result identical."""
    mode = ["periodic", "1500", "50", "100"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt = tmp_path / "ckpt"
    job = submit(series_job(tmp_path, stopapp, mode, wrapper_opts=("--settle", "1")),
                 tmp_path, env)  # fmt: skip
    info = drive(job, env, ckpt, timeout=300)
    text = log_of(tmp_path / "job.out")
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert info["JobState"] == "COMPLETED" and len(ends) >= 2, text
    assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, text
    sets = events_of(ckpt, "restart_set")
    assert sets and all(e["files"] == 2 for e in sets), sets
    stops = [e for e in events_of(ckpt, "end_time_stop") if e.get("own_schedule")]
    # Right after a complete write: the work lost is what came since it, under a write
    # period (5 s here; longer when the machine is busy and the writes come late).
    assert len(stops) == len(ends) - 1 and all(e["lost"] < 10 for e in stops), (stops, text)
    assert not events_of(ckpt, "restart_files_cut") and not events_of(ckpt, "give_up")
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()
