"""An FSDP2 training on one GPU stopped and resumed through hpcckpt: bit-identical or not.

    python benchmarks/gpu_fsdp_check.py [--steps 40] [--stop 19] [--root DIR] [--json FILE]
    python benchmarks/gpu_fsdp_check.py --device cpu     # the same flow on the CPU (gloo)

Three processes run the same training (seed 0): an MLP of a bf16 and an fp32 layer with
dropout, sharded with ``fully_shard`` over a one-rank process group (nccl on ``cuda:0``,
gloo on the CPU), AdamW and a cosine schedule, the CUDA and CPU generators in
``RNGState``, deterministic algorithms on:

1. ``reference``: all ``--steps`` steps, nothing restored;
2. ``first``: async saves every 5 steps and a save at ``--stop``, then ``close()`` and exit;
3. ``second``: restores the newest checkpoint and runs to the end, then ``finish()``.

The check passes when the second run restored ``--stop``, every loss of runs 2 and 3
equals the reference's at the same step, and the final parameters and AdamW moments
(sha256 of their bytes) are the reference's. Prints one JSON summary (and writes it to
``--json``). Exit status: 0 passed, 1 failed, 2 no CUDA device (nothing checked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

WIDTH, BATCH = 256, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--stop", type=int, default=19, help="the step the first run saves and ends at")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (flow check only)")
    ap.add_argument("--root", default=None, help="scratch directory (default: a temporary one)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--role", choices=["reference", "first", "second"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    return ap.parse_args()


def _sha(torch: Any, tensors: list[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def child(args: argparse.Namespace) -> int:
    """One run of the training (``--role``); writes its losses and hashes to ``--out``."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI
    from torch.distributed.fsdp import fully_shard

    import hpcckpt
    from hpcckpt.training import RNGState

    torch.use_deterministic_algorithms(True)
    cuda = args.device == "cuda"
    device = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(WIDTH, WIDTH).to(torch.bfloat16)
            self.drop = torch.nn.Dropout(0.1)
            self.b = torch.nn.Linear(WIDTH, 1)

        def forward(self, x: Any) -> Any:
            h = torch.relu(self.a(x.to(torch.bfloat16))).float()
            return self.b(self.drop(h))

    torch.manual_seed(0)
    model = Net().to(device)
    fully_shard(model.a)
    fully_shard(model.b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(args.steps, BATCH, WIDTH, generator=gen).to(device)
    y = x.sum(dim=2, keepdim=True).tanh()
    torch.manual_seed(100)  # dropout's stream, carried by RNGState
    state: dict[str, Any] = {"model": model, "optim": opt, "sched": sched, "rng": RNGState()}
    directory = Path(args.root) / "ckpt"
    ck = None
    restored = None
    if args.role != "reference":
        ck = hpcckpt.Checkpointer(
            directory, MPI.COMM_WORLD, every_steps=5, async_save=True, keep_last=None
        )
        restored = ck.restore(state)
    losses: dict[int, float] = {}
    step = 0 if restored is None else restored + 1
    t0 = time.perf_counter()
    while step < args.steps:
        model.train()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
        loss.backward()
        opt.step()
        sched.step()
        losses[step] = float(loss.detach())
        if ck is not None and (ck.due(step) or (args.role == "first" and step == args.stop)):
            ck.save(step, state)
            if args.role == "first" and step == args.stop:
                break
        step += 1
    if ck is not None:
        ck.close() if args.role == "first" else ck.finish()
    params = [p for _, p in sorted(model.named_parameters())]
    moments = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq") if p in opt.state]
    out = {
        "role": args.role,
        "restored": restored,
        "losses": {str(k): v for k, v in losses.items()},
        "params": _sha(torch, params),
        "moments": _sha(torch, moments),
        "seconds": time.perf_counter() - t0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    }
    Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()
    return 0


def run_role(args: argparse.Namespace, role: str, root: Path, port: int) -> dict[str, Any]:
    out = root / f"{role}.json"
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    cmd = [sys.executable, __file__, "--role", role, "--out", str(out), "--root", str(root)]
    cmd += ["--steps", str(args.steps), "--stop", str(args.stop), "--device", args.device]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not out.exists():
        return {"role": role, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
    return json.loads(out.read_text())


def main() -> int:
    args = parse()
    if args.role:
        return child(args)
    summary: dict[str, Any] = {"check": "fsdp2 resume on one device", "device": args.device}
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            summary["status"] = "no CUDA device: nothing checked"
            print(json.dumps(summary, indent=2))
            return 2
    root = Path(args.root or tempfile.mkdtemp(prefix="hpcckpt-fsdp-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        runs = {}
        for role in ("reference", "first", "second"):
            (root / role).mkdir(exist_ok=True)
            runs[role] = run_role(args, role, root, _free_port())
        ref, first, second = runs["reference"], runs["first"], runs["second"]
        failed = [r["role"] + ": " + r["error"] for r in runs.values() if "error" in r]
        if not failed:
            resumed = {**first["losses"], **second["losses"]}
            mismatched = [k for k, v in ref["losses"].items() if resumed.get(k) != v]
            summary.update(
                gpu=ref["device"],
                restored=second["restored"],
                losses_equal=not mismatched,
                mismatched_steps=mismatched,
                params_equal=second["params"] == ref["params"],
                moments_equal=second["moments"] == ref["moments"],
            )
            if second["restored"] != args.stop:
                failed.append(f"second run restored {second['restored']}, not {args.stop}")
            if mismatched or not summary["params_equal"] or not summary["moments_equal"]:
                failed.append("the resumed training differs from the uninterrupted one")
        summary["status"] = "failed" if failed else "passed"
        summary["failures"] = failed
    finally:
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0 if summary["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
