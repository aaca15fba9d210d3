"""``hpcckpt run`` / ``hpcckpt srun`` (hpcckpt/cli/run.py): what their command line refuses
before any step starts, and how it says what to type instead."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.main import cli
from tests.job.test_wrapper import clean_env, fake

ROOT = Path(__file__).resolve().parents[2]


def invoke(*args: str) -> tuple[int, str]:
    r = CliRunner().invoke(cli, list(args), env={"SLURM_JOB_ID": "77"})
    return r.exit_code, r.output


def test_srun_options_before_the_dashes_are_explained():
    code, out = invoke("srun", "--ckpt-dir", "ck", "-n", "2", "python", "app.py")
    assert code == 2, out
    assert out.endswith(
        "Error: -n is not an option of hpcckpt srun: srun's options go after `--` "
        "(hpcckpt's before it):\n"
        "    hpcckpt srun --ckpt-dir ck -- -n 2 python app.py\n"
    ), out


@pytest.mark.parametrize(
    ("args", "suggested"),
    [
        (["--ntasks=2", "./a.out"], "hpcckpt srun -- --ntasks=2 ./a.out"),
        (["--quiet", "-N2", "-n", "4", "a b"], "hpcckpt srun --quiet -- -N2 -n 4 'a b'"),
    ],
)
def test_the_suggestion_is_the_same_command_with_the_dashes(args, suggested):
    code, out = invoke("srun", *args)
    assert code == 2 and f"\n    {suggested}\n" in out, out


def test_run_options_before_the_dashes_are_explained():
    code, out = invoke("run", "--ckpt-dir", "ck", "-n", "2", "python", "app.py")
    assert code == 2, out
    assert out.endswith(
        "Error: -n is not an option of hpcckpt run: the command goes after `--`, its "
        "launcher first (hpcckpt's options before it):\n"
        "    hpcckpt run --ckpt-dir ck -- mpirun -n 2 python app.py\n"
    ), out


def test_a_misspelt_option_of_ours_keeps_clicks_suggestion():
    code, out = invoke("srun", "--ckpt-dri", "ck", "--", "python", "app.py")
    assert code == 2 and "Error: No such option '--ckpt-dri'. (Did you mean one of:" in out, out
    assert "go after `--`" not in out, out


def test_srun_outside_a_slurm_allocation_is_refused_at_once(tmp_path):
    calls = tmp_path / "srun-calls"
    srun = fake(tmp_path, "srun", f'echo "$@" >> {calls}')
    argv = [sys.executable, "-m", "hpcckpt.cli.entry", "srun", "--ckpt-dir", str(tmp_path / "ck")]
    r = subprocess.run(
        [*argv, "--", "-n", "2", "python", "app.py"],
        cwd=ROOT, env=clean_env(HPCCKPT_SRUN=srun), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        "Error: not inside a Slurm allocation (no SLURM_JOB_ID): hpcckpt srun starts srun in "
        "a job. Submit the batch script with sbatch (or run it inside salloc); without Slurm, "
        "use mpirun:\n"
        f"    hpcckpt run --ckpt-dir {tmp_path / 'ck'} -- mpirun -n 2 python app.py\n"
    ), r.stderr
    assert not calls.exists() and not (tmp_path / "ck").exists()
