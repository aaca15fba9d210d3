"""Data-parallel SGD with momentum on a small numpy network, checkpointed with hpcckpt.

A two-layer network y = tanh(x W1 + b1) w2 + b2 learns a synthetic regression
problem (a random "teacher" network plus noise; the data are regenerated from
--seed on every start, so they need no checkpoint). Every rank holds a replica of
the parameters. Each step takes the next global minibatch of the epoch's shuffled
order, each rank computes the gradient of its share of it, one Allreduce sums the
gradients (and the loss), and every rank applies the same update

    v = momentum * v + g,    theta = theta - lr(step) * v

with a learning rate that warms up linearly and then decays along a cosine to zero
at the last step.

Everything that a resumed run needs to continue exactly is in the state:

- ``theta`` and ``velocity``: the parameters and the momentum buffer, one flat
  float64 array each. W1, b1, w2, b2 are views into ``theta``; ``restore`` fills
  arrays in place, so the views stay valid;
- ``rng``: the numpy Generator that shuffles the data at the start of each epoch. It
  is saved with its bit generator's state, so the resumed run draws the same next
  permutation as an uninterrupted one;
- ``perm``: the current epoch's order, needed to resume in the middle of an epoch;
- ``epoch_loss`` and ``history``: the running loss of the current epoch and the list
  of finished epochs' mean losses (a Python list of floats, kept whole);
- ``lr``: the learning rate of the last step. The schedule is a function of the step,
  so the step that ``restore`` returns is its position; ``lr`` is kept to check that;
- ``config``: the options that shape the run; resuming with other ones is refused.

No step depends on anything else (no clock, no unseeded randomness), and the ranks
reduce in a fixed order, so a run that crashed and resumed, any number of times,
ends with weights, momentum, generator, learning rate and loss history bit-identical
to an uninterrupted run on the same number of ranks.

    mpirun -n 2 python examples/sgd_training.py --ckpt-dir ckpt --every 100 --out sgd.npz
    sbatch examples/sgd_training.sbatch        # under Slurm, through the hpcckpt wrapper
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import hpcckpt


def band(n: int, nranks: int, rank: int) -> tuple[int, int]:
    """Items [lo, hi) owned by ``rank`` when ``n`` items are split as evenly as possible."""
    base, extra = divmod(n, nranks)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def make_data(seed: int, samples: int, inputs: int) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic data set: a fixed random teacher network plus noise."""
    rng = np.random.default_rng([seed, 0])
    x = rng.standard_normal((samples, inputs))
    w_teacher = rng.standard_normal((inputs, 8)) / math.sqrt(inputs)
    v_teacher = rng.standard_normal(8)
    y = np.tanh(x @ w_teacher) @ v_teacher + 0.05 * rng.standard_normal(samples)
    return x, y


class Model:
    """Views of the flat parameter vector ``theta`` as W1, b1, w2, b2."""

    def __init__(self, inputs: int, hidden: int) -> None:
        self.shapes = {"W1": (inputs, hidden), "b1": (hidden,), "w2": (hidden,), "b2": ()}
        self.size = sum(math.prod(s) for s in self.shapes.values())

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            out[name] = flat[at : at + n].reshape(shape)
            at += n
        return out

    def init(self, theta: np.ndarray, seed: int) -> None:
        rng = np.random.default_rng([seed, 1])
        p = self.views(theta)
        p["W1"][...] = rng.standard_normal(p["W1"].shape) / math.sqrt(p["W1"].shape[0])
        p["w2"][...] = rng.standard_normal(p["w2"].shape) / math.sqrt(p["w2"].shape[0])

    def loss_and_grad(
        self, theta: np.ndarray, x: np.ndarray, y: np.ndarray, grad: np.ndarray
    ) -> float:
        """Sum over the rows of 0.5 (prediction - y)^2; its gradient goes into ``grad``."""
        p, g = self.views(theta), self.views(grad)
        a = np.tanh(x @ p["W1"] + p["b1"])
        r = a @ p["w2"] + p["b2"] - y
        dz = np.outer(r, p["w2"]) * (1.0 - a * a)
        g["W1"][...] = x.T @ dz
        g["b1"][...] = dz.sum(axis=0)
        g["w2"][...] = a.T @ r
        g["b2"][...] = r.sum()
        return 0.5 * float(r @ r)


def learning_rate(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to zero at ``total``."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1.0 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=640, help="SGD steps (minibatches)")
    p.add_argument("--samples", type=int, default=2048, help="size of the data set")
    p.add_argument("--inputs", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=64, help="global minibatch size")
    p.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=20, help="steps of linear warm-up")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument(
        "--ckpt-dir", default=os.environ.get("HPCCKPT_DIR"), help="default: $HPCCKPT_DIR"
    )
    p.add_argument("--interval", type=float, default=None, help="seconds between checkpoints")
    p.add_argument("--every", type=int, default=None, help="checkpoint every N steps")
    p.add_argument(
        "--sleep", type=float, default=0.0, help="seconds of extra work per step (demos)"
    )
    p.add_argument("--crash-at", type=int, default=None, help="rank 1 dies at this step (tests)")
    p.add_argument("--out", default=None, help="write the final state here (.npz)")
    args = p.parse_args()
    if not 0 < args.batch <= args.samples:
        p.error("--batch must be between 1 and --samples")

    comm = MPI.COMM_WORLD
    rank, nranks = comm.Get_rank(), comm.Get_size()
    x, y = make_data(args.seed, args.samples, args.inputs)
    model = Model(args.inputs, args.hidden)
    per_epoch = args.samples // args.batch  # the last partial batch of an epoch is dropped
    lo, hi = band(args.batch, nranks, rank)  # this rank's share of every minibatch

    config = {
        k: getattr(args, k)
        for k in (
            "steps",
            "samples",
            "inputs",
            "hidden",
            "batch",
            "lr",
            "warmup",
            "momentum",
            "seed",
        )
    }
    theta = np.zeros(model.size)
    model.init(theta, args.seed)
    state = {
        "theta": theta,
        "velocity": np.zeros(model.size),
        "rng": np.random.default_rng([args.seed, 2]),  # the same on every rank
        "perm": np.arange(args.samples, dtype=np.int64),
        "epoch_loss": 0.0,
        "history": [],
        "lr": 0.0,
        "config": dict(config),
    }

    ck = hpcckpt.Checkpointer(
        args.ckpt_dir, comm=comm, interval=args.interval, every_steps=args.every
    )
    last = ck.restore(state)  # arrays, the list and the generator in place; scalars replaced
    if state["config"] != config:
        if rank == 0:
            print(
                f"sgd_training: {args.ckpt_dir} holds a run with {state['config']}, "
                f"not {config}; use another --ckpt-dir",
                file=sys.stderr,
            )
        ck.close()
        sys.exit(2)  # every rank restored the same config, so every rank leaves here
    start = 0 if last is None else last + 1
    if last is not None:
        assert state["lr"] == learning_rate(last, args.steps, args.lr, args.warmup)

    theta, velocity, perm = state["theta"], state["velocity"], state["perm"]
    buf = np.empty(model.size + 1)  # this rank's gradient sum and loss sum, reduced at once
    total = np.empty_like(buf)
    for step in range(start, args.steps):
        epoch, batch = divmod(step, per_epoch)
        if batch == 0:
            perm[...] = state["rng"].permutation(args.samples)
            state["epoch_loss"] = 0.0
        idx = perm[batch * args.batch + lo : batch * args.batch + hi]
        buf[-1] = model.loss_and_grad(theta, x[idx], y[idx], buf[:-1])
        comm.Allreduce(buf, total, op=MPI.SUM)
        total /= args.batch
        lr = learning_rate(step, args.steps, args.lr, args.warmup)
        velocity *= args.momentum
        velocity += total[:-1]
        theta -= lr * velocity
        state["lr"] = lr
        state["epoch_loss"] += float(total[-1])
        if batch == per_epoch - 1:
            state["history"].append(state["epoch_loss"] / per_epoch)
            if rank == 0 and (epoch % 10 == 0 or step == args.steps - 1):
                print(f"sgd_training: epoch {epoch} loss {state['history'][-1]:.5f} lr {lr:.4g}")
        if args.sleep:
            time.sleep(args.sleep)
        if args.crash_at is not None and step == args.crash_at and rank == min(1, nranks - 1):
            os._exit(17)
        if ck.due(step):
            ck.save(step, state)
            if ck.stop_requested:
                break
    else:
        ck.finish()
        digest = hashlib.sha256(theta.tobytes() + velocity.tobytes()).hexdigest()
        if len(set(comm.allgather(digest))) != 1:
            sys.exit("sgd_training: the replicas of the parameters differ between ranks")
        if rank == 0:
            hist = state["history"]
            first, final = (hist[0], hist[-1]) if hist else (math.nan, math.nan)
            print(
                f"sgd_training: {args.steps} steps, {len(hist)} epochs on {nranks} ranks: "
                f"loss {first:.5f} -> {final:.5f}, sha256 {digest[:16]}"
            )
            if args.out:
                np.savez(
                    args.out,
                    theta=theta,
                    velocity=velocity,
                    perm=perm,
                    history=np.array(hist, dtype=np.float64),
                    epoch_loss=np.float64(state["epoch_loss"]),
                    lr=np.float64(state["lr"]),
                    rng=np.array(json.dumps(state["rng"].bit_generator.state, sort_keys=True)),
                )


if __name__ == "__main__":
    main()
