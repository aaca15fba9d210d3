"""examples/heat2d.py with a pause in the middle of a save, for node-failure tests.

``HPCCKPT_TEST_PAUSE=phase:rank:step:MARKER`` makes rank ``rank`` stop at the store's
fault point ``phase`` (hpcckpt/store/io/faults.py; e.g. ``write.closed``: the ``.partial``
is written, not yet committed) in the first save of a step >= ``step``: it creates ``MARKER`` and
sleeps, so that a test can fail its node while the save is under way. Later runs (the
marker exists) do not pause. Everything else is heat2d unchanged, so the result must be
bit-identical to an uninterrupted run.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from hpcckpt.store.io import faults

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "heat2d.py"


def _install() -> None:
    spec = os.environ.get("HPCCKPT_TEST_PAUSE", "")
    if not spec:
        return
    phase, rank, first, marker = spec.split(":", 3)
    original = faults.fault_point

    current: list[int] = []

    def pausing(name: str, step: int | None = None) -> None:
        original(name, step)
        if step is not None:  # given by the first point of a save
            current[:] = [step]
        me = os.environ.get("SLURM_PROCID") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
        at = current[0] if current else None  # the step of the save under way
        if name != phase or me != rank or at is None or at < int(first):
            return
        if not os.path.exists(marker):
            Path(marker).write_text(f"{os.getpid()} {os.environ.get('SLURMD_NODENAME')}\n")
            time.sleep(600)

    faults.fault_point = pausing


if __name__ == "__main__":
    _install()
    sys.argv = [str(EXAMPLE), *sys.argv[1:]]
    runpy.run_path(str(EXAMPLE), run_name="__main__")
