"""Project save time and job efficiency to 1,000 and 10,000 ranks, on paper.

    .venv/bin/python benchmarks/project.py [--fixed 0.05] [--ratio 0.85] [--fs-bw 100e9] ...

A checkpoint of N ranks x S bytes on a parallel file system takes

    C(N) = fixed + meta(N) + N*S / min(fs_bw, stripes*ost_bw, nodes*node_bw) / ratio

- ``fixed``: hpcckpt's per-save cost that does not scale with bytes (agreement
  allgathers, HDF5 metadata, rename, directory fsync), measured here at 64 MiB per
  rank;
- ``ratio``: the fraction of the raw bandwidth hpcckpt's writer reaches (measured
  here against the local limit at >= 512 MiB per rank); assumed to carry over;
- the bandwidth is the smallest of: the file system's aggregate, the OSTs the file
  is striped over x per-OST bandwidth (one shared file: hpcckpt's default stripe
  count caps at 64; file per rank: spread over every OST), and the nodes' injection;
- ``meta(N)``: metadata operations at the MDS: one shared file costs 1 create + N
  opens; file per rank N creates + N opens + N closes, at ``--md-rate`` ops/s.

The job's MTBF is the node MTBF (default 5 years, ``hpcckpt.policy``) / nodes; the
interval is Daly's; the efficiency is ``hpcckpt.policy.efficiency`` with a restart
cost of ``--restart`` seconds (requeue wait excluded) plus reading the checkpoint
back at the same bandwidth. Prints a Markdown table and the ``hpcckpt simulate``
commands that check it.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpcckpt.policy import DEFAULT_NODE_MTBF, daly, efficiency, job_mtbf  # noqa: E402

GiB = 1 << 30


def save_seconds(
    n: int,
    size: int,
    *,
    layout: str,
    fixed: float,
    ratio: float,
    fs_bw: float,
    ost_bw: float,
    osts: int,
    stripes: int,
    node_bw: float,
    ranks_per_node: int,
    md_rate: float,
) -> tuple[float, float, float]:
    """(seconds, effective bandwidth, metadata seconds) of one save."""
    nodes = math.ceil(n / ranks_per_node)
    ost_limit = (min(stripes, osts) if layout == "shared" else osts) * ost_bw
    bw = min(fs_bw, ost_limit, nodes * node_bw) * ratio
    meta = (1 + n) / md_rate if layout == "shared" else 3 * n / md_rate
    return fixed + meta + n * size / bw, bw, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="1000,10000")
    p.add_argument("--sizes", default="512M,2G", help="bytes per rank")
    p.add_argument("--fixed", type=float, default=0.05, help="s per save, measured (64M run)")
    p.add_argument("--ratio", type=float, default=0.85, help="writer / raw bandwidth, measured")
    p.add_argument("--fs-bw", type=float, default=100e9, help="aggregate bytes/s")
    p.add_argument("--osts", type=int, default=80)
    p.add_argument("--ost-bw", type=float, default=1.25e9, help="bytes/s per OST")
    p.add_argument("--stripes", type=int, default=64, help="stripe count of one shared file")
    p.add_argument("--node-bw", type=float, default=10e9, help="bytes/s one node can inject")
    p.add_argument("--ranks-per-node", type=int, default=32)
    p.add_argument("--md-rate", type=float, default=20e3, help="metadata ops/s at the MDS")
    p.add_argument("--node-mtbf", type=float, default=DEFAULT_NODE_MTBF, help="seconds")
    p.add_argument("--restart", type=float, default=60.0, help="s to relaunch, before reading")
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _util

    print(
        "| ranks | nodes | state/rank | layout | bandwidth GB/s | metadata s | save C s | "
        "job MTBF h | Daly interval h | efficiency |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    commands = []
    for n in (int(x) for x in args.ranks.split(",")):
        nodes = math.ceil(n / args.ranks_per_node)
        mtbf = job_mtbf(node_mtbf=args.node_mtbf, nodes=nodes)
        for size in (_util.parse_size(s) for s in args.sizes.split(",")):
            for layout in ("shared", "per-rank"):
                c, bw, meta = save_seconds(
                    n,
                    size,
                    layout=layout,
                    fixed=args.fixed,
                    ratio=args.ratio,
                    fs_bw=args.fs_bw,
                    ost_bw=args.ost_bw,
                    osts=args.osts,
                    stripes=args.stripes,
                    node_bw=args.node_bw,
                    ranks_per_node=args.ranks_per_node,
                    md_rate=args.md_rate,
                )
                restart = args.restart + c  # reading back at about the same rate
                t = daly(c, mtbf)
                eff = efficiency(t, c, mtbf, restart)
                print(
                    f"| {n:,} | {nodes} | {_util.size_label(size)}iB | {layout} | "
                    f"{bw / 1e9:.0f} | {meta:.2f} | {c:.1f} | {mtbf / 3600:.0f} | "
                    f"{t / 3600:.2f} | {eff * 100:.2f}% |"
                )
                if layout == "shared":
                    commands.append(
                        f"hpcckpt simulate --work 7d --nodes {nodes} --node-mtbf "
                        f"{args.node_mtbf / 86400:.0f}d --cost {c:.0f}s --restart-cost "
                        f"{restart:.0f}s"
                    )
    print()
    for cmd in commands:
        print(cmd)


if __name__ == "__main__":
    main()
