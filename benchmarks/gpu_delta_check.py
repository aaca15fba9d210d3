"""Incremental async saves of GPU state that copy only the blocks that changed.

    python benchmarks/gpu_delta_check.py [--repeat 5] [--json FILE]         (a GPU node)
    python benchmarks/gpu_delta_check.py --device cpu --width 512 --repeat 2  (the flow)

A fine-tuning state on ``cuda:0``: a frozen backbone of ``--layers`` Linear layers of
``--width``\\ ² fp32 (4 x 4096² by default, 256 MiB) and a trained head (``--head``
outputs) with its AdamW state. Two staged saves of it, interleaved, each into its own
store and host buffers: ``device`` (the default, ``change_detection="auto"``: block
checksums computed on the GPU, only changed blocks copied to the pinned staging) and
``hashes`` (every byte copied and hashed on the host: the path before device checksums).
Two phases, each a base save then ``--repeat`` measured saves:

- ``1%``: one training step of the head between saves (about 1 % of the bytes change);
- ``100%``: also every backbone weight negated (every block changes).

Per save and mode it prints the bytes copied to the host, the kind of file written and
its dirty blocks, and the blocked time (``begin_save``); per phase the medians, next to
a bare pinned copy of the whole state and the checksum kernels alone. Checked: after
each phase both stores restore the live state bit for bit (through the chain of
deltas), the device mode copies no more blocks than changed, and on a GPU the checksum
kernels give the CPU's sums for every dtype, and a save while the GPU has almost no
memory free (the checksums cannot run: tensors copied whole) succeeds and restores
exactly. Exit 0 when the checks pass, 1 when one fails, 2 without CUDA (``--device cuda``).
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
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

MODES = ("device", "hashes")
PHASES = ("1%", "100%")


def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _tensors(model: Any, optim: Any) -> list[Any]:
    import torch

    moments = [t for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
    return [*model.state_dict().values(), *moments]


def _bits(t: Any) -> Any:
    import torch

    raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().reshape(-1).view(raw).cpu()


def _kernels_match_the_cpu(dev: Any) -> dict[str, bool]:
    """The checksum kernels on ``dev`` against the same sums on the CPU, per dtype."""
    import torch

    from hpcckpt.store.save.device_checksums import block_checksums

    out = {}
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8):
        host = torch.randint(-(2**7), 2**7 - 1, (3 * 2**20 + 13,), generator=g)
        host = host.to(torch.int8) if dtype == torch.int8 else (host.to(dtype) / 7).to(dtype)
        on_dev = host.to(dev)
        out[str(dtype).removeprefix("torch.")] = bool(
            torch.equal(block_checksums(on_dev).cpu(), block_checksums(host))
        )
    return out


def _device_full_save(dev: Any, model: Any, optim: Any, train_head: Any, root: Path) -> dict:
    """An incremental save while the GPU has almost no memory free: the checksums cannot
    run there, so the tensors are copied whole; the save must succeed and restore exactly."""
    import torch
    from mpi4py import MPI

    from hpcckpt.store import CheckpointStore, HostBuffers

    state = {"model": model, "optim": optim}
    store = CheckpointStore(root / "device-full", MPI.COMM_SELF, min_delta_saving=0)
    buffers = HostBuffers()
    store.finish_save(store.begin_save(0, state, buffers=buffers))
    train_head()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    hog, size = [], torch.cuda.mem_get_info(dev)[0]
    while size > 4 << 20:  # fill the device: what is left is under the sums' 64 MiB
        try:
            hog.append(torch.empty(size, dtype=torch.uint8, device=dev))
        except torch.OutOfMemoryError:
            size //= 2
    free = torch.cuda.mem_get_info(dev)[0]
    row: dict[str, Any] = {"free_bytes_during_save": free}
    try:
        res = store.finish_save(store.begin_save(1, state, buffers=buffers))
        row.update(kind=res.kind, bytes_copied=buffers.checks.copied.bytes)
    except Exception as exc:  # reported: the check fails
        row["error"] = repr(exc)
    finally:
        del hog
        torch.cuda.empty_cache()
    if "error" not in row:
        want = [_bits(t) for t in _tensors(model, optim)]
        with torch.no_grad():
            for t in _tensors(model, optim):
                t.zero_()
        back = CheckpointStore(store.directory, MPI.COMM_SELF).restore(state)
        got = [_bits(t) for t in _tensors(model, optim)]
        row["restored_bit_identical"] = (
            back is not None
            and back.step == 1
            and len(got) == len(want)
            and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        )
    big = sum(p.numel() * p.element_size() for p in model.parameters() if p.numel() >= 2**20)
    row["passed"] = bool(
        row.get("restored_bit_identical")
        and row.get("kind") == "incremental"
        and row.get("bytes_copied", 0) >= big  # copied whole: the sums could not run
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the flow only)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--head", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--root", help="scratch directory (default: a new one under /tmp)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    out: dict[str, Any] = {"torch": torch.__version__, "device": args.device, "phases": {}}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        out["status"] = "no CUDA device: nothing checked"
        print(json.dumps(out, indent=1))
        return 2
    from mpi4py import MPI

    from hpcckpt.store import CheckpointStore, HostBuffers
    from hpcckpt.store.save.device_checksums import DeviceChecksums, block_checksums

    dev = torch.device(args.device if args.device != "cuda" else "cuda:0")
    out["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    root = Path(args.root or tempfile.mkdtemp(prefix="hpcckpt-gpu-delta-"))
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    ).to(dev)
    backbone.requires_grad_(False)
    head = torch.nn.Linear(args.width, args.head).to(dev)
    model = torch.nn.Sequential(backbone, head)
    optim = torch.optim.AdamW(head.parameters(), lr=1e-3)

    def train_head() -> None:
        optim.zero_grad()
        model(torch.randn(8, args.width, device=dev)).square().mean().backward()
        optim.step()

    train_head()  # AdamW's moments exist from here on
    state = {"model": model, "optim": optim}
    held = _tensors(model, optim)
    total = sum(t.numel() * t.element_size() for t in held)
    out["state_bytes"] = total
    ok = True
    if dev.type == "cuda":
        out["kernels_match_cpu"] = _kernels_match_the_cpu(dev)
        ok = ok and all(out["kernels_match_cpu"].values())

    for phase in PHASES:
        stores, buffers = {}, {}
        for mode in MODES:
            stores[mode] = CheckpointStore(
                root / phase.rstrip("%") / mode,
                MPI.COMM_SELF,
                change_detection="auto" if mode == "device" else "hashes",
                max_chain=args.repeat + 1,
                max_chain_fraction=args.repeat + 1.0,  # the 100 % phase stays a chain too
                min_delta_saving=0,
            )
            buffers[mode] = HostBuffers(checks=DeviceChecksums(on_cpu=dev.type == "cpu"))
        rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
        for rep in range(args.repeat + 1):  # rep 0: the base save (full, every byte)
            if rep:
                train_head()
                if phase == "100%":
                    with torch.no_grad():
                        for p in backbone.parameters():
                            p.neg_()
            for mode in MODES if rep % 2 else MODES[::-1]:  # interleaved, order alternating
                _sync(dev)
                pending = stores[mode].begin_save(rep, state, buffers=buffers[mode])
                res = stores[mode].finish_save(pending)
                copied = buffers[mode].checks.copied
                rows[mode].append(
                    {
                        "step": rep,
                        "kind": res.kind,
                        "dirty_blocks": res.dirty_blocks,
                        "total_blocks": res.total_blocks,
                        "bytes_copied": copied.bytes,
                        "blocks_copied": copied.blocks,
                        "blocked_seconds": pending.blocked,
                    }
                )
                print(
                    f"{phase:>4} {mode:>6} save {rep}: {res.kind:<11} dirty "
                    f"{res.dirty_blocks}/{res.total_blocks} blocks, copied "
                    f"{copied.bytes / 2**20:9.2f} MiB, blocked {pending.blocked * 1e3:8.2f} ms",
                    flush=True,
                )
        # the live state, restored by each store after it was scrambled
        want = [_bits(t) for t in held]
        restored = {}
        for mode in MODES:
            with torch.no_grad():
                for t in _tensors(model, optim):
                    t.zero_()
            res = CheckpointStore(stores[mode].directory, MPI.COMM_SELF).restore(state)
            got = [_bits(t) for t in _tensors(model, optim)]
            restored[mode] = (
                res is not None
                and res.step == args.repeat
                and len(got) == len(want)
                and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            )
        held = _tensors(model, optim)
        measured = {m: rows[m][1:] for m in MODES}
        # device mode: the same dirty blocks as exact hashing (a missed change would leave
        # a stale block in its staging, hashed equal to its parent's: fewer dirty blocks),
        # and at 1 % fewer bytes copied
        bounded = all(
            d["dirty_blocks"] == h["dirty_blocks"]
            and (phase != "1%" or d["bytes_copied"] < h["bytes_copied"])
            for d, h in zip(measured["device"], measured["hashes"], strict=True)
        )
        summary = {
            m: {
                "blocked_median_seconds": statistics.median(r["blocked_seconds"] for r in rs),
                "bytes_copied_median": statistics.median(r["bytes_copied"] for r in rs),
                "copied_fraction": statistics.median(r["bytes_copied"] for r in rs) / total,
                "kinds": [r["kind"] for r in rs],
            }
            for m, rs in measured.items()
        }
        out["phases"][phase] = {
            "saves": rows,
            "summary": summary,
            "restored_bit_identical": restored,
            "dirty_blocks_agree": bounded,
        }
        ok = ok and all(restored.values()) and bounded
        for m, s in summary.items():
            print(
                f"{phase:>4} {m:>6}: median blocked {s['blocked_median_seconds'] * 1e3:.2f} ms, "
                f"copied {s['bytes_copied_median'] / 2**20:.2f} MiB "
                f"({100 * s['copied_fraction']:.1f} % of {total / 2**20:.1f} MiB); "
                f"restored bit-identical: {restored[m]}",
                flush=True,
            )
    if dev.type == "cuda":
        out["device_full"] = _device_full_save(dev, model, optim, train_head, root)
        ok = ok and out["device_full"]["passed"]
        print(f"device full: {out['device_full']}", flush=True)
        held = _tensors(model, optim)
    # the yardsticks: a bare pinned copy of the whole state, the checksum kernels alone
    pin = dev.type == "cuda"
    dst = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in held]
    copies, sums = [], []
    for _ in range(max(1, args.repeat)):
        _sync(dev)
        t0 = time.perf_counter()
        for d, t in zip(dst, held, strict=True):
            d.copy_(t, non_blocking=pin)
        _sync(dev)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in held:
            block_checksums(t)
        _sync(dev)
        sums.append(time.perf_counter() - t0)
    out["pinned_copy_median_seconds"] = statistics.median(copies)
    out["checksums_median_seconds"] = statistics.median(sums)
    print(
        f"yardsticks: whole-state pinned copy {out['pinned_copy_median_seconds'] * 1e3:.2f} ms, "
        f"checksum kernels {out['checksums_median_seconds'] * 1e3:.2f} ms",
        flush=True,
    )
    if not args.root:
        shutil.rmtree(root, ignore_errors=True)
    out["status"] = "passed" if ok else "FAILED"
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
