"""Test app: an asynchronous save keeps the values at ``save()`` while training goes on.

    values_app.py DIR --out RESULT.json [--saves N]

Each rank holds a numpy array and a torch CPU model (and a free tensor). For each of N
``Checkpointer(async_save=True)`` saves the ranks snapshot the state, call ``save()``,
and change every array and tensor in place right after it returns, while the
background write is held back (its writer waits until the changes are made: a white
box of ``background.write_extents``, so the write cannot have happened before). After
``wait()`` a new Checkpointer restores the checkpoint into a fresh state: rank 0 writes
RESULT.json with, per save, whether every rank got back exactly the snapshot, whether
the write was still held when the changes were made, the save's kind and the staging
memory against its budget. Between saves the state goes back to the snapshot with one
element changed, so that every save after the first is a delta.
"""

import argparse
import faulthandler
import json
import threading
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI


def main() -> None:
    faulthandler.dump_traceback_later(150, exit=True)
    ap = argparse.ArgumentParser()
    ap.add_argument("directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()

    import hpcckpt
    from hpcckpt.store.save import background

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    go = threading.Event()
    real_write = background.write_extents

    def held(*a, **k):
        assert go.wait(60), "the main thread never released the write"
        return real_write(*a, **k)

    background.write_extents = held

    torch.manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64))
    state = {
        "u": np.random.default_rng(rank).random((512, 300)),
        "model": model,
        "x": torch.randn(4096, dtype=torch.float64),
    }

    def snapshot() -> dict:
        out = {"u": state["u"].copy(), "x": state["x"].clone()}
        out.update({f"m.{k}": v.detach().clone() for k, v in model.state_dict().items()})
        return out

    budget = 16 << 20
    state_bytes = state["u"].nbytes + 8 * 4096
    state_bytes += sum(v.numel() * v.element_size() for v in model.state_dict().values())
    ck = hpcckpt.Checkpointer(
        args.directory,
        comm=comm,
        every_steps=1,
        async_save=True,
        staging_budget=budget,
        min_delta_saving=0,
        block_size=4096,
        validate=None,
    )
    rows = []
    for step in range(args.saves):
        before = snapshot()
        go.clear()
        saved = ck.save(step, state)
        pending = ck._pending  # white box: the write is held until the changes are made
        held_then = pending is not None and not pending.done()
        state["u"] *= -2.0  # every array and tensor changes right after save() returns
        state["u"][0, 0] = step
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-0.5).add_(step)
        state["x"].add_(1.0)
        go.set()
        done = ck.wait()
        fresh = {
            "u": np.zeros_like(state["u"]),
            "model": torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 64)),
            "x": torch.zeros(4096, dtype=torch.float64),
        }
        reader = hpcckpt.Checkpointer(args.directory, comm=comm, every_steps=1, validate=None)
        got = reader.restore(fresh)
        reader.close()
        same = np.array_equal(fresh["u"], before["u"]) and torch.equal(fresh["x"], before["x"])
        for k, v in fresh["model"].state_dict().items():
            same = same and torch.equal(v, before[f"m.{k}"])
        # The next step changes one element only: the next save is a delta (hashed while
        # staged), and its values are changed wholesale right after it all the same.
        state["u"][:] = before["u"]
        state["u"][7, 7] += 1.0
        state["x"].copy_(before["x"])
        model.load_state_dict({k[2:]: v for k, v in before.items() if k.startswith("m.")})
        rows.append(
            {
                "step": step,
                "restored": got,
                "committed": None if done is None else done.step,
                "kind": None if done is None else done.kind,
                "said": None if saved is None else saved.kind,
                "held": comm.allreduce(held_then, op=MPI.LAND),
                "same": comm.allreduce(bool(same), op=MPI.LAND),
                "staging_bytes": comm.allreduce(ck.buffers.nbytes, op=MPI.MAX),
                "staging_peak": comm.allreduce(ck.buffers.peak, op=MPI.MAX),
            }
        )
    ck.close()
    if rank == 0:
        doc = {"budget": budget, "state_bytes": state_bytes, "saves": rows}
        Path(args.out).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
