"""The installed wheel, in a venv of its own: made once per test run, shared by the tests.

``wheel_venv`` builds the sdist and, from it, the wheel (``python -m build``) out of a copy
of the checkout's files (tracked and untracked, less what git ignores), makes a plain
``python -m venv`` (no system site packages) and ``pip install``s the wheel with its
dependencies from binary wheels only: h5py's wheel brings its own serial HDF5 2.x, the
main ``.venv`` has h5py built against Debian's parallel HDF5 1.10. No torch: its install
into a fresh venv took 26-81 s here (test_hdf5_lines.py says what is checked instead).
Nothing here skips: what is missing fails.

Under pytest-xdist the workers share one venv (a file lock; the first worker builds it).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: pip's options for the wheel venv: binary wheels only, nothing built from source.
PIP_INSTALL = ["-m", "pip", "install", "-q", "--disable-pip-version-check", "--only-binary=:all:"]


@dataclass(frozen=True)
class WheelVenv:
    root: Path
    wheel: Path
    sdist: Path
    timings: dict[str, float]  # seconds: build, venv, install

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def run(self, *args: object, timeout: float = 120, **kw) -> subprocess.CompletedProcess[str]:
        """``python ARGS`` in the venv, without the checkout on its path."""
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return subprocess.run(
            [str(self.python), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            **kw,
        )

    def hpcckpt(self, *args: object, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """The venv's ``hpcckpt`` console script."""
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        return subprocess.run(
            [str(self.bin / "hpcckpt"), *map(str, args)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _check(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        pytest.fail(
            f"{what} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}",
            pytrace=False,
        )


def _sh(args: list[object], what: str, timeout: float = 600, **kw) -> float:
    """Run a command, fail the test with its output if it fails; its wall time."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            list(map(str, args)), capture_output=True, text=True, timeout=timeout, **kw
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what} took more than {timeout:.0f} s", pytrace=False)
    _check(proc, what)
    return time.monotonic() - t0


def checkout_files() -> list[str]:
    """The checkout's files as an sdist sees them: tracked and untracked, less the ignored."""
    try:
        proc = subprocess.run(
            [
                "git",
                "-C",
                str(ROOT),
                "ls-files",
                "-z",
                "--cached",
                "--others",
                "--exclude-standard",
            ],
            capture_output=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.fail("git not found: the install tests copy the checkout's files with git")
    if proc.returncode != 0:
        pytest.fail(f"git ls-files failed in {ROOT}: {proc.stderr.decode()}")
    names = [n for n in proc.stdout.decode().split("\0") if n]
    return [n for n in names if (ROOT / n).is_file()]  # not files deleted but still tracked


def _build(base: Path) -> WheelVenv:
    timings: dict[str, float] = {}
    src, dist, venv = base / "src", base / "dist", base / "venv"
    for name in checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    if subprocess.run([sys.executable, "-c", "import build"]).returncode != 0:
        pytest.fail(f"{sys.executable} lacks the package build: run make setup", pytrace=False)
    # No target: build makes the sdist, then the wheel from the unpacked sdist, so the
    # wheel proves that the sdist holds everything the package needs.
    timings["build"] = _sh(
        [sys.executable, "-m", "build", "--outdir", dist, src], "python -m build"
    )
    wheels, sdists = sorted(dist.glob("hpcckpt-*.whl")), sorted(dist.glob("hpcckpt-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    timings["venv"] = _sh([sys.executable, "-m", "venv", venv], "python -m venv")
    timings["install"] = _sh(
        [venv / "bin" / "python", *PIP_INSTALL, wheels[0]], "pip install of the wheel"
    )
    return WheelVenv(venv, wheels[0], sdists[0], timings)


_TIMINGS: dict[str, float] = {}  # this process's wheel venv, for the terminal summary


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ARG001
    if _TIMINGS:
        line = ", ".join(f"{k} {v:.1f} s" for k, v in _TIMINGS.items())
        terminalreporter.write_line(f"wheel venv (tests/install): {line}")


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory) -> Iterator[WheelVenv]:
    """A venv with the wheel of this checkout and its dependencies, from wheels only."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # this run's folder, shared by its workers
    base = base / "wheel-venv"
    base.mkdir(exist_ok=True)
    ready = base / "ready.json"
    with open(base / "lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            doc = json.loads(ready.read_text())
            venv = WheelVenv(
                Path(doc["root"]), Path(doc["wheel"]), Path(doc["sdist"]), doc["timings"]
            )
        else:
            for old in ("src", "dist", "venv"):  # an earlier worker failed half-way
                shutil.rmtree(base / old, ignore_errors=True)
            venv = _build(base)
            doc = {"root": str(venv.root), "wheel": str(venv.wheel), "sdist": str(venv.sdist)}
            ready.write_text(json.dumps({**doc, "timings": venv.timings}))
    _TIMINGS.update(venv.timings)
    yield venv
