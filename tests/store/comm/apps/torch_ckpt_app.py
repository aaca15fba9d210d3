"""A Checkpointer over torch.distributed (gloo), no MPI: ranks started by
torch.multiprocessing, ``Checkpointer(directory)`` given no communicator.

Usage: ``torch_ckpt_app.py SPEC.json``; SPEC holds ``mode`` (``save``: save ``steps``,
exit without finish(), as a job killed after its last save; ``restore``: restore into a
fresh state and check it bit for bit against a replay of the saved step), ``n``,
``dir``, ``steps``, ``out`` and optional Checkpointer keywords ``ck`` (``cache`` may
hold ``%n``; ``nodes``: rank -> fake node name). The state: numpy arrays of odd sizes
(a pure function of rank and step), a small torch model and its AdamW after one step
per saved step. Rank 0 writes ``out`` (JSON) with every rank's result.
"""

from __future__ import annotations

import json
import socket
import sys
import traceback

import numpy as np


def arrays_of(rank: int, step: int) -> dict:
    rng = np.random.default_rng(1000 * rank + step)
    wide = rng.random((100 + 7 * rank, 3))
    return {
        "u": rng.random(1001 + 337 * rank),
        "bytes": rng.integers(0, 255, 4093 + rank, dtype=np.uint8),
        "empty": np.zeros((0, 4)),
        "strided": wide[:, 1],
        "ints": np.arange(17 * (rank + 1), dtype=np.int32) * step,
        "t": float(step) / 7.0,
    }


def blank(rank: int) -> dict:
    return {
        k: (np.zeros_like(v) if isinstance(v, np.ndarray) else None)
        for k, v in arrays_of(rank, 0).items()
    }


def model_after(steps: int):
    """The model and AdamW after one training step per saved step (same on every rank)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(steps):
        g = torch.Generator().manual_seed(100 + s)
        x, y = torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model, opt


def same_arrays(a: dict, b: dict) -> bool:
    for k, v in b.items():
        w = a[k]
        if isinstance(v, np.ndarray):
            if not (
                isinstance(w, np.ndarray) and w.shape == v.shape and w.tobytes() == v.tobytes()
            ):
                return False
        elif w != v:
            return False
    return True


def same_model(model, opt, ref_model, ref_opt) -> bool:
    import torch

    ps = model.state_dict()
    if any(not torch.equal(ps[k], v) for k, v in ref_model.state_dict().items()):
        return False
    got, want = opt.state_dict(), ref_opt.state_dict()
    if got["param_groups"] != want["param_groups"]:
        return False
    for i, st in want["state"].items():
        for k, v in st.items():
            w = got["state"][i][k]
            if not (torch.equal(w, v) if isinstance(v, torch.Tensor) else w == v):
                return False
    return True


def worker(rank: int, spec: dict, port: int) -> None:
    import torch.distributed as dist

    import hpcckpt

    n = spec["n"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    result: dict = {"rank": rank, "error": None}
    try:
        kw = dict(spec.get("ck", {}))
        nodes = kw.pop("nodes", None)
        if nodes:
            kw["node_name"] = nodes[rank]
        ck = hpcckpt.Checkpointer(spec["dir"], every_steps=1, keep_last=None, **kw)
        result["comm"] = type(ck.comm).__name__
        if spec["mode"] == "save":
            model, opt = model_after(0)
            for step in spec["steps"]:
                model, opt = model_after(step + 1)
                ck.save(step, {"arrays": arrays_of(rank, step), "model": model, "opt": opt})
            ck.wait()  # an async save's last write committed
            result["saved"] = ck.last_save.step if ck.last_save else None
        else:
            model, opt = model_after(1)  # a fresh run's state, before its restore
            state = {"arrays": blank(rank), "model": model, "opt": opt}
            step = ck.restore(state)
            result["step"] = step
            if step is not None:
                ref_model, ref_opt = model_after(step + 1)
                result["same_arrays"] = same_arrays(state["arrays"], arrays_of(rank, step))
                result["same_model"] = same_model(model, opt, ref_model, ref_opt)
            ck.wait()
    except Exception:
        result["error"] = traceback.format_exc()
    result["mpi_loaded"] = "mpi4py" in sys.modules
    everyone = [None] * n
    dist.all_gather_object(everyone, result)
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(everyone, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    spec = json.loads(open(sys.argv[1]).read())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(spec, port), nprocs=spec["n"], join=True)
