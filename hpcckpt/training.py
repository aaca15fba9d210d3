"""What a training run needs beyond its model and optimizer to resume exactly.

- :class:`RNGState`: Python's ``random``, numpy's global generator, torch's CPU
  generator and the CUDA generators of this rank, captured at save and set back at
  restore (dropout masks and shuffles then continue as if the run had never stopped);
- :class:`ResumableSampler`: a ``DistributedSampler`` that knows its position in the
  epoch, so that a run resumed in the middle of an epoch continues with the next batch,
  not the epoch's first, whatever the data loader's worker processes had prefetched.

Both follow the ``state_dict()``/``load_state_dict()`` convention, so they stand in a
:class:`hpcckpt.Checkpointer` state like a model or an optimizer. Their state is per rank:
a checkpoint holding them restores only on the rank count that wrote it (docs/torch.md).
torch is imported only when it is already loaded by the application.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np


class RNGState:
    """This rank's global random generators as one checkpointable value.

    ``state_dict()`` holds ``python`` (``random.getstate()``), ``numpy``
    (``numpy.random.get_state()``) and, when torch is loaded, ``torch``
    (``torch.get_rng_state()``, the CPU generator) and, when CUDA is available, ``cuda``
    (``torch.cuda.get_rng_state_all()``: one generator state per visible device) with
    ``cuda_devices``, their number. ``load_state_dict`` sets each of them back; a state
    saved without torch or without CUDA leaves those generators alone, and CUDA states
    of more devices than this process sees are refused (a resume would silently draw
    other numbers on the missing devices).
    """

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": np.random.get_state(legacy=False),
        }
        torch = sys.modules.get("torch")
        if torch is not None:
            state["torch"] = torch.get_rng_state()
            if torch.cuda.is_available():
                state["cuda"] = torch.cuda.get_rng_state_all()
                state["cuda_devices"] = len(state["cuda"])
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(state["numpy"])
        if "torch" in state:
            import torch

            torch.set_rng_state(torch.as_tensor(state["torch"], dtype=torch.uint8))
        if state.get("cuda"):
            self._load_cuda(list(state["cuda"]))

    @staticmethod
    def _load_cuda(saved: list[Any]) -> None:
        import torch

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < len(saved):
            raise ValueError(
                f"RNGState: the checkpoint holds the CUDA generator states of {len(saved)} "
                f"device(s), and this process sees {have}; restore on as many GPUs "
                "(CUDA_VISIBLE_DEVICES), or leave RNGState out of the restore "
                "(restore(..., only=[...])) to start with fresh CUDA generators"
            )
        for device, rng in enumerate(saved):
            torch.cuda.set_rng_state(torch.as_tensor(rng, dtype=torch.uint8).cpu(), device)


class ResumableSampler:
    """Indices of this rank's share of a dataset, epoch by epoch, resumable mid-epoch.

    Like ``torch.utils.data.DistributedSampler`` (``drop_last=False``): each epoch the
    ``size`` indices are shuffled with ``seed`` and ``epoch`` (or kept in order), padded
    by repeating the first ones to a multiple of ``num_replicas``, and rank ``rank``
    takes every ``num_replicas``-th from position ``rank``. It also keeps ``offset``,
    the samples of this epoch the training loop has consumed: call :meth:`advance` with
    each batch's length after the step, and a sampler restored from a checkpoint yields
    the rest of the epoch. Data loader workers prefetch ahead of the loop, which is why
    the loop, not the iterator, says what was consumed.

    Use it as ``DataLoader(dataset, batch_size=B, sampler=sampler, num_workers=...)`` and
    call :meth:`set_epoch` at the start of every epoch, as with ``DistributedSampler``.
    """

    def __init__(
        self,
        size: int,
        num_replicas: int = 1,
        rank: int = 0,
        *,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if size < 0 or num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(
                f"ResumableSampler(size={size}, num_replicas={num_replicas}, rank={rank}): "
                "need size >= 0, num_replicas >= 1 and 0 <= rank < num_replicas"
            )
        self.size, self.num_replicas, self.rank = int(size), int(num_replicas), int(rank)
        self.shuffle, self.seed = bool(shuffle), int(seed)
        self.epoch = 0
        self.offset = 0

    @property
    def per_rank(self) -> int:
        """Samples of one epoch on each rank."""
        return -(-self.size // self.num_replicas)

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's indices of a whole epoch (``epoch``: the current one by default)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(self.size).tolist()
        else:
            order = list(range(self.size))
        total = self.per_rank * self.num_replicas
        if order:
            order += (order * (1 + total // len(order)))[: total - len(order)]
        return order[self.rank : total : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (from its beginning unless it is the epoch restored)."""
        if epoch != self.epoch:
            self.epoch, self.offset = int(epoch), 0

    def advance(self, n: int) -> None:
        """Record that the training loop consumed ``n`` more samples of this epoch."""
        self.offset = min(self.per_rank, self.offset + int(n))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices()[self.offset :])

    def __len__(self) -> int:
        return self.per_rank - self.offset

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "offset": self.offset,
            "size": self.size,
            "num_replicas": self.num_replicas,
            "rank": self.rank,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {k: getattr(self, k) for k in ("size", "num_replicas", "rank", "shuffle", "seed")}
        saved = {k: state[k] for k in mine}
        if saved != mine:
            raise ValueError(
                f"ResumableSampler: the checkpoint's sampler was {saved}, this one is {mine}; "
                "a data position resumes only over the same dataset, seed and ranks"
            )
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
