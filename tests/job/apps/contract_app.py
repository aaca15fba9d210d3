"""A stand-in for an hpcckpt application: the wrapper's contract without HDF5 or MPI calls.

Every rank (rank and size from Open MPI's or Slurm's environment; 1 rank otherwise)
installs its handlers, then rank 0 reports ``running`` once every rank is ready, steps
along, and on a stop signal "checkpoints" (sleeps), after which rank 0 reports
``stopped`` and all exit 0. What each rank received is written to
``DIR/signals.rank<R>.json`` for the tests to check.

    python contract_app.py MODE [--steps N] [--step-time S] [--handler-delay S] ...

Modes: stop (run until a stop signal, or finish after --steps), finish, crash (exit 3),
crash-signal (SIGKILL itself), no-finish (exit 0 without reporting finished), ignore
(SIG_IGN the stop signal, then finish), env (dump the environment, then finish),
orphan-check (record a SIGTERM, as from the kernel when the wrapper dies).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from hpcckpt.rundir.status import FINISHED, RUNNING, STOPPED, RunStatus, write_status

DIR = Path(os.environ["HPCCKPT_DIR"])
ATTEMPT = os.environ.get("HPCCKPT_ATTEMPT")
RANK = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("SLURM_PROCID") or 0)
SIZE = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)

received: list[str] = []


def on_signal(signum: int, _frame: object) -> None:
    received.append(signal.Signals(signum).name)


def report(state: str, step: int, reason: str = "") -> None:
    if RANK == 0:
        write_status(DIR, RunStatus(state=state, attempt=ATTEMPT, step=step, reason=reason))


def dump_signals() -> None:
    path = DIR / f"signals.rank{RANK}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "received": received}))
    os.replace(tmp, path)


def wait_for_ranks(prefix: str, timeout: float = 20.0) -> None:
    (DIR / f"{prefix}.rank{RANK}").write_text(ATTEMPT or "")
    if RANK != 0:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all((DIR / f"{prefix}.rank{r}").exists() for r in range(SIZE)):
            return
        time.sleep(0.02)
    sys.exit(f"rank 0: not every rank reached {prefix} within {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode")
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--handler-delay", type=float, default=0.0)
    parser.add_argument("--ckpt-time", type=float, default=0.3)
    args = parser.parse_args()

    if args.handler_delay:
        time.sleep(args.handler_delay)  # a signal now kills us (default action)
    if args.mode == "ignore":
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    else:
        for sig in STOP_SIGNALS:
            signal.signal(sig, on_signal)
    if args.mode == "env":
        keys = (
            "HPCCKPT_DIR",
            "HPCCKPT_ATTEMPT",
            "HPCCKPT_SIGNAL",
            "HPCCKPT_LOG_LEVEL",
            "OMPI_MCA_io",
        )
        (DIR / "env.json").write_text(json.dumps({k: os.environ.get(k) for k in keys}))
    wait_for_ranks("ready")
    report(RUNNING, 0)

    if args.mode == "crash":
        time.sleep(0.2)
        return 3
    if args.mode == "crash-signal":
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.mode == "no-finish":
        return 0
    if args.mode == "orphan-check":
        while not received:
            time.sleep(0.02)
        dump_signals()
        return 0

    steps = args.steps if args.mode not in ("finish", "env") else min(args.steps, 5)
    for step in range(1, steps + 1):
        time.sleep(args.step_time)
        if received:
            time.sleep(args.ckpt_time)  # the "checkpoint"; more signals may arrive
            dump_signals()
            wait_for_ranks("stopped")
            report(STOPPED, step, f"signal {received[0].removeprefix('SIG')}")
            return 0
    dump_signals()
    wait_for_ranks("finished")
    report(FINISHED, steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
