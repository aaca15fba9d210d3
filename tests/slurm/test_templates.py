"""Batch-script templates (hpcckpt/slurm/templates.py): rendering rules, and golden files
of every rendered template.

The goldens in tests/slurm/golden/ are what `hpcckpt submit TEMPLATE --dry-run` prints for
the options in GOLDEN_ARGS. After changing a template on purpose, regenerate them with

    HPCCKPT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/slurm/test_templates.py

and review the diff (git diff tests/slurm/golden) before committing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.main import cli
from hpcckpt.slurm import templates

GOLDEN = Path(__file__).resolve().parent / "golden"
NAMES = ["chain", "mpirun", "python-api", "requeue", "restart-files"]
GOLDEN_ARGS = [
    "--time", "00:30:00", "--ntasks", "8", "--nodes", "2", "--partition", "batch",
    "--job-name", "golden", "--ckpt-dir", "/scratch/me/run 1", "--signal", "USR2@180",
    "--", "python", "app.py", "--input", "it's here.h5",
]  # fmt: skip


def render_cli(name: str, *args: str) -> str:
    result = CliRunner().invoke(cli, ["submit", name, "--dry-run", *args])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_every_template_is_listed():
    assert templates.available() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_golden(name):
    text = render_cli(name, *GOLDEN_ARGS)
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HPCCKPT_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}: run with HPCCKPT_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{name}: rendered differs from {golden}"


@pytest.mark.parametrize("name", NAMES)
def test_rendered_scripts_are_valid_bash(name):
    bash = shutil.which("bash")
    assert bash
    r = subprocess.run([bash, "-n", str(GOLDEN / f"{name}.sbatch")], capture_output=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", NAMES)
def test_template_unchanged_without_options(name):
    raw = templates.find(name).read_text()
    assert render_cli(name) == raw


def test_app_array_survives_bash(tmp_path):
    """APP=(...) with quoted words gives the exact argument list back."""
    text = templates.render(
        "APP=(x)\nprintf '%s\\n' \"${APP[@]}\"\n",
        settings={"APP": templates.bash_array(["a b", "it's", "$HOME", "--x=1"])},
    )
    script = tmp_path / "s.sh"
    script.write_text(text)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True).stdout
    assert out.splitlines() == ["a b", "it's", "$HOME", "--x=1"]


def test_render_rules():
    text = "#!/bin/bash\n#SBATCH --time=1:00\n#SBATCH --ntasks 4\nX=1\n  X=2\nexport D=a\necho\n"
    out = templates.render(
        text, sbatch={"time": "5", "ntasks": "2", "partition": "p"}, settings={"X": "9", "D": "b"}
    )
    assert out == (
        "#!/bin/bash\n#SBATCH --time=5\n#SBATCH --ntasks=2\n#SBATCH --partition=p\n"
        "X=9\n  X=2\nexport D=b\necho\n"
    )
    with pytest.raises(templates.TemplateError, match="no line for NOPE="):
        templates.render(text, settings={"NOPE": "1"})


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("USR1@120", ("B:USR1@120", "USR1")),
        ("B:usr2@90", ("B:USR2@90", "USR2")),
        ("SIGUSR2", ("B:USR2", "USR2")),
    ],  # fmt: skip
)
def test_signal_spec(spec, expected):
    assert templates.signal_spec(spec) == expected


def test_unknown_template_and_bad_set():
    r = CliRunner().invoke(cli, ["submit", "nope", "--dry-run"])
    assert r.exit_code == 2 and "choose one of chain, mpirun" in r.output
    r = CliRunner().invoke(cli, ["submit", "requeue", "--dry-run", "--set", "TYPO=1"])
    assert r.exit_code == 2 and "no line for TYPO=" in r.output


def test_submit_runs_sbatch_with_an_argument_list(tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    fake = tmp_path / "sbatch"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {calls}\nenv > {tmp_path}/env\necho 4711\n')
    fake.chmod(0o755)
    monkeypatch.setenv("HPCCKPT_SBATCH", str(fake))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(
        cli,
        [
            "submit",
            "requeue",
            "--time",
            "10",
            "--sbatch-arg",
            "--qos=long",
            "--",
            "python",
            "a b.py",
        ],  # fmt: skip
    )
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == "4711"
    script = tmp_path / "hpcckpt-requeue.sbatch"
    assert calls.read_text().splitlines() == ["--parsable", "--qos=long", str(script)]
    assert "APP=(python 'a b.py')" in script.read_text()
    assert "HPCCKPT_SBATCH_ARGS=--qos=long" in (tmp_path / "env").read_text()


def test_submit_reports_a_failing_sbatch(tmp_path, monkeypatch):
    fake = tmp_path / "sbatch"
    fake.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("HPCCKPT_SBATCH", str(fake))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(cli, ["submit", "requeue", "--", "true"])
    assert r.exit_code == 1 and "invalid partition" in r.output
