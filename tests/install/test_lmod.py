"""contrib/lmod/hpcckpt.lua loaded by Lmod, as a site would: pointed at the wheel venv, it
puts ``hpcckpt`` and that venv's python first on PATH, changes nothing else but Lmod's own
bookkeeping, and an MPI save runs from it (docs/site-install.md)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hpcckpt._version import __version__
from tests.install.conftest import ROOT
from tests.mpi_helpers import rank_reports

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

MODULE = ROOT / "contrib" / "lmod" / "hpcckpt.lua"
APP = ROOT / "tests" / "install" / "apps" / "save_app.py"
#: Debian's lmod package (scripts/setup.sh installs it).
LMOD_INIT = Path("/usr/share/lmod/lmod/init/bash")
#: What Lmod itself keeps in the environment of a shell with modules loaded.
LMOD_OWN = re.compile(r"^(_?LMOD|__LMOD|_ModuleTable|LOADEDMODULES$|_LMFILES_$|MODULEPATH)")


def environment(text: str) -> dict[str, str]:
    """``env -0`` output as a dict."""
    return dict(item.split("=", 1) for item in text.split("\0") if "=" in item)


def test_module_load_puts_the_venv_first_and_an_mpi_save_runs(wheel_venv, tmp_path):
    if not LMOD_INIT.exists():
        pytest.fail(f"{LMOD_INIT} not found: install Debian's lmod (make setup does)")
    text, count = re.subn(
        r'^local root = "[^"]*"',
        f'local root = "{wheel_venv.root}"',
        MODULE.read_text(),
        flags=re.M,
    )
    assert count == 1, f'{MODULE} has no line local root = "..." to point at a venv'
    modules = tmp_path / "modulefiles"
    (modules / "hpcckpt").mkdir(parents=True)
    (modules / "hpcckpt" / f"{__version__}.lua").write_text(text)
    ck, before, after = tmp_path / "ck", tmp_path / "env-before", tmp_path / "env-after"
    script = f"""
set -euo pipefail
source {LMOD_INIT}
module use {shlex.quote(str(modules))}
env -0 > {before}
module load hpcckpt
env -0 > {after}
module --terse list 2>&1
echo "hpcckpt=$(command -v hpcckpt) python=$(command -v python)"
hpcckpt --version
mpirun -n 2 --oversubscribe python -m mpi4py {APP} {ck}
hpcckpt verify {ck}
"""
    env = {
        "HOME": str(tmp_path),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    }
    proc = subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert f"hpcckpt/{__version__}" in out
    bin_dir = wheel_venv.root / "bin"
    assert f"hpcckpt={bin_dir}/hpcckpt python={bin_dir}/python" in out
    assert f"hpcckpt, version {__version__}" in out
    for rep in rank_reports(out, 2):
        assert rep["hpcckpt"].startswith(str(wheel_venv.root)) and rep["saved"] == 3, rep

    old, new = environment(before.read_text()), environment(after.read_text())
    changed = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    assert "PATH" in changed and new["PATH"] == f"{bin_dir}:{old['PATH']}"
    surprising = sorted(k for k in changed - {"PATH"} if not LMOD_OWN.match(k))
    assert not surprising, f"the module also sets {surprising}"
