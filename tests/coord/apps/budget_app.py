"""Test app: back-to-back asynchronous saves of a large state, within a staging budget.

    budget_app.py DIR --out RESULT.json [--mib M] [--saves N] [--budget SIZE]
                  [--gate PATH] [--no-verify]

Each rank holds ``u``: M MiB of float64, every page touched. Then N saves in a row
with ``Checkpointer(async_save=True, staging_budget=SIZE)`` (no budget: the default),
each after changing one element in every MiB of ``u`` (every block dirty, so every
save writes the whole state). Nothing computes in between: each save waits for the
previous background write, the heaviest use of the staging memory. Rank ``i % n``
verifies checkpoint ``i - 1`` (``CheckpointReader.verify``) once it is committed, the
last one after ``finish()`` (not with ``--no-verify``: verifying reads a whole
checkpoint into memory).

With ``--gate PATH`` rank 0 writes ``PATH.ready`` once every rank holds its state and
waits for ``PATH`` to appear before saving (a test lowers a memory limit meanwhile).

RESULT.json: per rank the resident set before the first save (``rss0``) and, per
save, the peak resident set from the save's start to its return (``peaks``) and the
resident set after it (``rss``); the verification problems per checkpoint
(``problems``), the values of ``u`` seen by each save (``marks``).
"""

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.store.file import layout
from hpcckpt.store.file.reader import CheckpointReader
from hpcckpt.store.io import memory

STRIDE = (1 << 20) // 8  # one float64 per MiB


def verify(directory: Path, step: int) -> list[str]:
    path = directory / layout.checkpoint_name(step)
    try:
        with CheckpointReader(path) as reader:
            problems = reader.verify()
    except Exception as exc:  # a checkpoint that cannot be read does not verify
        return [f"{type(exc).__name__}: {exc}"]
    return problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=30)
    ap.add_argument("--budget")
    ap.add_argument("--gate")
    ap.add_argument("--no-verify", action="store_true")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    directory = Path(args.directory)

    u = np.full(args.mib * (1 << 20) // 8, float(rank), dtype=np.float64)
    state = {"u": u}
    ckpt = Checkpointer(
        directory,
        every_steps=1,
        async_save=True,
        staging_budget=args.budget,
        incremental=False,
        validate=None,
        keep_last=2,
    )
    comm.Barrier()
    if args.gate:
        if rank == 0:
            Path(args.gate + ".ready").write_text(str(os.getpid()))
            deadline = time.monotonic() + 120
            while not os.path.exists(args.gate) and time.monotonic() < deadline:
                time.sleep(0.05)
        comm.Barrier()
    rss0 = memory.rss_bytes()
    peaks, rss, problems = [], [], {}
    for i in range(args.saves):
        u[::STRIDE] = rank + 1000.0 * (i + 1)
        ckpt.save(i, state)
        peaks.append(memory.peak_rss_bytes())
        rss.append(memory.rss_bytes())
        if i > 0 and rank == i % n and not args.no_verify:
            problems[i - 1] = verify(directory, i - 1)
    ckpt.finish()
    if rank == (args.saves % n) and not args.no_verify:
        problems[args.saves - 1] = verify(directory, args.saves - 1)
    every = comm.gather({"rss0": rss0, "peaks": peaks, "rss": rss, "problems": problems})
    if rank == 0:
        merged: dict[str, list[str]] = {}
        for r in every:
            for step, found in r["problems"].items():
                merged[str(step)] = found
        out = {"ranks": [{k: r[k] for k in ("rss0", "peaks", "rss")} for r in every]}
        out["problems"] = merged
        out["nranks"] = n
        Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
