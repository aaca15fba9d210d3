"""Every way a Slurm job is stopped, on the local cluster, with examples/c/stopapp.c.

stopapp behaves like the compiled codes of the wild: ``term`` checkpoints on the first
SIGTERM (>= 10 s, in pieces), exits 1, dies at once on a second TERM, ignores USR1;
``periodic`` takes no signal and rewrites its restart files every few steps. Each test
submits real batch jobs and compares the final field with an uninterrupted run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcckpt.rundir.events import read_events
from tests import slurm_helpers
from tests.mpi_helpers import EXAMPLES, mpi_env
from tests.slurm_helpers import FINAL, RELEASE_AFTER, job_info, sbatch

pytestmark = [pytest.mark.slurm, pytest.mark.mpi, pytest.mark.slow]

VENV_BIN = str(Path(sys.executable).parent)
HPCCKPT = f"{VENV_BIN}/hpcckpt"


def cluster_env(cluster) -> dict[str, str]:
    """:func:`tests.slurm_helpers.cluster_env`, and Open MPI's mpirun allowed as root."""
    env = slurm_helpers.cluster_env(cluster)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


class Reference:
    """The result of an uninterrupted run (no sleep; its writes still pause: "periodic 3000
    ... 40" takes 68 s alone, more beside the other tests' fsyncs), run in the background
    while the test's job runs: :meth:`bytes` waits for it."""

    def __init__(self, binary: Path, tmp_path: Path, mode_args: list[str], ranks: int) -> None:
        mode, steps, _sleep, *rest = mode_args
        self.out = tmp_path / "ref.bin"
        args = [mode, steps, "0", str(tmp_path / "ref-rs"), str(self.out), *rest]
        self.log = tmp_path / "ref.log"
        with open(self.log, "wb") as log:
            cmd = ["mpirun", "-n", str(ranks), str(binary), *args]
            self.proc = subprocess.Popen(cmd, env=mpi_env(), stdout=log, stderr=subprocess.STDOUT)
        self._bytes: bytes | None = None

    def bytes(self) -> bytes:
        if self._bytes is None:
            try:
                self.proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            assert self.proc.returncode == 0, log_of(self.log)
            self._bytes = self.out.read_bytes()
        return self._bytes


def reference(binary: Path, tmp_path: Path, mode_args: list[str], ranks: int = 2) -> Reference:
    """:class:`Reference`, started now."""
    return Reference(binary, tmp_path, mode_args, ranks)


def app_args(binary: Path, tmp_path: Path, mode_args: list[str]) -> list[str]:
    mode, steps, sleep, *rest = mode_args
    return [str(binary), mode, steps, sleep, str(tmp_path / "rs"), str(tmp_path / "out.bin"),
            *rest]  # fmt: skip


def launcher_words(launcher: str, app: list[str]) -> list[str]:
    if launcher == "srun":
        return ["srun", "--", "--mpi=pmix", "-n", "2", *app]
    return ["run", "--", "mpirun", "-n", "2", *app]


def write_script(path: Path, line: str, header: str = "", trap: bool = True) -> Path:
    """A batch script as the templates write it (``trap``): the warning ignored until
    ``exec`` hands the shell to the wrapper (Slurm can send it as a run starts)."""
    lines = f"{header}{line}".split("\n")
    if trap:  # after the #SBATCH lines: sbatch reads none after the first command
        first = next((i for i, text in enumerate(lines) if not text.startswith("#")), len(lines))
        lines.insert(first, "trap '' USR1 USR2")
    path.write_text("#!/bin/bash\n" + "\n".join(lines) + "\n")
    path.chmod(0o755)
    return path


def log_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(no log)"


def drive(job: str, env: dict[str, str], ckpt: Path, timeout: float, on_start=None) -> dict:
    """Follow the job to its end, releasing requeued runs; ``on_start(restart, seconds since
    that run's wrapper_start)`` is called every half second while a run is going on."""
    deadline = time.monotonic() + timeout
    held_since = None
    seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        info = job_info(job, env)
        if info.get("JobState") in FINAL:
            return info
        for ev in read_events(ckpt) if ckpt.exists() else []:
            if ev.get("event") == "wrapper_start" and ev["restart"] not in seen:
                seen[ev["restart"]] = time.monotonic()
        if on_start is not None and seen and info.get("JobState") == "RUNNING":
            restart = max(seen)
            on_start(restart, time.monotonic() - seen[restart])
        held = info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime"
        held_since = (held_since or time.monotonic()) if held else None
        if held and time.monotonic() - held_since >= RELEASE_AFTER:
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                           capture_output=True, timeout=30)  # fmt: skip
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    pytest.fail(f"job {job} did not end within {timeout} s (last: {job_info(job, env)})")


def events_of(ckpt: Path, kind: str) -> list[dict]:
    return [e for e in read_events(ckpt) if e["event"] == kind]


@pytest.mark.parametrize("launcher", ["srun", "mpirun"])
def test_term_app_three_segments(slurm_cluster, tmp_path, stopapp, launcher):
    """The B: signal becomes the app's TERM, delivered once to every rank (scancel --signal
    JOB under srun, the rank processes under mpirun): three segments, each resuming later,
    every run's exit status 1 after complete restart files is a stop; result identical."""
    mode = ["term", "400", "50"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    wrapper = [HPCCKPT, *launcher_words(launcher, app_args(stopapp, tmp_path, mode))]
    opts = ["--ckpt-dir", str(ckpt), "--app-signal", "TERM",
            "--restart-files", f"{tmp_path}/rs.*"]  # fmt: skip
    wrapper[2:2] = opts
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    signalled: set[int] = set()

    def stop_twice(restart: int, running_for: float) -> None:
        # once this run's ranks are past their start (rank 0 says so after a collective that
        # follows every rank's sigaction): a TERM before it would kill a rank, not test a stop
        started = sum(log_of(log).count(f"stopapp: {w}") for w in ("starting", "resuming"))
        if restart < 2 and restart not in signalled and running_for > 6 and started > restart:
            signalled.add(restart)  # what Slurm's --signal=B:USR1@T does, at a known moment
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)

    info = drive(job, env, ckpt, timeout=300, on_start=stop_twice)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 2, text
    delivered = events_of(ckpt, "signal_delivered")
    path = "scancel" if launcher == "srun" else "ranks"
    assert [(e["signal"], e["path"]) for e in delivered] == [("TERM", path)] * 2, text
    assert text.count("stopapp: stop signal; writing restart files") == 2, text
    sets = events_of(ckpt, "restart_set")
    assert [e["stop"] for e in sets] == [True, True] and all(e["seconds"] >= 10 for e in sets)
    ends = [(e["outcome"], e["exit_code"]) for e in events_of(ckpt, "step_end")]
    assert [o for o, _ in ends] == ["stopped", "stopped", "finished"], text
    assert ends[0][1] != 0, "stopapp exits 1 after its restart files: still a stop"
    resumed = [int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stopapp: resuming after step")]  # fmt: skip
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < 400, text
    assert not events_of(ckpt, "crashed"), text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def test_a_stop_that_kills_the_app_still_starting_is_continued_not_given_up(
    slurm_cluster, tmp_path, stopapp
):
    """The second run's stop reaches the application still starting (a shell in front of
    it, as a code still in MPI_Init or reading its restart files has no TERM handler yet):
    its tasks die of the TERM, no restart file written. Not a crash to give up on (the run
    was seconds old: --min-progress) but a stop that kept nothing new: requeued, the third
    run resumes from the first run's set; result identical."""
    mode = ["term", "200", "50"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    app = shlex.join(app_args(stopapp, tmp_path, mode))
    starting = f'if [ "$SLURM_RESTART_COUNT" = 1 ]; then sleep 60; fi; exec {app}'
    wrapper = [HPCCKPT, "srun", "--ckpt-dir", str(ckpt), "--app-signal", "TERM",
               "--restart-files", f"{tmp_path}/rs.*", "--", "--mpi=pmix", "-n", "2",
               "sh", "-c", starting]  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    signalled: set[int] = set()

    def stop_first_two(restart: int, running_for: float) -> None:
        started = "stopapp: starting" in log_of(log)  # the first run's ranks have handlers
        if restart < 2 and restart not in signalled and running_for > 6 and started:
            signalled.add(restart)
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)

    info = drive(job, env, ckpt, timeout=300, on_start=stop_first_two)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 2, text
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert ends == ["stopped", "stopped", "finished"], text
    assert "before writing any restart file" in text and "nothing new was kept" in text, text
    requeues = events_of(ckpt, "requeue")
    assert [(e["cause"], e.get("progress", True)) for e in requeues] == [
        ("stop", True),
        ("stop", False),
    ], text
    assert not events_of(ckpt, "crashed") and not events_of(ckpt, "give_up"), text
    assert [e["set"] for e in events_of(ckpt, "restart_files_checked")] == [1, 1], text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def _cut_write_then_kill(path: Path, job: str, timeout: float = 8.0) -> int | None:
    """Wait until ``path`` is caught half-written, then SIGKILL every task of the job."""
    from tests.slurm_helpers import job_task_pids

    full = 12 + 2000 * 8 + 4  # header, the rank's cells, the trailer (stopapp.c)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            size = path.stat().st_size
        except OSError:
            size = 0
        if 12 < size < full:
            for pid in job_task_pids(job):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            return size
        time.sleep(0.02)
    return None


def test_no_signal_app_own_schedule_across_segments(slurm_cluster, tmp_path, stopapp):
    """An app that takes no signal and rewrites its restart files every 40 steps, no
    --signal, --time=1: killed once mid-write (crash: the cut file is found and the kept
    set put back at the next start), stopped by the wrapper's end-time stop once no write
    is under way (a stop: requeued), finished; result identical."""
    mode = ["periodic", "800", "50", "40"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    wrapper = [HPCCKPT, "srun", "--ckpt-dir", str(ckpt), "--settle", "1",
               "--restart-files",
               f"{tmp_path}/rs.*", "--", "--mpi=pmix", "-n", "2",
               *app_args(stopapp, tmp_path, mode)]  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    job = sbatch(["--time=1", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    cut: list[int | None] = []

    def kill_mid_write(restart: int, _running_for: float) -> None:
        if restart == 0 and not cut and events_of(ckpt, "restart_set"):
            cut.append(_cut_write_then_kill(tmp_path / "rs.0", job))

    info = drive(job, env, ckpt, timeout=400, on_start=kill_mid_write)
    text = log_of(log)
    assert cut and cut[0] is not None, f"never caught rs.0 half-written:\n{text}"
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == len(ends) - 1, text
    assert ends[0] == "crashed" and ends[-1] == "finished", text
    assert len(ends) >= 3 and set(ends[1:-1]) == {"stopped"}, text
    checked = events_of(ckpt, "restart_files_checked")
    assert checked and checked[0]["restored"] is True, text
    assert any("rs.0" in p for p in checked[0]["problems"]), checked
    assert events_of(ckpt, "end_time_stop") and not events_of(ckpt, "signal_delivered"), text
    causes = [e["cause"] for e in events_of(ckpt, "requeue")]
    assert causes == ["crash"] + ["stop"] * (len(ends) - 2), text
    sets = events_of(ckpt, "restart_set")
    assert all(not e["stop"] and e["seconds"] < 5 for e in sets), sets  # one write each
    assert "HPCCKPT_INTERVAL=" in text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def _heat_words(tmp_path: Path, steps: int) -> list[str]:
    heat = str(EXAMPLES / "heat2d.py")
    return [sys.executable, heat, "--nx", "64", "--ny", "64", "--sleep", "0.1", "--steps",
            str(steps), "--every", "10", "--out", str(tmp_path / "heat.npy")]  # fmt: skip


def test_no_signal_time_limit_both_kinds(slurm_cluster, tmp_path, stopapp):
    """No #SBATCH --signal, --time=2 (the two kinds as concurrent jobs): the wrapper's
    end-time stop checkpoints both an --app-signal TERM app and a Checkpointer app whose
    own deadline is off (HPCCKPT_END_TIME=unlimited) before the limit; requeue, resume,
    results identical."""
    import numpy as np

    env = cluster_env(slurm_cluster)
    c_dir, api_dir = tmp_path / "c", tmp_path / "api"
    c_dir.mkdir()
    api_dir.mkdir()
    mode = ["term", "2000", "50"]  # 100 s: longer than one segment
    expected = reference(stopapp, c_dir, mode, ranks=1)
    ref = subprocess.run(
        ["mpirun", "-n", "1", *_heat_words(api_dir, 1500)[:-2], "--sleep", "0", "--ckpt-dir",
         str(api_dir / "ref-ckpt"), "--out", str(api_dir / "ref.npy")],  # fmt: skip
        env=mpi_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr
    c_line = shlex.join([HPCCKPT, "srun", "--ckpt-dir", str(c_dir / "ckpt"), "--app-signal",
                         "TERM", "--restart-files", f"{c_dir}/rs.*", "--",
                         "--mpi=pmix", "-n", "1", *app_args(stopapp, c_dir, mode)])  # fmt: skip
    api_line = shlex.join([HPCCKPT, "srun", "--ckpt-dir", str(api_dir / "ckpt"), "--",
                           "--mpi=pmix", "-n", "1", *_heat_words(api_dir, 1500)])  # fmt: skip
    jobs = []
    no_deadline = "export HPCCKPT_END_TIME=unlimited\n"
    for where, line, header in ((c_dir, c_line, ""), (api_dir, api_line, no_deadline)):
        script = write_script(where / "job.sbatch", "exec " + line, header)
        jobs.append(sbatch(["--time=2", "-n", "1", "--requeue", "--open-mode=append",
                            f"--output={where}/job.out", script], env, cwd=str(where)))  # fmt: skip
    wheres = (c_dir, api_dir)
    infos = [drive(job, env, w / "ckpt", timeout=400) for job, w in zip(jobs, wheres, strict=True)]
    for info, where in zip(infos, wheres, strict=True):
        text = log_of(where / "job.out")
        assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, text
        stops = events_of(where / "ckpt", "end_time_stop")
        assert len(stops) == int(info["Restarts"]) and all(e["left"] > 5 for e in stops), text
        assert [e["cause"] for e in events_of(where / "ckpt", "requeue")] == ["stop"] * len(stops)
        assert "end-time stop armed" in text and "TIMEOUT" not in text, text
    assert (c_dir / "out.bin").read_bytes() == expected.bytes()
    api_stops = [e for e in read_events(api_dir / "ckpt") if e["event"] == "stop"]
    assert api_stops and all(e["reason"] != "deadline" for e in api_stops), api_stops
    assert np.load(api_dir / "heat.npy").tobytes() == np.load(api_dir / "ref.npy").tobytes()


def test_not_execd_wrapper_says_so_and_still_stops_in_time(slurm_cluster, tmp_path, stopapp):
    """The wrapper line without `exec` and --signal=B:USR1@30: the first lines of the job
    log name the problem and the fix, and the end-time stop checkpoints and requeues
    before the USR1 that would kill the batch shell."""
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    mode = ["term", "100000", "50"]
    # The end-time stop comes at once (a 2-minute job): held until the ranks have run
    # 15 s, which they may need on a loaded machine to install their TERM handler (srun
    # shows the wrapper no rank's handlers; with the default 5 s a CI run's ranks were
    # killed by the TERM before writing any restart file).
    line = shlex.join([HPCCKPT, "srun", "--ckpt-dir", str(ckpt), "--app-signal", "TERM",
                       "--app-ready", "15", "--restart-files", f"{tmp_path}/rs.*", "--",
                       "--mpi=pmix", "-n", "2", *app_args(stopapp, tmp_path, mode)])  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", line + "\necho 'batch script goes on'",
                          "#SBATCH --signal=B:USR1@30\n", trap=False)  # fmt: skip
    job = sbatch(["--time=2", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (ckpt.exists() and events_of(ckpt, "requeue")):
        time.sleep(0.5)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    text = log_of(log)
    first = [ln for ln in text.splitlines() if ln.startswith("hpcckpt:")][:3]
    assert (
        "not the batch shell" in first[0] and "its parent is the batch script's shell" in first[0]
    ), text
    assert "exec hpcckpt" in first[1], text
    shell = events_of(ckpt, "not_batch_shell")
    assert shell and shell[0]["signal_lead"] == 30 and shell[0]["script_signal"] == "USR1"
    stop = events_of(ckpt, "end_time_stop")
    assert stop and stop[0]["left"] > 30 + 60, text  # before USR1@30 can come (60 s slack)
    assert [e["cause"] for e in events_of(ckpt, "requeue")] == ["stop"], text
    kept = events_of(ckpt, "restart_set")
    assert kept and kept[0]["stop"] is True, text


@pytest.mark.parametrize("how", ["requeue", "chain"])
def test_array_tasks_continue_alone(slurm_cluster, tmp_path, stopapp, how):
    """sbatch --array=0-2, no --signal, --time=1: each task is stopped by the end-time stop
    and continues alone (requeued as <array>_<task>, or chained with --array=<task>): never
    more than one job per index in the queue (two while a link waits for its predecessor);
    all three results identical."""
    mode = ["term", "300", "50"]
    expected = reference(stopapp, tmp_path, mode, ranks=1)
    env = cluster_env(slurm_cluster)
    d = str(tmp_path)
    chain = "--chain " if how == "chain" else ""
    body = (
        f"#SBATCH --array=0-2 --time=1 -n 1 --open-mode=append --output={d}/task-%a.out\n"
        'T=$SLURM_ARRAY_TASK_ID\nexport HPCCKPT_CHAIN_SCRIPT="$0"\n'
        f"exec {HPCCKPT} srun {chain}--ckpt-dir {d}/ckpt-$T --app-signal TERM "
        f'--restart-files "{d}/rs$T.*" -- --mpi=pmix -n 1 {stopapp} term 300 50 {d}/rs$T '
        f"{d}/out$T.bin"
    )
    script = write_script(tmp_path / "array.sbatch", body)
    first = sbatch(["--requeue", f"--job-name=arr-{how}", script], env, cwd=d)
    jobs = {f"{first}_{t}" for t in range(3)}
    done: dict[str, dict] = {}
    most: dict[str, int] = {}
    deadline = time.monotonic() + 400
    while len(done) < len(jobs) and time.monotonic() < deadline:
        squeue = ["squeue", "-h", "-r", "-n", f"arr-{how}", "-o", "%K"]  # the array index
        listed = subprocess.run(squeue, env=env, capture_output=True, text=True, timeout=30)
        indexes = listed.stdout.split()
        for index in set(indexes):
            most[index] = max(most.get(index, 0), indexes.count(index))
        for t in range(3):
            ckpt = tmp_path / f"ckpt-{t}"
            for ev in read_events(ckpt) if ckpt.exists() else []:
                if ev["event"] == "chain_submitted":
                    jobs.add(ev["next_job"])
        for job in sorted(jobs - set(done)):
            info = job_info(job, env)
            if info.get("JobState") in FINAL:
                done[job] = info
            elif info.get("JobState") == "PENDING" and info.get("Reason") == "BeginTime":
                time.sleep(RELEASE_AFTER)
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env,
                               capture_output=True, timeout=30)  # fmt: skip
        time.sleep(0.5)
    subprocess.run(["scancel", "-n", f"arr-{how}"], env=env, capture_output=True, timeout=30)
    logs = "\n".join(log_of(p) for p in sorted(tmp_path.glob("task-*.out")))
    assert len(done) == len(jobs), f"not all ended: {sorted(jobs - set(done))}\n{logs}"
    states = {job: (i["JobState"], i.get("ExitCode"), i.get("Reason")) for job, i in done.items()}
    print(logs)  # shown with a failure (an assertion message that long is cut)
    assert all(state == "COMPLETED" for state, _, _ in states.values()), states
    per_index = 2 if how == "chain" else 1
    assert set(most) <= {"0", "1", "2"} and max(most.values()) <= per_index, (most, logs)
    for t in range(3):
        evs = list(read_events(tmp_path / f"ckpt-{t}"))
        starts = [e for e in evs if e["event"] == "wrapper_start"]
        assert len(starts) >= 2 and {e["array_task"].split("_")[1] for e in starts} == {str(t)}
        ends = [e["outcome"] for e in evs if e["event"] == "step_end"]
        assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, logs
        if how == "requeue":
            info = done[f"{first}_{t}"]
            assert int(info["Restarts"]) == len(ends) - 1, (info, logs)
            assert [e["cause"] for e in evs if e["event"] == "requeue"] == ["stop"] * (
                len(ends) - 1
            )
            assert f"requeueing job {first}_{t} (scontrol requeue)" in logs or t != 0, logs
        else:
            subs = [e for e in evs if e["event"] == "chain_submitted"]
            assert len(subs) == len(ends) - 1, logs
            assert all(int(i.get("Restarts", 0)) == 0 for i in done.values())
        assert (tmp_path / f"out{t}.bin").read_bytes() == expected.bytes()
    if how == "chain":
        assert len(jobs) == 3 + sum(
            len([e for e in read_events(tmp_path / f"ckpt-{t}") if e["event"] == "chain_submitted"])
            for t in range(3)
        )


@pytest.fixture(scope="module")
def preempt_cluster():
    """A 1-node cluster of its own with a preemptible default partition and `high`."""
    from hpcckpt.cluster import ClusterError, LocalCluster
    from tests.conftest import SLURM_TEST_DIR, SLURM_TEST_PORT

    cluster = LocalCluster(f"{SLURM_TEST_DIR}-preempt", port=SLURM_TEST_PORT + 8)
    try:
        yield cluster
    finally:
        try:
            cluster.down(stop_munge=False)
        except ClusterError:
            pass


# Both modes use the one preemptible cluster (its directory and port): one worker, in turn.
@pytest.mark.xdist_group("preempt")
@pytest.mark.parametrize("mode", ["requeue", "requeue-signal"])
def test_preemption_checkpoints_within_grace_and_requeues_once(preempt_cluster, tmp_path,
                                                               stopapp, mode):  # fmt: skip
    """A `high` job preempts ours (GraceTime 30): without send_user_signal the tasks get
    Slurm's TERM directly and the wrapper learns of the preemption (PreemptTime); with it,
    the B:USR1 reaches the wrapper, which forwards TERM. Either way the restart files are
    complete within the grace time, the job is requeued once (not twice), resumes, and the
    result is identical."""
    from hpcckpt.cluster import ClusterError

    try:
        preempt_cluster.up(nodes=1, cpus_per_node=2, kill_wait=10, preempt=mode, grace_time=30)
    except ClusterError as exc:
        pytest.fail(f"the preemptible cluster did not start: {exc}")
    mode_args = ["term", "300", "50"]
    expected = reference(stopapp, tmp_path, mode_args)
    env = cluster_env(preempt_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    line = shlex.join([HPCCKPT, "srun", "--ckpt-dir", str(ckpt), "--app-signal", "TERM",
                       "--restart-files", f"{tmp_path}/rs.*", "--",
                       "--mpi=pmix", "-n", "2",
                       *app_args(stopapp, tmp_path, mode_args)])  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", "exec " + line, "#SBATCH --signal=B:USR1@10\n")
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    preempted: list[float] = []

    def preempt(restart: int, running_for: float) -> None:
        if restart == 0 and not preempted and running_for > 5:
            preempted.append(time.time())
            sbatch(["-p", "high", "-n", "2", f"--output={tmp_path}/high.out", "--wrap", "sleep 3"],
                   env)  # fmt: skip

    info = drive(job, env, ckpt, timeout=300, on_start=preempt)
    text = log_of(log)
    assert preempted, text
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 1, text
    assert [e["cause"] for e in events_of(ckpt, "requeue")] == ["stop"], text
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert ends == ["stopped", "finished"], text
    sets = events_of(ckpt, "restart_set")
    assert len(sets) == 1 and sets[0]["stop"], text
    requeued = events_of(ckpt, "requeue")[0]
    # within the grace time of the preemption (Slurm acts within ~1 s of the submission)
    assert requeued["time"] - preempted[0] < 30, text
    if mode == "requeue":
        assert events_of(ckpt, "preempted") and not events_of(ckpt, "signal_delivered"), text
    else:
        delivered = events_of(ckpt, "signal_delivered")
        assert [e["signal"] for e in delivered] == ["TERM"], text
        assert not events_of(ckpt, "preempted"), text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def test_scancel_keeps_newest_set_and_resubmission_resumes(slurm_cluster, tmp_path, stopapp):
    """`scancel JOB` while a kept set exists, during the application's TERM write: the job
    ends CANCELLED and is not requeued; the kept set stays; the file cut by the kill is
    replaced by it at the next submission, which resumes from it; result identical."""
    mode = ["term", "400", "50"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    wrapper = [HPCCKPT, "srun", "--ckpt-dir", str(ckpt), "--app-signal", "TERM",
               "--restart-files", f"{tmp_path}/rs.*", "--", "--mpi=pmix", "-n", "2",
               *app_args(stopapp, tmp_path, mode)]  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    submit = ["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}", script]
    job = sbatch(submit, env, cwd=str(tmp_path))
    acted: set[str] = set()
    full = 12 + 2000 * 8 + 4  # header, the rank's cells, the trailer (stopapp.c)

    def stop_then_cancel(restart: int, running_for: float) -> None:
        if restart == 0 and "kept" not in acted and running_for > 6:
            acted.add("kept")  # a kept set first: the time-limit stop, as Slurm's B:USR1 does
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)
        if restart == 1 and "stop" not in acted and running_for > 6:
            acted.add("stop")  # the next stop's TERM write is under way (10 pieces, 11 s) ...
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)
        elif "stop" in acted and "cancel" not in acted:
            size = (tmp_path / "rs.0").stat().st_size
            if 12 < size < full:  # ... when the job is cancelled: the kill cuts it
                acted.add("cancel")
                subprocess.run(["scancel", job], env=env, timeout=30)

    info = drive(job, env, ckpt, timeout=300, on_start=stop_then_cancel)
    text = log_of(log)
    assert acted == {"kept", "stop", "cancel"}, text
    assert info["JobState"] == "CANCELLED" and int(info["Restarts"]) == 1, (info, text)
    assert [e["cause"] for e in events_of(ckpt, "requeue")] == ["stop"], text
    assert events_of(ckpt, "cancelled") and not events_of(ckpt, "give_up"), text
    assert "was cancelled (scancel): not continuing it" in text, text
    sets = events_of(ckpt, "restart_set")
    assert len(sets) == 1 and sets[0]["stop"] and sets[0]["restart"] == 0, text
    sizes = [(tmp_path / f"rs.{r}").stat().st_size for r in range(2)]
    assert min(sizes) < full, f"the kill did not cut the TERM write: {sizes}\n{text}"
    again = sbatch(submit, env, cwd=str(tmp_path))
    info = drive(again, env, ckpt, timeout=300)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 0, (info, text)
    checked = [e for e in events_of(ckpt, "restart_files_checked") if e["job_id"] == again]
    assert checked and checked[0]["restored"] is True and checked[0]["set"] == 1, checked
    assert any("rs." in p for p in checked[0]["problems"]), checked
    resumed = [int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stopapp: resuming after step")]  # fmt: skip
    assert len(resumed) == 2 and resumed[0] == resumed[1], text  # twice from set 1
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def _own_schedule_job(tmp_path: Path, stopapp: Path, mode: list[str], header: str = "") -> Path:
    wrapper = [HPCCKPT, "srun", "--ckpt-dir", str(tmp_path / "ckpt"), "--settle", "1",
               "--restart-files", f"{tmp_path}/rs.*", "--", "--mpi=pmix", "-n", "2",
               *app_args(stopapp, tmp_path, mode)]  # fmt: skip
    return write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper), header)


def test_own_schedule_limit_shortened_mid_run(slurm_cluster, tmp_path, stopapp):
    """An app on its own schedule, no --signal, --time=5; 10 s in, an administrator
    shortens the limit to 2 minutes (scontrol update TimeLimit=2). The wrapper reads the
    end time again, moves its end-time stop, ends the step between two writes: a stop,
    requeued; the next segment resumes; result identical."""
    mode = ["periodic", "3000", "50", "40"]  # 150 s of work, a write every 2 s
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    script = _own_schedule_job(tmp_path, stopapp, mode)
    job = sbatch(["--time=5", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    shortened: list[float] = []

    def shorten(restart: int, running_for: float) -> None:
        if restart == 0 and not shortened and running_for > 10:
            shortened.append(time.time())
            subprocess.run(["scontrol", "update", f"JobId={job}", "TimeLimit=2"], env=env,
                           check=True, capture_output=True, timeout=30)  # fmt: skip

    info = drive(job, env, ckpt, timeout=500, on_start=shorten)
    text = log_of(log)
    assert shortened, text
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, text
    moved = [e for e in events_of(ckpt, "end_time_moved") if e["restart"] == 0]
    assert moved and moved[0]["by"] < -150, text  # 5 min -> 2 min
    assert "the job's end time moved earlier by" in text, text
    stops = events_of(ckpt, "end_time_stop")
    assert stops and stops[0]["restart"] == 0 and stops[0]["left"] > 5, text
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, text
    assert [e["cause"] for e in events_of(ckpt, "requeue")] == ["stop"] * (len(ends) - 1)
    assert "TIMEOUT" not in text and "HPCCKPT_INTERVAL=" in text, text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def test_own_schedule_slurm_term_at_the_limit_first(slurm_cluster, tmp_path, stopapp):
    """An app on its own schedule, no --signal, and in the first run an end time the
    wrapper cannot read (squeue fails): only Slurm's TERM at the time limit comes, to the
    batch shell, srun and the tasks at once. The newest complete set is kept, the job is
    requeued within KillWait (a stop), a cut file is replaced at the next start, which
    resumes (later runs read the end time and stop themselves); result identical."""
    mode = ["periodic", "2400", "50", "40"]  # 120 s of work: two or more segments
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(slurm_cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    unreadable = (
        'if [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then export HPCCKPT_SQUEUE=/bin/false; fi\n'
    )
    script = _own_schedule_job(tmp_path, stopapp, mode, unreadable)
    job = sbatch(["--time=1", "-n", "2", "--requeue", "--open-mode=append", f"--output={log}",
                  script], env, cwd=str(tmp_path))  # fmt: skip
    info = drive(job, env, ckpt, timeout=500)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, text
    assert "note: no end-time stop" in text, text
    assert all(e["restart"] > 0 for e in events_of(ckpt, "end_time_stop")), text
    term = [e for e in events_of(ckpt, "signal") if e["name"] == "TERM" and e["restart"] == 0]
    assert term, text
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert ends[-1] == "finished" and set(ends[:-1]) == {"stopped"}, text
    requeues = events_of(ckpt, "requeue")
    assert [e["cause"] for e in requeues] == ["stop"] * (len(ends) - 1), text
    first = requeues[0]
    assert first["restart"] == 0 and first["time"] - term[0]["time"] < 10, (first, term)  # KillWait
    kept = [e for e in events_of(ckpt, "restart_set") if e["restart"] == 0]
    checked = [e for e in events_of(ckpt, "restart_files_checked") if e["restart"] == 1]
    assert kept and checked and checked[0]["set"] == kept[-1]["set"], text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()


def test_term_app_mpirun_two_nodes_each_node_signals_its_own_ranks(
    slurm_cluster_nodes, tmp_path, stopapp
):
    """`hpcckpt run -- mpirun` on 2 nodes, --app-signal TERM: the wrapper's node cannot see
    the other node's ranks in a real cluster's /proc, so a signaller on every node
    (srun --overlap) signals the ranks of its own node only (every "node" here shares one
    /proc: each signaller must filter by its node name, and reports one rank). Three
    segments; result identical."""
    cluster = slurm_cluster_nodes(2)
    mode = ["term", "400", "50"]
    expected = reference(stopapp, tmp_path, mode)
    env = cluster_env(cluster)
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.out"
    app = app_args(stopapp, tmp_path, mode)
    wrapper = [HPCCKPT, "run", "--ckpt-dir", str(ckpt), "--app-signal", "TERM",
               "--restart-files", f"{tmp_path}/rs.*", "--", "mpirun", "-n", "2", "--map-by",
               "node", *app]  # fmt: skip
    script = write_script(tmp_path / "job.sbatch", "exec " + shlex.join(wrapper))
    submit = ["--time=5", "-N", "2", "--ntasks-per-node=1", "--requeue", "--open-mode=append"]
    job = sbatch([*submit, f"--output={log}", script], env, cwd=str(tmp_path))
    signalled: set[int] = set()

    def stop_twice(restart: int, running_for: float) -> None:
        if restart < 2 and restart not in signalled and running_for > 6:
            signalled.add(restart)
            subprocess.run(["scancel", "-b", "--signal=USR1", job], env=env, timeout=30)

    info = drive(job, env, ckpt, timeout=400, on_start=stop_twice)
    text = log_of(log)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) == 2, text
    delivered = events_of(ckpt, "signal_delivered")
    assert [(e["signal"], e["path"]) for e in delivered] == [("TERM", "nodes")] * 2, text
    for ev in delivered:
        reports = ev["nodes"]
        assert [r["node"] for r in reports] == ["n1", "n2"], reports
        assert all(len(r["ranks"]) == 1 and len(r["pids"]) == 1 for r in reports), reports
        assert sorted(r["ranks"][0] for r in reports) == [0, 1], reports
    assert "by a signaller on every node (n1: rank" in text, text
    assert text.count("stopapp: stop signal; writing restart files") == 2, text
    ends = [e["outcome"] for e in events_of(ckpt, "step_end")]
    assert ends == ["stopped", "stopped", "finished"], text
    resumed = [int(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stopapp: resuming after step")]  # fmt: skip
    assert len(resumed) == 2 and 0 < resumed[0] < resumed[1] < 400, text
    assert (tmp_path / "out.bin").read_bytes() == expected.bytes()
