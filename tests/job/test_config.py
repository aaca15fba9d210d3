"""The wrapper's configuration (hpcckpt/job/config.py): the stop signal's spellings."""

from __future__ import annotations

import signal

import pytest

from hpcckpt.job import config


@pytest.mark.parametrize("text", ["USR1", "usr1", "SIGUSR1", "10", " SigUsr1 "])
def test_parse_signal_spellings(text):
    assert config.parse_signal(text) is signal.SIGUSR1


@pytest.mark.parametrize("text", ["KILL", "SIGSTOP", "9", "CHLD", "USR3", "", "999"])
def test_parse_signal_rejects(text):
    with pytest.raises(ValueError):
        config.parse_signal(text)


def test_srun_gets_kill_on_bad_exit_unless_the_user_chose():
    srun_command, KILL_ON_BAD_EXIT = config.srun_command, config.KILL_ON_BAD_EXIT
    args = ["--mpi=pmix", "python", "app.py"]
    assert srun_command(args, {}, kill_on_bad_exit=True) == ["srun", KILL_ON_BAD_EXIT, *args]
    assert srun_command(args, {}) == ["srun", *args]  # app mode: srun's own default
    for mine in (["-K"], ["-K0"], ["--kill-on-bad-exit=0"], ["--kill-on-bad-exit"]):
        assert srun_command([*mine, *args], {}, kill_on_bad_exit=True) == ["srun", *mine, *args]
    # An application's own -K (or one past srun's option values) is not srun's.
    for app in (["./a.out", "-K"], ["-n", "2", "./a.out", "-K0"], ["--", "./a.out", "-K"],
                ["--chdir", "-K", "./a.out"], ["-o", "-K", "./a.out"]):  # fmt: skip
        assert srun_command(app, {}, kill_on_bad_exit=True) == ["srun", KILL_ON_BAD_EXIT, *app]
    for mine in (["-lK", "./a.out"], ["-n2", "-K1", "./a.out"], ["--kill-on-bad", "./a.out"]):
        assert srun_command(mine, {}, kill_on_bad_exit=True) == ["srun", *mine]
    env = {"SLURM_KILL_BAD_EXIT": "0", "HPCCKPT_SRUN": "/opt/srun"}
    assert srun_command(args, env, kill_on_bad_exit=True) == ["/opt/srun", *args]
