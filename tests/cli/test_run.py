"""``hpcckpt run`` / ``hpcckpt srun`` (hpcckpt/cli/run.py): what their command line refuses
before any step starts, how it says what to type instead, and what it exports to the step
(the mirror: ``--mirror``, ``--mirror-wait``, ``HPCCKPT_MIRROR``)."""

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


def _step_sees_mirror(tmp_path: Path, *options: str, **environ: str) -> str:
    """What the step of ``hpcckpt run OPTIONS`` finds in HPCCKPT_MIRROR and _WAIT."""
    seen = tmp_path / "seen"
    show = f'printf "%s|%s" "${{HPCCKPT_MIRROR-unset}}" "${{HPCCKPT_MIRROR_WAIT-unset}}" > {seen}'
    argv = [sys.executable, "-m", "hpcckpt.cli.entry", "run", "--ckpt-dir", str(tmp_path / "ck")]
    env = clean_env(**environ)
    subprocess.run([*argv, *options, "--", "sh", "-c", show], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=60)  # fmt: skip
    return seen.read_text()


def test_mirror_and_its_wait_are_exported_to_the_step(tmp_path):
    options = ("--mirror", "s3://bucket/run", "--mirror-wait", "7")
    assert _step_sees_mirror(tmp_path, *options) == "s3://bucket/run|7.0"


def test_the_mirror_comes_from_hpcckpt_mirror_and_the_option_wins(tmp_path):
    assert _step_sees_mirror(tmp_path, HPCCKPT_MIRROR="/project/m") == "/project/m|unset"
    seen = _step_sees_mirror(tmp_path, "--mirror", "/project/b", HPCCKPT_MIRROR="/project/a")
    assert seen == "/project/b|unset"
    assert _step_sees_mirror(tmp_path) == "unset|unset"


@pytest.mark.parametrize("command", ["run", "srun"])
def test_an_empty_mirror_is_a_usage_error(tmp_path, command):
    code, out = invoke(command, "--ckpt-dir", str(tmp_path / "ck"), "--mirror", " ", "--", "a")
    assert code == 2 and out.endswith(
        "Error: --mirror is empty: give a directory or s3://bucket/prefix\n"
    ), out
    code, out = invoke(
        command, "--ckpt-dir", str(tmp_path / "ck"), "--mirror-wait", "-1", "--", "a"
    )
    assert code == 2 and "Invalid value for '--mirror-wait'" in out, out


def test_help_names_the_mirror_and_its_environment_variable():
    code, out = invoke("srun", "--help")
    assert code == 0 and "--mirror URL" in out and "HPCCKPT_MIRROR" in out, out
