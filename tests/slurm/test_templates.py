"""Batch-script templates (hpcckpt/slurm/templates.py): rendering rules, and golden files
of every rendered template.

The goldens in tests/slurm/golden/ are what `hpcckpt submit TEMPLATE --dry-run` prints for
the options in GOLDEN_ARGS. After changing a template on purpose, regenerate them with

    HPCCKPT_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/slurm/test_templates.py

and review the diff (git diff tests/slurm/golden) before committing.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hpcckpt.cli.main import cli
from hpcckpt.slurm import templates

GOLDEN = Path(__file__).resolve().parent / "golden"
NAMES = ["chain", "mpirun", "python-api", "requeue", "restart-files", "srun-torch", "torchrun"]
GOLDEN_ARGS = [
    "--time", "00:30:00", "--ntasks", "8", "--nodes", "2", "--partition", "batch",
    "--job-name", "golden", "--ckpt-dir", "/scratch/me/run 1", "--signal", "USR2@180",
    "--venv", "/opt/venvs/hpc ckpt", "--", "python", "app.py", "--input", "it's here.h5",
]  # fmt: skip
#: Every batch script a user is given: the templates and the examples'.
SCRIPTS = sorted(templates.templates_dir().glob("*.sbatch")) + sorted(
    (Path(__file__).resolve().parents[2] / "examples").glob("*.sbatch")
)
#: The line that marks where a batch script loads the user's environment.
ENV_MARK = re.compile(r"^# -+ load your environment \(modules, venv\) -*$")


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


# -- loading the user's environment ------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_batch_script_has_the_marked_environment_lines(script):
    """Marked, before the first command that needs the environment, after every #SBATCH
    line (sbatch reads no #SBATCH line after the first command): the venv, if given, is
    activated."""
    lines = script.read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if ENV_MARK.match(line)]
    assert len(marks) == 1, f"{script}: no (or more than one) '# ---- load your environment' line"
    at = marks[0]
    assert not [ln for ln in lines[at:] if ln.startswith("#SBATCH")], script
    block = lines[at : at + 12]
    assert 'VENV="${HPCCKPT_VENV:-}"' in block, block
    assert 'if [ -n "$VENV" ]; then source "$VENV/bin/activate"; fi' in block, block
    assert any(ln.startswith("# module load ") for ln in block), block
    first_command = next(i for i, ln in enumerate(lines) if ln.startswith(("exec ", "export ")))
    assert at < first_command, script


def fake_venv(tmp_path: Path) -> Path:
    """A venv whose activate puts a stand-in hpcckpt first on PATH; it prints its arguments."""
    venv = tmp_path / "venv dir"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text(f'PATH="{venv}/bin:$PATH"\n')
    hpcckpt = venv / "bin" / "hpcckpt"
    hpcckpt.write_text('#!/bin/sh\necho "hpcckpt $*"\n')
    hpcckpt.chmod(0o755)
    return venv


def job_like_export_none(script: Path, tmp_path: Path, **extra: str):
    """Run ``script`` as sbatch --export=NONE starts it: Slurm's variables, a bare PATH."""
    env = {
        "PATH": "/usr/bin:/bin",
        "HOME": str(tmp_path),
        "SLURM_JOB_ID": "4711",
        "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_NTASKS": "2",
        **extra,
    }
    return subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("name", NAMES)
def test_a_job_without_the_submitters_environment_finds_hpcckpt_through_the_venv(name, tmp_path):
    venv = fake_venv(tmp_path)
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render_cli(name, "--venv", str(venv), "--ckpt-dir", str(tmp_path / "ck")))
    r = job_like_export_none(script, tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].startswith("hpcckpt "), r.stdout
    # without it, the job ends as users saw it: the wrapper is not found
    plain = tmp_path / f"plain-{name}.sbatch"
    plain.write_text(render_cli(name))
    r = job_like_export_none(plain, tmp_path)
    assert r.returncode == 127 and "hpcckpt: not found" in r.stderr, r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_warning_signal_before_exec_does_not_kill_the_batch_shell(script, tmp_path):
    """Slurm can send the --signal warning as a run starts (seen right after a requeue):
    every batch script ignores USR1/USR2 until it execs the wrapper, which takes them
    over; without that, the shell dies of it and the job ends FAILED. Here the signals
    arrive while the script loads its environment."""
    venv = fake_venv(tmp_path)
    activate = venv / "bin" / "activate"
    activate.write_text("kill -USR1 $$; kill -USR2 $$\n" + activate.read_text())
    (venv / "bin" / "scontrol").write_text("#!/bin/sh\n")  # the examples ask for Command=
    (venv / "bin" / "scontrol").chmod(0o755)
    r = job_like_export_none(script, tmp_path, HPCCKPT_VENV=str(venv))
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.splitlines()[-1].startswith("hpcckpt "), r.stdout


def test_submit_fills_in_the_venv_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = render_cli("requeue", "--venv", "venvs/my venv")
    assert f"VENV='{tmp_path}/venvs/my venv'" in text.splitlines()


@pytest.mark.parametrize(
    "name", ["chain", "mpirun", "python-api", "requeue", "srun-torch", "torchrun"]
)
def test_python_templates_offer_a_mirror_on_a_commented_line(name):
    """The templates of Python applications show the mirror (docs/tiers.md) as a line to
    uncomment; uncommented, it exports HPCCKPT_MIRROR, which the wrapper passes on."""
    lines = templates.find(name).read_text().splitlines()
    (line,) = [x for x in lines if x.startswith("# export HPCCKPT_MIRROR=")]
    show = line[2:].split("  #")[0] + '; printf %s "$HPCCKPT_MIRROR"'
    env = {"USER": "me", "PATH": os.environ["PATH"]}
    r = subprocess.run(["bash", "-euc", show], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "s3://my-bucket/me/run1", r.stderr
