"""The examples under real mpirun: crash one rank, resume, and end bit-identical to a straight run.

For every example and 2 and 3 ranks: an uninterrupted reference run, a run in which
rank 1 calls ``os._exit`` after a few checkpoints, and a resumed run that must
restore the newest checkpoint (not start over) and write exactly the reference's
result.
"""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from hpcckpt.rundir.events import read_events
from hpcckpt.rundir.status import read_status
from hpcckpt.store.file import layout
from tests.mpi_helpers import EXAMPLES, mpirun, start_mpirun, stop, wait_for

pytestmark = pytest.mark.mpi


@dataclass(frozen=True)
class Example:
    script: str
    args: list[str]  # small problem: each run takes about a second
    steps: int
    every: int
    crash_at: int
    suffix: str  # of the --out file

    @property
    def saved_before_crash(self) -> list[int]:
        """Checkpoint steps committed before the crash, newest first."""
        return list(range(self.every - 1, self.crash_at, self.every))[::-1]

    def cmd(self, ckpt: Path, *more: object) -> list[object]:
        return [
            EXAMPLES / self.script,
            *self.args,
            "--steps",
            self.steps,
            "--ckpt-dir",
            ckpt,
            *more,
        ]


PI = Example("pi_integration.py", ["--chunk", "20000"], 40, 10, 25, ".json")
FIB = Example("fibonacci.py", ["--per-step", "150"], 60, 10, 33, ".json")
SGD = Example("sgd_training.py", ["--samples", "512", "--batch", "32"], 120, 25, 85, ".npz")
ALL = {"pi": PI, "fib": FIB, "sgd": SGD}


def run(ex: Example, n: int, ckpt: Path, *more: str):
    return mpirun(n, ex.cmd(ckpt, *more), timeout=120)


def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def load_sgd(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:  # no pickle: every entry is a plain array
        return {k: z[k] for k in z.files}


def assert_same_result(name: str, out: Path, ref: Path) -> None:
    if name == "sgd":
        got, want = load_sgd(out), load_sgd(ref)
        assert sorted(got) == sorted(want)
        for key in want:
            assert got[key].dtype == want[key].dtype, key
            assert np.array_equal(got[key], want[key]), f"{key} differs from the reference"
        return
    assert out.read_bytes() == ref.read_bytes()
    if name == "fib":
        got, want = json.loads(out.read_text()), json.loads(ref.read_text())
        assert int(got["hex"], 16) == int(want["hex"], 16) == fibonacci(FIB.steps * 150)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(example name, ranks) -> the --out file of an uninterrupted run, made on first use."""
    tmp = tmp_path_factory.mktemp("refs")
    made: dict[tuple[str, int], Path] = {}

    def get(name: str, n: int) -> Path:
        if (name, n) not in made:
            ex = ALL[name]
            out = tmp / f"{name}{n}{ex.suffix}"
            r = run(ex, n, tmp / f"ck-{name}{n}", "--every", str(ex.every), "--out", str(out))
            assert r.returncode == 0, r.stderr
            assert out.exists()
            made[name, n] = out
        return made[name, n]

    return get


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(ALL))
def test_crash_then_resume_is_bit_identical(tmp_path, references, name, n):
    ex = ALL[name]
    ref = references(name, n)
    ck = tmp_path / "ck"
    out = tmp_path / f"out{ex.suffix}"
    every = ["--every", str(ex.every)]

    crashed = run(ex, n, ck, *every, "--crash-at", str(ex.crash_at), "--out", str(out))
    assert crashed.returncode != 0, "the injected crash must fail the run"
    assert not out.exists(), "a crashed run must not write a result"
    kept = [e.step for e in layout.scan(ck)]  # newest first; retention may drop old ones
    assert kept and kept[0] == ex.saved_before_crash[0], kept
    assert set(kept) <= set(ex.saved_before_crash), kept
    assert layout.partials(ck) == []
    assert read_status(ck).state == "running"

    resumed = run(ex, n, ck, *every, "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr
    newest = ex.saved_before_crash[0]
    assert f"restored step {newest}" in resumed.stderr, "the resumed run must not start over"
    assert read_status(ck).state == "finished"
    saved = [e["step"] for e in read_events(ck) if e["event"] == "checkpoint"]
    assert saved == list(range(ex.every - 1, ex.steps, ex.every)), "no step checkpointed twice"
    assert_same_result(name, out, ref)


def test_results_are_right(references):
    """The reference runs compute what they claim, on 2 and 3 ranks alike."""
    for n in (2, 3):
        pi = json.loads(references("pi", n).read_text())
        assert pi["intervals"] == PI.steps * 20000 and pi["ranks"] == n
        assert abs(pi["error"]) < 1e-11 and float.fromhex(pi["hex"]) == pi["pi"]

        fib = json.loads(references("fib", n).read_text())
        value = int(fib["hex"], 16)
        assert fib["n"] == FIB.steps * 150 and value == fibonacci(fib["n"])
        assert fib["digits"] == len(str(value)) and len(fib["rank_sha256"]) == n

        sgd = load_sgd(references("sgd", n))
        hist = sgd["history"]
        assert len(hist) == SGD.steps // (512 // 32)
        assert hist[-1] < 0.2 * hist[0], f"the model did not learn: epoch losses {hist}"
        assert np.all(np.isfinite(sgd["theta"]))
    # The exact integers do not depend on the number of ranks.
    fib2, fib3 = (json.loads(references("fib", n).read_text()) for n in (2, 3))
    assert fib2["hex"] == fib3["hex"]


def test_resuming_another_problem_is_refused(tmp_path):
    ck = tmp_path / "ck"
    first = run(PI, 2, ck, "--every", "10")
    assert first.returncode == 0, first.stderr
    other = mpirun(
        2, [str(EXAMPLES / PI.script), "--ckpt-dir", str(ck), "--steps", "40", "--chunk", "999"]
    )
    assert other.returncode != 0
    assert "holds a run with" in other.stderr


def test_usr1_stops_sgd_and_resume_matches(tmp_path, references):
    ck = tmp_path / "ck"
    out = tmp_path / "out.npz"
    proc = start_mpirun(2, SGD.cmd(ck, "--sleep", "0.02", "--out", str(out)))
    try:
        wait_for(
            lambda: proc.poll() is not None or getattr(read_status(ck), "state", "") == "running",
            60,
            "the run to report running",
        )
        assert proc.poll() is None, "the run ended before the signal: " + proc.stderr.read()
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    status = read_status(ck)
    assert status.state == "stopped" and status.step is not None and status.step < SGD.steps - 1
    assert not out.exists()
    r = run(SGD, 2, ck, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"restored step {status.step}" in r.stderr
    assert_same_result("sgd", out, references("sgd", 2))


def test_fibonacci_beyond_4300_digits(tmp_path):
    """Ints past Python's 4300-digit str limit are stored in hex, so F(25000) round-trips."""
    ck = tmp_path / "ck"
    out = tmp_path / "out.json"
    args = ["--per-step", "1000", "--steps", "30", "--every", "25"]  # checkpoint at F(25000)
    r = mpirun(2, [str(EXAMPLES / FIB.script), *args, "--ckpt-dir", str(ck), "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(json.loads(out.read_text())["hex"], 16) == fibonacci(30000)
