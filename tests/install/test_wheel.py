"""hpcckpt as a user installs it: the sdist and the wheel of ``python -m build``, the wheel in
a plain venv from binary wheels only (PyPI's serial h5py, which bundles HDF5 2.x; mpi4py's
binary wheel on Debian's Open MPI), its console script, and examples/heat2d.py crashed
and resumed under mpirun from that venv, bit-identical to an uninterrupted run."""

from __future__ import annotations

import email.parser
import json
import re
import tarfile
import zipfile

import numpy as np
import pytest

from hpcckpt._version import __version__
from tests.install.conftest import ROOT, WheelVenv
from tests.mpi_helpers import heat2d_crash_and_resume, heat2d_reference, mpirun, rank_reports

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

APP = ROOT / "tests" / "install" / "apps" / "save_app.py"
MODULES = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "hpcckpt").rglob("*.py"))
TEMPLATES = sorted(p.name for p in (ROOT / "sbatch-templates").glob("*.sbatch"))


def test_the_wheel_holds_the_package_its_script_templates_and_dependencies(wheel_venv):
    with zipfile.ZipFile(wheel_venv.wheel) as z:
        names = set(z.namelist())
        info = f"hpcckpt-{__version__}.dist-info"
        meta = email.parser.Parser().parsestr(z.read(f"{info}/METADATA").decode())
        scripts = z.read(f"{info}/entry_points.txt").decode()
    assert wheel_venv.wheel.name == f"hpcckpt-{__version__}-py3-none-any.whl"
    assert set(MODULES) <= names, sorted(set(MODULES) - names)
    data = f"hpcckpt-{__version__}.data/data/share/hpcckpt/sbatch-templates"
    assert {f"{data}/{t}" for t in TEMPLATES} <= names
    assert "hpcckpt = hpcckpt.cli.entry:main" in scripts

    def name(requirement: str) -> str:  # "pytest<9.2,>=7; extra == 'test'" -> "pytest"
        return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0]

    requires = meta.get_all("Requires-Dist")
    required = {name(r) for r in requires if "extra ==" not in r}
    assert {"numpy", "mpi4py", "h5py", "click", "xxhash"} <= required
    optional = {name(r) for r in requires if "extra ==" in r}
    assert {"torch", "torchdata", "matplotlib", "pytest", "boto3", "zstandard"} <= optional
    assert set(meta.get_all("Provides-Extra")) == {"torch", "plot", "test", "s3", "compress"}


def test_the_sdist_holds_what_the_wheel_needs_and_no_tests(wheel_venv):
    top = f"hpcckpt-{__version__}/"
    with tarfile.open(wheel_venv.sdist) as tar:
        names = {n.removeprefix(top) for n in tar.getnames()}
    needed = {"setup.cfg", "pyproject.toml", "README.md", "MANIFEST.in", "CHANGELOG.md"}
    needed |= {f"sbatch-templates/{t}" for t in TEMPLATES} | {"contrib/lmod/hpcckpt.lua"}
    assert needed | set(MODULES) <= names, sorted((needed | set(MODULES)) - names)
    assert not [n for n in names if n.startswith("tests/")]


def test_the_venv_runs_the_installed_hpcckpt_on_the_serial_h5py_wheel(wheel_venv, tmp_path):
    cfg = (wheel_venv.root / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    probe = wheel_venv.run(
        "-c",
        "import json, h5py, mpi4py, hpcckpt; print(json.dumps({'hpcckpt': hpcckpt.__file__,"
        " 'mpi': h5py.get_config().mpi, 'hdf5': h5py.version.hdf5_version}))",
        cwd=tmp_path,
    )
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    assert got["hpcckpt"].startswith(str(wheel_venv.root)), got
    assert got["mpi"] is False, "the wheel venv must have PyPI's serial h5py, not an MPI build"
    version = wheel_venv.hpcckpt("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"hpcckpt, version {__version__}"


def test_submit_finds_the_templates_the_wheel_installed(wheel_venv, tmp_path):
    r = wheel_venv.hpcckpt(
        "submit", "requeue", "--dry-run", "--time", "01:00:00", "--ckpt-dir", tmp_path / "ck",
        "--script", tmp_path / "job.sbatch", "--", "python", "app.py",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "#SBATCH --time=01:00:00" in r.stdout and "APP=(python app.py)" in r.stdout


def test_ranks_import_the_installed_package(wheel_venv: WheelVenv, tmp_path):
    r = mpirun(2, [APP, tmp_path / "ck"], python=wheel_venv.python)
    assert r.returncode == 0, r.stderr
    for rep in rank_reports(r.stdout, 2):
        assert rep["hpcckpt"].startswith(str(wheel_venv.root)), rep
        assert rep["h5py_mpi"] is False and rep["saved"] == 3, rep
        assert "Open MPI" in rep["mpi"], rep  # mpi4py's binary wheel found Debian's libmpi


def test_heat2d_crashed_and_resumed_from_the_wheel_is_bit_identical(wheel_venv, tmp_path):
    ref = heat2d_reference(2, tmp_path, python=wheel_venv.python)
    got = heat2d_crash_and_resume(2, tmp_path, python=wheel_venv.python)
    assert np.array_equal(got, ref) and got.tobytes() == ref.tobytes()
