"""The examples' batch scripts (examples/*.sbatch) run from any directory: Slurm runs a
copy of the script in the directory it was submitted from, so each finds its program
through the path sbatch recorded (``Command=`` of ``scontrol show job``). Run here with
bash and stand-ins for scontrol and hpcckpt, from a directory that is not the checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = sorted(EXAMPLES.glob("*.sbatch"))


def stand_ins(tmp_path: Path, scontrol_body: str) -> Path:
    """A bin/ with a scontrol running ``scontrol_body`` and an hpcckpt printing its words."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("scontrol", scontrol_body), ("hpcckpt", 'printf "%s\\n" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def run_job(script: Path, tmp_path: Path, scontrol_body: str) -> list[str]:
    """``script`` run as Slurm runs a batch job: a copy of it, in the submit directory."""
    submit_dir = tmp_path / "elsewhere"
    submit_dir.mkdir()
    copy = tmp_path / "slurm_script"  # Slurm's spool copy: "$0" is not the original
    copy.write_text(script.read_text())
    env = {
        "PATH": f"{stand_ins(tmp_path, scontrol_body)}:/usr/bin:/bin",
        "SLURM_JOB_ID": "4711",
        "SLURM_SUBMIT_DIR": str(submit_dir),
    }
    r = subprocess.run(
        ["bash", str(copy), "--steps", "5"],
        cwd=submit_dir, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout.splitlines()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_an_example_finds_its_program_next_to_itself(script, tmp_path):
    show = f'echo "   Command={script} --steps 5"; echo "   WorkDir={tmp_path}/elsewhere"'
    words = run_job(script, tmp_path, show)
    program = EXAMPLES / script.with_suffix(".py").name
    assert program.is_file()
    assert words[words.index("python") + 1] == str(program), words
    assert words[-2:] == ["--steps", "5"], words
    assert words[words.index("--ckpt-dir") + 1].startswith(f"{tmp_path}/elsewhere/ckpt-"), words


def test_without_scontrol_an_example_looks_in_the_submit_directory(tmp_path):
    words = run_job(EXAMPLES / "heat2d.sbatch", tmp_path, "exit 1")
    assert words[words.index("python") + 1] == f"{tmp_path}/elsewhere/examples/heat2d.py", words
