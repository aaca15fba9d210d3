"""hpcckpt.training: random states and data positions resumed exactly, mid-epoch, with
data loaders that have worker processes (torch and torchdata installed by make setup)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch.utils.data import DataLoader, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from hpcckpt.store.store import CheckpointStore
from hpcckpt.training import ResumableSampler, RNGState


@pytest.fixture
def store(tmp_path):
    return CheckpointStore(tmp_path / "ck", MPI.COMM_WORLD)


def draws() -> tuple:
    return random.random(), float(np.random.random()), torch.rand(2).tolist()


def test_rng_state_restores_python_numpy_and_torch(store):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    draws()
    store.save(1, {"rng": RNGState()})
    expected = draws()
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    store.restore({"rng": RNGState()})
    assert draws() == expected


def test_rng_state_without_cuda_records_no_cuda_generators(store):
    assert not torch.cuda.is_available()  # this CPU build; gpu_check.py covers CUDA
    assert "cuda" not in RNGState().state_dict()


def test_rng_state_refuses_cuda_generators_of_more_devices_than_it_sees():
    saved = RNGState().state_dict()
    saved["cuda"] = [torch.get_rng_state(), torch.get_rng_state()]  # as two GPUs wrote it
    saved["cuda_devices"] = 2
    with pytest.raises(ValueError, match=r"CUDA generator states of 2 device\(s\).*sees 0"):
        RNGState().load_state_dict(saved)


@pytest.mark.parametrize("size, replicas", [(50, 1), (50, 3), (7, 4), (0, 2)])
def test_sampler_splits_like_distributed_sampler_without_shuffle(size, replicas):
    data = list(range(size))
    for rank in range(replicas):
        ours = ResumableSampler(size, replicas, rank, shuffle=False)
        theirs = DistributedSampler(data, replicas, rank, shuffle=False)
        assert list(ours) == list(theirs)
        assert len(ours) == len(theirs)


def test_sampler_shares_cover_the_dataset_every_epoch_in_a_new_order():
    samplers = [ResumableSampler(40, 4, r, seed=5) for r in range(4)]
    orders = []
    for epoch in (0, 1):
        for s in samplers:
            s.set_epoch(epoch)
        seen = [i for s in samplers for i in s]
        assert sorted(seen) == list(range(40))
        orders.append(seen)
    assert orders[0] != orders[1]


def consume(loader, sampler, batches: int) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.tolist())
        sampler.advance(len(batch))
        if len(out) == batches:
            break
    return out


def test_sampler_resumes_mid_epoch_with_worker_processes(store):
    data = torch.arange(100)
    sampler = ResumableSampler(100, 2, 1, seed=3)
    sampler.set_epoch(2)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=2)
    consume(loader, sampler, 5)  # the workers have prefetched further than that
    store.save(1, {"data": sampler})
    rest = consume(loader, sampler, 100)
    fresh = ResumableSampler(100, 2, 1, seed=3)
    store.restore({"data": fresh})
    assert (fresh.epoch, fresh.offset) == (2, 20)
    fresh.set_epoch(2)  # the loop's call at the epoch it resumes in keeps the position
    loader2 = DataLoader(data, batch_size=4, sampler=fresh, num_workers=2)
    assert consume(loader2, fresh, 100) == rest
    fresh.set_epoch(3)
    assert fresh.offset == 0 and len(fresh) == 50


def test_sampler_refuses_another_dataset_or_rank_layout():
    s = ResumableSampler(10, 2, 0)
    with pytest.raises(ValueError, match="same dataset, seed and ranks"):
        ResumableSampler(10, 3, 0).load_state_dict(s.state_dict())


def test_stateful_dataloader_with_workers_resumes_mid_epoch(store):
    data = list(range(60))

    def loader():
        g = torch.Generator().manual_seed(4)
        return StatefulDataLoader(data, batch_size=5, shuffle=True, num_workers=2, generator=g)

    dl = loader()
    it = iter(dl)
    for _ in range(4):
        next(it)
    store.save(1, {"loader": dl})
    rest = [b.tolist() for b in it]
    dl2 = loader()
    store.restore({"loader": dl2})
    assert [b.tolist() for b in dl2] == rest
    assert len(rest) == 8
