"""``pip install 'hpcckpt[torch]'`` for a torch user without MPI: the wheel with its torch
extra in a venv of its own (binary wheels only), where no MPI library can load
(``MPI4PY_LIBMPI`` names a library that does not exist, ``mpirun`` is off ``PATH``):
``import hpcckpt`` works, and two ranks started by torch.multiprocessing over gloo save
and restore numpy arrays and a torch model through ``Checkpointer(directory)``.

mpi4py stays a dependency (the HPC default is unchanged; its binary wheel installs
without an MPI library, and only ``import mpi4py.MPI`` needs one), and hpcckpt imports
it only in ``store/comm/mpi.py``, when MPI is the transport.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.install.conftest import PIP_INSTALL, ROOT, WheelVenv

pytestmark = [pytest.mark.slow]

APP = ROOT / "tests" / "store" / "comm" / "apps" / "torch_ckpt_app.py"


def no_mpi_env(base: Path, python: Path) -> dict[str, str]:
    """The environment without an MPI library or launcher, and without the checkout:
    ``PATH`` is the venv's ``bin`` alone (``mpirun`` lies in ``/usr/bin`` here)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX_"))}
    env.pop("PYTHONPATH", None)
    env.pop("LD_LIBRARY_PATH", None)
    env["MPI4PY_LIBMPI"] = str(base / "no-mpi" / "libmpi.so")  # mpi4py finds no MPI
    env["PATH"] = str(python.parent)
    return env


def pins() -> list[str]:
    """torch and torchdata as in the main venv (make setup's CPU build): an open range
    would pull torch's multi-GB CUDA build from PyPI."""
    import torch
    import torchdata

    return [
        f"torch=={torch.__version__.split('+')[0]}",
        f"torchdata=={torchdata.__version__.split('+')[0]}",
    ]


@pytest.fixture(scope="module")
def torch_venv(wheel_venv: WheelVenv, tmp_path_factory) -> Iterator[Path]:
    """A venv with ``hpcckpt[torch]`` from the checkout's wheel: its python."""
    venv = tmp_path_factory.mktemp("torch-venv") / "venv"
    for args, what in (
        ([sys.executable, "-m", "venv", venv], "python -m venv"),
        (
            [venv / "bin" / "python", *PIP_INSTALL, f"{wheel_venv.wheel}[torch]", *pins()],
            "pip install 'hpcckpt[torch]'",
        ),
    ):
        proc = subprocess.run(list(map(str, args)), capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.fail(f"{what} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    yield venv / "bin" / "python"


def run(
    python: Path, env: dict[str, str], cwd: Path, *args: object
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``cwd``, outside the checkout (``-c`` puts it on the path)."""
    return subprocess.run(
        [str(python), *map(str, args)],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_torch_user_without_mpi_saves_and_restores_over_gloo(torch_venv, tmp_path):
    env = no_mpi_env(tmp_path, torch_venv)
    assert shutil.which("mpirun", path=env["PATH"]) is None
    probe = run(torch_venv, env, tmp_path, "-c", "import mpi4py.MPI")
    assert probe.returncode != 0 and "cannot load MPI library" in probe.stderr, probe.stderr
    where = run(
        torch_venv, env, tmp_path, "-c", "import hpcckpt, torch, sys; print(hpcckpt.__file__)"
    )
    assert where.returncode == 0, where.stderr
    assert str(torch_venv.parents[1]) in where.stdout  # the venv's hpcckpt, not the checkout's
    # no MPI and no process group: the error names both ways to get one
    alone = run(
        torch_venv,
        env,
        tmp_path,
        "-c",
        f"import hpcckpt; hpcckpt.Checkpointer({str(tmp_path / 'x')!r})",
    )
    assert alone.returncode != 0
    assert "torch.distributed.init_process_group" in alone.stderr, alone.stderr[-2000:]
    for mode in ("save", "restore"):
        out = tmp_path / f"{mode}.out"
        spec = {"mode": mode, "n": 2, "dir": str(tmp_path / "ck"), "steps": [0, 1, 2]}
        spec["out"] = str(out)
        (tmp_path / f"{mode}.json").write_text(json.dumps(spec))
        proc = run(torch_venv, env, tmp_path, APP, tmp_path / f"{mode}.json")
        assert proc.returncode == 0, proc.stderr[-4000:]
        results = json.loads(out.read_text())
        assert [(r["error"], r["comm"], r["mpi_loaded"]) for r in results] == [
            (None, "TorchComm", False)
        ] * 2
    assert [(r["step"], r["same_arrays"], r["same_model"]) for r in results] == [
        (2, True, True)
    ] * 2
