"""store/tree/devices.py on the CPU: what the adapter does with CPU tensors, and the errors
for devices that hold no values. The CUDA path runs in benchmarks/gpu_check.py on a GPU
(this build of torch has no CUDA); everything else of the adapter is tested here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpcckpt.store.tree import devices, tensors


def test_a_cpu_tensor_is_its_own_host_copy():
    t = torch.arange(6.0).reshape(2, 3)
    host = devices.to_host(t)
    assert host.data_ptr() == t.data_ptr() and not host.requires_grad
    p = torch.nn.Parameter(torch.ones(3))
    assert devices.to_host(p).data_ptr() == p.data_ptr() and not devices.to_host(p).requires_grad


def test_host_copies_are_not_pinned_without_cuda():
    assert not devices.pinned(torch.ones(2))
    assert devices.on_host(torch.ones(2)) and not devices.on_host(torch.ones(2, device="meta"))


def test_copy_back_fills_a_strided_cpu_tensor_in_place():
    base = torch.zeros(4, 6)
    view = base[:, ::2]  # not contiguous
    ptr = view.data_ptr()
    devices.copy_back(view, torch.arange(12.0))
    assert view.data_ptr() == ptr
    assert torch.equal(base[:, ::2], torch.arange(12.0).reshape(4, 3))
    assert torch.equal(base[:, 1::2], torch.zeros(4, 3))


def test_copy_into_goes_through_the_adapter_for_parameters():
    p = torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.bfloat16))
    ptr = p.data_ptr()
    want = torch.tensor([[1.5, -2.0], [3.0, 0.25]], dtype=torch.bfloat16)
    tensors.copy_into(p, tensors.to_array(want))
    assert p.data_ptr() == ptr and p.requires_grad
    assert torch.equal(p.detach().view(torch.int16), want.view(torch.int16))


def test_from_array_on_the_cpu_shares_memory_and_device_none_is_the_cpu():
    a = np.arange(4, dtype=np.float32)
    for device in (None, "cpu", torch.device("cpu")):
        t = tensors.from_array(a, "float32", device=device)
        assert t.device.type == "cpu" and t.data_ptr() == a.ctypes.data


@pytest.mark.parametrize("call", ["to_host", "copy_back"])
def test_meta_tensors_are_refused_with_the_fix(call):
    meta = torch.empty(3, device="meta")
    with pytest.raises(TypeError, match="meta device has no values to save.*to_empty"):
        if call == "to_host":
            devices.to_host(meta)
        else:
            devices.copy_back(meta, torch.zeros(3))
    assert "meta" in devices.unsupported(meta) and devices.unsupported(torch.ones(1)) is None


def test_restoring_onto_the_meta_device_is_refused():
    with pytest.raises(TypeError, match="onto the meta device"):
        tensors.from_array(np.zeros(2, np.float32), "float32", device="meta")


def test_a_meta_tensor_in_a_state_is_refused_by_name():
    from hpcckpt.store.tree.state_tree import encode

    with pytest.raises(TypeError, match=r"state\['w'\].*meta device"):
        encode({"w": torch.empty(2, device="meta")})


def test_lent_buffers_take_cpu_tensors_only_when_asked_and_the_lenders_copy_runs():
    t = torch.arange(10.0)
    lent, copied = [], []

    def lend(tensor):
        lent.append(devices.empty_host(tensor))
        return lent[-1]

    with devices.host_buffers(lend, lambda src, host: copied.append(host) or host.copy_(src)):
        assert devices.to_host(t).data_ptr() == t.data_ptr()  # a CPU tensor: itself
    assert lent == [] and copied == []
    with devices.host_buffers(
        lend, lambda src, host: copied.append(host) or host.copy_(src), cpu=True
    ):
        host = devices.to_host(t)
        assert devices.to_host(t, out=torch.empty(10)).data_ptr() == t.data_ptr()  # as before
    assert host is lent[0] is copied[0] and host.data_ptr() != t.data_ptr()
    assert torch.equal(host, t)


def test_copy_runs_copies_only_the_ranges_given():
    src = torch.arange(12, dtype=torch.int16)
    host = torch.full((3, 4), -1, dtype=torch.int16)
    devices.copy_runs(src, host, [(1, 3), (8, 12)])
    want = torch.tensor([-1, 1, 2, -1, -1, -1, -1, -1, 8, 9, 10, 11], dtype=torch.int16)
    assert torch.equal(host.reshape(-1), want)
