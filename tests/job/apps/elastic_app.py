"""A stand-in for an hpcckpt application under torchrun: the wrapper's contract, no torch.

Each worker (rank and size from torchrun's ``RANK``/``WORLD_SIZE``) installs its
handlers; rank 0 reports ``running`` (with its pid) once every worker of this torchrun
restart is ready, the workers step along, and on a stop signal they "checkpoint" (sleep),
rank 0 reports ``stopped`` (and logs a ``stop`` event) and every worker exits with
``--exit-after-stop``. Each worker
writes what it received to ``DIR/signals.rank<R>.restart<N>.json`` (N: torchrun's
``TORCHELASTIC_RESTART_COUNT``; ``.requeue<Q>`` follows in a requeued Slurm job).

    python elastic_app.py [--exit-after-stop C] [--crash-on-stop R] [--crash-after S R]
                          [--steps-after-requeue N] [--child] [--handler-delay S]

``--crash-on-stop R``: in torchrun's first run, rank R exits 3 on the stop signal without
checkpointing (a crash during the stop). ``--crash-after S R``: in the first run, rank R
exits 3 S seconds after ``running`` (a crash with no stop). ``--steps-after-requeue N``:
in a requeued Slurm job (``SLURM_RESTART_COUNT`` > 0) rank 0 reports ``finished`` after N
steps.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hpcckpt.rundir.events import STOP, append_event
from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus, write_status

DIR = Path(os.environ["HPCCKPT_DIR"])
ATTEMPT = os.environ.get("HPCCKPT_ATTEMPT")
RANK = int(os.environ["RANK"])
SIZE = int(os.environ["WORLD_SIZE"])
RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
REQUEUE = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
#: Names this worker's files: torchrun's restart, and Slurm's requeue when there was one.
TAG = f"restart{RESTART}" + (f".requeue{REQUEUE}" if REQUEUE else "")
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)

received: list[str] = []


def on_signal(signum: int, _frame: object) -> None:
    received.append(signal.Signals(signum).name)


def dump() -> None:
    path = DIR / f"signals.rank{RANK}.{TAG}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "received": received}))
    os.replace(tmp, path)


def wait_for_ranks(prefix: str, timeout: float = 60.0) -> None:
    (DIR / f"{prefix}.rank{RANK}.{TAG}").write_text("")
    if RANK != 0:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((DIR / f"{prefix}.rank{r}.{TAG}").exists() for r in range(SIZE)):
            return
        time.sleep(0.02)
    sys.exit(f"rank 0: not every rank reached {prefix} within {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-after-stop", type=int, default=0)
    parser.add_argument("--crash-on-stop", type=int, default=-1)
    parser.add_argument("--crash-after", nargs=2, type=float, default=None)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--steps-after-requeue", type=int, default=None)
    parser.add_argument("--child", action="store_true", help="start a child (a loader worker)")
    parser.add_argument("--handler-delay", type=float, default=0.0)
    args = parser.parse_args()
    time.sleep(args.handler_delay)  # importing torch, joining the group: a signal kills it
    if args.child:  # it inherits the worker's environment, marker included
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        atexit.register(child.kill)
    if args.steps_after_requeue is not None and REQUEUE:
        args.steps = args.steps_after_requeue
    for sig in STOP_SIGNALS:
        signal.signal(sig, on_signal)
    wait_for_ranks("ready")
    if RANK == 0:
        write_status(DIR, RunStatus(RUNNING, ATTEMPT, step=0))
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        time.sleep(0.05)
        dump()
        first = RESTART == 0
        if args.crash_after and first and RANK == int(args.crash_after[1]):
            if time.monotonic() - started > args.crash_after[0]:
                return 3
        if received:
            if first and RANK == args.crash_on_stop:
                return 3
            time.sleep(0.3)  # the "checkpoint"; more signals may arrive
            dump()
            wait_for_ranks("stopped")
            if RANK == 0:
                write_status(DIR, RunStatus(STOPPED, ATTEMPT, step=step, reason="signal"))
                append_event(DIR, STOP, step=step, reason="signal")  # as the Checkpointer does
                (DIR / f"committed.{TAG}").write_text("")
            deadline = time.monotonic() + 60
            while not (DIR / f"committed.{TAG}").exists():  # as after a collective
                if time.monotonic() > deadline:
                    return 4
                time.sleep(0.02)
            return args.exit_after_stop
    dump()
    wait_for_ranks("finished")
    if RANK == 0:
        write_status(DIR, RunStatus(FINISHED, ATTEMPT, step=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
