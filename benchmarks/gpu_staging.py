"""Async saves of GPU state: the device-to-host copy into the staging's own pinned buffers.

    python benchmarks/gpu_staging.py [--sizes 256M,2G] [--repeat 5] [--json FILE]

On ``cuda:0``, for each size of model + AdamW state (as ``gpu_check.py`` builds it):

- ``pinned_reused``: every async save copies each tensor into a pinned host buffer
  lent by the Checkpointer's ``HostBuffers``, the same buffers from the second save
  on (their addresses compared), counted in ``HostBuffers.nbytes``;
- ``values_at_save``: parameters changed by kernels queued right after ``save()``
  returns are not in the checkpoint (restored and compared bit for bit);
- ``blocked``: the blocked time of ``save()`` (median of ``--repeat``) against a bare
  ``to("cpu", non_blocking=True)`` of the same tensors into new pinned memory and
  against ``copy_`` into preallocated pinned buffers (the floor); the first save's
  blocked time against a later one's (goal: at most 2x), after a ``restore()`` with
  nothing to restore, as a job calls it before its first save.

Prints one JSON summary. Exit 0 when the correctness checks passed, 1 when one failed,
2 without CUDA.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import _util  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256M,2G")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    out: dict = {"torch": torch.__version__, "sizes": {}}
    if not torch.cuda.is_available():
        out["status"] = "no CUDA device"
        print(json.dumps(out, indent=1))
        return 2
    from mpi4py import MPI

    import hpcckpt

    dev = torch.device("cuda:0")
    out["gpu"] = torch.cuda.get_device_name(dev)
    ok = True
    for label in args.sizes.split(","):
        nbytes = _util.parse_size(label)
        width = max(8, int((nbytes / 12 / 4) ** 0.5))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)]).to(dev)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(8, width, device=dev)).sum().backward()
        optim.step()
        state = {"model": model, "optim": optim}
        held = [p for p in model.parameters()] + [
            t for s in optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()
        ]
        total = sum(t.numel() * t.element_size() for t in held)
        root = Path(tempfile.mkdtemp(prefix="hpcckpt-gpu-staging-"))
        ck = hpcckpt.Checkpointer(
            root / "ck",
            MPI.COMM_WORLD,
            every_steps=1,
            async_save=True,
            incremental=False,
            validate=None,
            keep_last=None,
        )  # keep_last=None: no prune of the previous file to wait for
        # What a job does before its first save (nothing to restore here): the pinned
        # buffers of the first save are made meanwhile, in the background.
        t0 = time.perf_counter()
        ck.restore(state)
        restore_seconds = time.perf_counter() - t0
        time.sleep(min(5.0, 0.5 + total / 2**30))  # the training's first steps
        blocked, ptrs = [], []
        for rep in range(args.repeat + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ck.save(rep, state)
            blocked.append(time.perf_counter() - t0)
            lent = ck.buffers.lent_buffers
            ptrs.append(sorted(t.data_ptr() for t in lent))
            pinned = all(t.is_pinned() for t in lent)
            ck.wait()
        reused = all(p == ptrs[1] for p in ptrs[1:]) and len(ptrs[1]) > 0
        # values at save(): kernels queued right after save() are not in it
        snap = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ck.save(1000, state)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(-1.0).add_(3.0)
        ck.wait()
        ck.restore(state)
        same = all(torch.equal(v, snap[k]) for k, v in model.state_dict().items())
        lent_bytes, staging_bytes = ck.buffers.lent_bytes, ck.buffers.nbytes
        ck.close()
        # the yardsticks
        bare, floor = [], []
        dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in held]
        for _ in range(args.repeat):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            copies = [t.to("cpu", non_blocking=True) for t in held]
            torch.cuda.synchronize()
            bare.append(time.perf_counter() - t0)
            del copies
            t0 = time.perf_counter()
            for d, t in zip(dst, held, strict=True):
                d.copy_(t, non_blocking=True)
            torch.cuda.synchronize()
            floor.append(time.perf_counter() - t0)
        later = statistics.median(blocked[1:])
        row = {
            "state_bytes": total,
            "pinned": pinned,
            "pinned_reused": reused,
            "lent_bytes": lent_bytes,
            "staging_bytes": staging_bytes,
            "values_at_save": same,
            "blocked_first": blocked[0],
            "blocked_later_median": later,
            "blocked_samples": blocked,
            "bare_to_cpu_median": statistics.median(bare),
            "pinned_copy_floor_median": statistics.median(floor),
            "x_bare": later / statistics.median(bare),
            "x_floor": later / statistics.median(floor),
            "first_x_later": blocked[0] / later,
            "restore_seconds": restore_seconds,
        }
        ok = ok and pinned and reused and same and 0 <= lent_bytes - total < 4096
        out["sizes"][label] = row
        shutil.rmtree(root, ignore_errors=True)
        del model, optim, state, held, dst
        torch.cuda.empty_cache()
    out["status"] = "passed" if ok else "FAILED"
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
