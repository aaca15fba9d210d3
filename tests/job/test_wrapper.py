"""The job wrapper end to end: real wrapper processes, real applications, real signals.

The applications in ``tests/job/apps`` follow the wrapper's contract (status file,
attempt token) without HDF5. Slurm is faked only where the wrapper calls it: a fake
``scontrol`` through ``HPCCKPT_SCONTROL`` and a fake ``srun`` through ``HPCCKPT_SRUN``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcckpt.job import config
from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus, read_status, write_status
from tests.permission_helpers import as_a_user, immutable, who

REPO = Path(__file__).resolve().parents[2]
APP = Path(__file__).resolve().parent / "apps" / "contract_app.py"


def clean_env(**extra: str) -> dict[str, str]:
    """Our environment minus Slurm's and hpcckpt's variables: 'outside Slurm'."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "HPCCKPT_")) and k != "OMPI_MCA_io"
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def app(*args: str) -> list[str]:
    return [sys.executable, str(APP), *args]


def caught(pid: int, sig: int) -> bool:
    """Does process ``pid`` have a handler for ``sig`` (SigCgt in /proc)?"""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        pass
    return False


class Wrapped:
    """A wrapper process under test, its stderr collected line by line."""

    def __init__(
        self,
        ckpt: Path | str,
        command: list[str],
        *options: str,
        env: dict[str, str] | None = None,
        subcommand: str = "run",
        cwd: Path = REPO,
    ) -> None:
        argv = [sys.executable, "-m", "hpcckpt.cli.entry", subcommand]
        if ckpt is not None:
            argv += ["--ckpt-dir", str(ckpt)]
        argv += [*options, "--", *command]
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            argv, cwd=cwd, env=env or clean_env(), stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    def wait_line(self, text: str, timeout: float = 20) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if text in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.01)
        raise AssertionError(f"no stderr line with {text!r}; stderr:\n{self.stderr}")

    def send(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 60) -> int:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"wrapper did not exit; stderr:\n{self.stderr}") from None
        self._reader.join(5)
        return rc


def wait_state(
    ckpt: Path, state: str, timeout: float = 120, wrapper: Wrapped | None = None
) -> RunStatus:
    """The status once it reads ``state``. The timeout only guards against a hang: how
    long Python takes to start and import MPI under load is not what these tests check.
    With ``wrapper``, a wrapper that exits first fails at once, with what it said."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = read_status(ckpt)
        if status is not None and status.state == state:
            return status
        if wrapper is not None and wrapper.proc.poll() is not None:
            raise AssertionError(
                f"the wrapper exited ({wrapper.proc.returncode}) before the status became "
                f"{state!r} (last: {status}); stderr:\n{wrapper.stderr}"
            )
        time.sleep(0.01)
    why = f"; stderr:\n{wrapper.stderr}" if wrapper is not None else ""
    raise AssertionError(f"status never became {state!r} (last: {read_status(ckpt)}){why}")


def events(ckpt: Path) -> list[dict]:
    return [json.loads(line) for line in (ckpt / "events.jsonl").read_text().splitlines()]


def kinds(ckpt: Path) -> list[str]:
    return [e["event"] for e in events(ckpt)]


def received(ckpt: Path, rank: int = 0) -> list[str]:
    return json.loads((ckpt / f"signals.rank{rank}.json").read_text())["received"]


def fake(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


# -- pure functions ------------------------------------------------------------------------


# -- outside Slurm -------------------------------------------------------------------------


def test_usr1_after_running_stops_the_app(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"))
    wait_state(ckpt, RUNNING)
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR1"]
    assert "forwarded to step (pid" in w.wait_line("signal USR1 received")
    line = w.wait_line("run again to resume")  # a stand-in app: no Checkpointer, no claim
    assert "after the application was asked to checkpoint" in line and "cannot be seen" in line
    assert kinds(ckpt) == ["wrapper_start", "signal", "step_end", "stopped"]
    ev = events(ckpt)
    attempt = ev[0]["attempt"]
    assert all(e["attempt"] == attempt for e in ev)
    assert ev[0]["command"] == app("stop")
    assert ev[1]["name"] == "USR1" and ev[1]["forwarded"] is True and ev[1]["elapsed"] > 0
    assert ev[2]["outcome"] == "stopped" and ev[2]["exit_code"] == 0
    assert read_status(ckpt).attempt == attempt


def test_term_is_forwarded_as_usr1(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"))
    wait_state(ckpt, RUNNING)
    w.send(signal.SIGTERM)
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR1"]  # srun would SIGKILL the tasks on TERM
    assert "forwarded as USR1 to step" in w.wait_line("signal TERM received")


def test_configured_signal_is_what_gets_forwarded(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop"), "--signal", "SIGUSR2")
    wait_state(ckpt, RUNNING)
    w.send(signal.SIGTERM)
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR2"]


def test_finished(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("finish"))
    assert w.wait() == 0, w.stderr
    w.wait_line("last checkpoint at step 5")
    assert kinds(ckpt) == ["wrapper_start", "step_end", "finished"]


@pytest.mark.parametrize(
    ("mode", "code", "text"),
    [
        ("crash", 3, "exit status 3"),
        ("crash-signal", 128 + 9, "killed by signal SIGKILL"),
        ("no-finish", 1, "without reporting finished"),
    ],
)
def test_crashed(tmp_path, mode, code, text):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app(mode))
    assert w.wait() == code, w.stderr
    assert text in w.wait_line("step crashed")
    assert kinds(ckpt) == ["wrapper_start", "step_end", "crashed"]
    assert events(ckpt)[-1]["wrapper_exit"] == code


def test_stale_status_from_an_earlier_attempt_is_ignored(tmp_path):
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    write_status(ckpt, RunStatus(state=FINISHED, attempt="local.0.earlier", step=99))
    w = Wrapped(ckpt, app("crash"))
    assert w.wait() == 3, w.stderr


def test_signal_before_running_is_held_then_delivered(tmp_path):
    """The app needs 1.5 s to install its handler; an early USR1 must not kill it."""
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop", "--handler-delay", "1.5"))
    w.wait_line("started step")
    w.send(signal.SIGUSR1)
    assert "held: the application has not reported running" in w.wait_line("signal USR1 received")
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR1"]
    line = w.wait_line("application reported running")
    assert "USR1 held for" in line and "forwarded to step" in line
    assert kinds(ckpt) == ["wrapper_start", "signal", "signal_forwarded", "step_end", "stopped"]
    ev = events(ckpt)
    assert ev[1]["held"] is True and ev[1]["forwarded"] is False
    assert ev[2]["held_for"] > 0.5


def test_signal_during_wrapper_start_up_is_kept(tmp_path):
    """USR1 sent while the wrapper is still importing: early_signals records it."""
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("stop", "--handler-delay", "1"))
    deadline = time.monotonic() + 20
    while not caught(w.proc.pid, signal.SIGUSR1):
        assert time.monotonic() < deadline and w.proc.poll() is None
        time.sleep(0.001)
    early = not caught(w.proc.pid, signal.SIGCHLD)  # the wrapper's own handlers not yet in
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR1"]
    if early:
        assert "signal USR1 received during start-up" in w.wait_line("signal USR1 received")


def test_duplicate_signals_are_forwarded_once_and_requeue_once(tmp_path):
    ckpt = tmp_path / "ck"
    calls = tmp_path / "calls"
    scontrol = fake(tmp_path, "scontrol", f'echo "$@" >> {calls}')
    env = clean_env(SLURM_JOB_ID="4242", SLURM_RESTART_COUNT="2", HPCCKPT_SCONTROL=scontrol)
    w = Wrapped(ckpt, app("stop", "--ckpt-time", "1.5"), env=env)
    wait_state(ckpt, RUNNING)
    w.send(signal.SIGUSR1)
    w.wait_line("forwarded to step")
    w.send(signal.SIGUSR1)
    w.wait_line("already under way")
    w.send(signal.SIGTERM)
    assert w.wait() == 0, w.stderr
    assert received(ckpt) == ["SIGUSR1"]
    # at the start the wrapper asks whether the job may be requeued; after a TERM whether
    # it was cancelled; then it requeues once
    assert calls.read_text().splitlines() == ["show job -o 4242"] * 2 + ["requeue 4242"]
    assert kinds(ckpt) == ["wrapper_start", "signal", "signal", "signal", "step_end", "requeue"]
    ev = events(ckpt)
    assert [e.get("forwarded") for e in ev[1:4]] == [True, False, False]
    assert ev[0]["attempt"].startswith("4242.2.")
    assert all(e["job_id"] == "4242" and e["restart_count"] == 2 for e in ev)
    w.wait_line("job 4242 requeued")


def test_app_that_ignores_the_signal_is_left_alone(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("ignore", "--steps", "60", "--step-time", "0.02"))
    wait_state(ckpt, RUNNING)
    w.send(signal.SIGUSR1)
    assert w.wait() == 0, w.stderr
    w.wait_line("forwarded to step")
    w.wait_line("application finished")


def test_third_interrupt_takes_the_step_down(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("ignore", "--steps", "100000"))
    wait_state(ckpt, RUNNING)
    for _ in range(3):
        w.send(signal.SIGINT)
        time.sleep(0.1)
    assert w.wait() == 128 + signal.SIGTERM, w.stderr
    w.wait_line("interrupt #3: sending TERM to the step")


def test_step_environment_and_directory(tmp_path):
    (tmp_path / "work").mkdir()
    w = Wrapped("ck/nested", app("env"), cwd=tmp_path / "work")
    assert w.wait() == 0, w.stderr
    ckpt = tmp_path / "work" / "ck" / "nested"
    assert ckpt.stat().st_mode & 0o777 == 0o700
    env = json.loads((ckpt / "env.json").read_text())
    assert env["HPCCKPT_DIR"] == str(ckpt)
    assert env["HPCCKPT_ATTEMPT"] == events(ckpt)[0]["attempt"]
    assert env["HPCCKPT_ATTEMPT"].startswith("local.0.")
    assert env["HPCCKPT_SIGNAL"] == "USR1"
    assert env["OMPI_MCA_io"] is None  # the store does no MPI-IO: no component is imposed


def test_users_mpi_io_choice_is_kept_and_dir_from_environment(tmp_path):
    ckpt = tmp_path / "ck"
    env = clean_env(OMPI_MCA_io="ompio", HPCCKPT_DIR=str(ckpt))
    w = Wrapped(None, app("env"), env=env)
    assert w.wait() == 0, w.stderr
    assert json.loads((ckpt / "env.json").read_text())["OMPI_MCA_io"] == "ompio"


def test_attempt_tokens_are_fresh(tmp_path):
    ckpt = tmp_path / "ck"
    for _ in range(2):
        assert Wrapped(ckpt, app("finish")).wait() == 0
    starts = [e["attempt"] for e in events(ckpt) if e["event"] == "wrapper_start"]
    assert len(set(starts)) == 2


def test_no_checkpoint_directory_is_a_usage_error(tmp_path):
    w = Wrapped(None, app("finish"))
    assert w.wait() == 2
    assert "--ckpt-dir" in w.stderr and "HPCCKPT_DIR" in w.stderr


# -- the checkpoint directory: what is wrong with it, and the fix ----------------------------


def test_a_checkpoint_directory_that_is_a_file(tmp_path):
    (tmp_path / "ck").write_text("not a directory\n")
    w = Wrapped(tmp_path / "ck", app("finish"))
    assert w.wait() == 2
    line = w.wait_line("error:")
    assert line == (
        f"hpcckpt: error: the checkpoint directory {tmp_path / 'ck'} exists and is not a "
        "directory (it is a regular file): choose another --ckpt-dir, or move the file away"
    ), line
    assert "Errno" not in w.stderr


def test_a_checkpoint_directory_that_cannot_be_written(tmp_path):
    """Root bypasses the mode bits: the wrapper runs without CAP_DAC_OVERRIDE, as a user
    would, in a directory another user owns (mode 0755)."""
    ck = tmp_path / "ck"
    ck.mkdir(mode=0o755)
    os.chown(ck, 1000, 1000)
    argv = [sys.executable, "-m", "hpcckpt.cli.entry", "run", "--ckpt-dir", str(ck), "--"]
    r = subprocess.run(
        [*as_a_user(), *argv, *app("finish")],
        cwd=REPO, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        f"hpcckpt: error: the checkpoint directory {ck} exists but cannot be written by user "
        f"{who(os.geteuid())}: Permission denied (mode 0755, owner {who(1000)}, group "
        f"{who(1000, 'gid')}). Choose a writable --ckpt-dir, or fix its permissions (as its "
        f"owner: chmod u+rwx {ck})\n"
    ), r.stderr
    assert not (ck / "events.jsonl").exists()


def test_an_immutable_checkpoint_directory(tmp_path):
    """Operation not permitted even for root (chattr +i): said so, with the fix."""
    ck = tmp_path / "ck"
    ck.mkdir()
    with immutable(ck):
        w = Wrapped(ck, app("finish"))
        assert w.wait() == 2
    line = w.wait_line("error:")
    assert line.startswith(
        f"hpcckpt: error: the checkpoint directory {ck} exists but cannot be written by user "
    ), line
    assert f"Operation not permitted (mode 0755, owner {who(0)}, group {who(0, 'gid')})" in line
    assert f"it may be immutable (lsattr -d {ck} shows an i; chattr -i {ck} undoes it)" in line
    assert line.endswith("Choose a writable --ckpt-dir, or have it fixed"), line


def test_command_not_found(tmp_path):
    w = Wrapped(tmp_path / "ck", [str(tmp_path / "no-such-launcher")])
    assert w.wait() == 127
    w.wait_line("command not found")


def test_no_orphan_when_the_wrapper_is_killed(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("orphan-check"))
    wait_state(ckpt, RUNNING)
    w.proc.kill()
    w.wait()
    deadline = time.monotonic() + 10
    while not (ckpt / "signals.rank0.json").exists():
        assert time.monotonic() < deadline, "the step did not hear of the wrapper's death"
        time.sleep(0.02)
    assert received(ckpt) == ["SIGTERM"]


# -- requeue decisions (SLURM_JOB_ID set, scontrol faked) ----------------------------------


def stop_under_fake_slurm(tmp_path: Path, scontrol: str, *options: str) -> Wrapped:
    ckpt = tmp_path / "ck"
    env = clean_env(SLURM_JOB_ID="4242", HPCCKPT_SCONTROL=scontrol)
    w = Wrapped(ckpt, app("stop"), *options, env=env)
    wait_state(ckpt, RUNNING, wrapper=w)
    w.send(signal.SIGUSR1)
    return w


def test_requeue_with_missing_scontrol_fails_clearly(tmp_path):
    w = stop_under_fake_slurm(tmp_path, str(tmp_path / "nonexistent" / "scontrol"))
    assert w.wait() == config.EXIT_CONTINUE_FAILED, w.stderr
    assert "not found" in w.wait_line("requeue failed")
    w.wait_line("resubmit the same batch script")
    assert kinds(tmp_path / "ck")[-2:] == ["requeue", "requeue_failed"]


def test_requeue_with_failing_scontrol(tmp_path):
    scontrol = fake(tmp_path, "scontrol", 'echo "Job is not requeueable" >&2; exit 1')
    w = stop_under_fake_slurm(tmp_path, scontrol)
    assert w.wait() == config.EXIT_CONTINUE_FAILED, w.stderr
    assert "Job is not requeueable" in w.wait_line("requeue failed")


def test_requeue_with_hanging_scontrol_times_out(tmp_path):
    scontrol = fake(tmp_path, "scontrol", "sleep 60")
    w = stop_under_fake_slurm(tmp_path, scontrol, "--requeue-timeout", "1")
    t0 = time.monotonic()
    assert w.wait() == config.EXIT_CONTINUE_FAILED, w.stderr
    assert time.monotonic() - t0 < 15
    assert "did not finish within 1 s" in w.wait_line("requeue failed")


def test_no_requeue_inside_slurm(tmp_path):
    calls = tmp_path / "calls"
    scontrol = fake(tmp_path, "scontrol", f"echo called >> {calls}")
    w = stop_under_fake_slurm(tmp_path, scontrol, "--no-requeue")
    assert w.wait() == 0, w.stderr
    assert not calls.exists()
    w.wait_line("requeue disabled (--no-requeue)")


def test_srun_subcommand_passes_arguments_untouched_after_kill_on_bad_exit(tmp_path):
    ckpt = tmp_path / "ck"
    args = tmp_path / "srun-args"
    # A stand-in srun: record the arguments, drop the srun options, run the command.
    srun = fake(
        tmp_path,
        "srun",
        f'printf "%s\\n" "$@" > {args}\nshift 4\nexec "$@"',
    )
    env = clean_env(HPCCKPT_SRUN=srun, SLURM_JOB_ID="4243")  # srun needs an allocation
    cmd = ["--mpi=pmix", "-n", "1", *app("finish")]
    w = Wrapped(ckpt, cmd, "--no-requeue", env=env, subcommand="srun")
    assert w.wait() == 0, w.stderr
    assert args.read_text().splitlines()[:3] == ["--kill-on-bad-exit=1", "--mpi=pmix", "-n"]


# -- mpirun as the launcher ----------------------------------------------------------------


@pytest.mark.mpi
def test_mpirun_two_ranks_both_get_the_signal(tmp_path):
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun not found: install openmpi-bin (make setup does)")
    ckpt = tmp_path / "ck"
    env = clean_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["mpirun", "-n", "2", "--oversubscribe", *app("stop")]
    w = Wrapped(ckpt, cmd, env=env)
    wait_state(ckpt, RUNNING, timeout=60)
    w.send(signal.SIGTERM)
    assert w.wait(timeout=120) == 0, w.stderr
    assert received(ckpt, 0) == ["SIGUSR1"]
    assert received(ckpt, 1) == ["SIGUSR1"]
    assert read_status(ckpt).state == STOPPED


# -- how much the job log says ---------------------------------------------------------------


def test_quiet_says_nothing_on_success_and_tells_the_step(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("env"), "--quiet")
    assert w.wait() == 0, w.stderr
    assert not [line for line in w.lines if line.startswith("hpcckpt:")], w.lines
    assert json.loads((ckpt / "env.json").read_text())["HPCCKPT_LOG_LEVEL"] == "quiet"


def test_quiet_still_reports_a_crash(tmp_path):
    w = Wrapped(tmp_path / "ck", app("crash"), "--quiet")
    assert w.wait() == 3
    assert any(line.startswith("hpcckpt: step crashed") for line in w.lines), w.lines


def test_verbose_shows_the_step_environment(tmp_path):
    ckpt = tmp_path / "ck"
    w = Wrapped(ckpt, app("env"), "--verbose")
    assert w.wait() == 0, w.stderr
    env_line = [line for line in w.lines if "step environment:" in line]
    assert env_line and "HPCCKPT_LOG_LEVEL=verbose" in env_line[0], w.lines
    assert json.loads((ckpt / "env.json").read_text())["HPCCKPT_LOG_LEVEL"] == "verbose"
    normal = Wrapped(tmp_path / "ck2", app("env"))
    assert normal.wait() == 0
    assert not [line for line in normal.lines if "step environment:" in line]
    assert len(normal.lines) < len(w.lines)
