"""torch tensors as numpy arrays and back, importing torch only once a tensor is seen.

A tensor is stored as a plain HDF5 dataset of its elements. Dtypes numpy has (float32,
int64, bool, uint16...) are stored as themselves; dtypes numpy lacks (bfloat16, the
float8 kinds, complex32) are stored as their raw bits in an unsigned integer of the same
width, and the dataset's attribute ``torch_dtype`` names the torch dtype (docs/format.md).
Nothing here imports torch at module level: ``import hpcckpt`` must stay torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hpcckpt.store.tree import devices

#: Unsigned integer dtype holding the raw bits of an element of each size (bytes).
_RAW = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.Tensor`` (or a subclass such as ``nn.Parameter``),
    told by its type's module so that torch is never imported to ask."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(value).__mro__)


def dtype_name(tensor: Any) -> str:
    """The torch dtype without its ``torch.`` prefix: ``"bfloat16"``, ``"float32"``..."""
    return str(tensor.dtype).removeprefix("torch.")


def _torch() -> Any:
    import torch  # only ever reached with a tensor in hand, so torch is installed

    return torch


def _host(tensor: Any) -> Any:
    """A detached CPU tensor of ``tensor``'s values, with conjugate/negative bits resolved
    (another device's through host staging: :func:`.tree.devices.to_host`)."""
    return devices.to_host(tensor).resolve_conj().resolve_neg()


def check_supported(tensor: Any) -> str | None:
    """Why ``tensor`` cannot be checkpointed (sparse, quantized...), or None."""
    if tensor.layout != _torch().strided:
        return f"a {tensor.layout} tensor is not supported; convert it with .to_dense()"
    if tensor.is_quantized:
        return "a quantized tensor is not supported; save .dequantize() or its int_repr()"
    if tensor.device.type == "meta":
        return "a tensor on the meta device has no values to save"
    if tensor.element_size() not in (*_RAW, 16):
        return f"torch dtype {dtype_name(tensor)} has no byte-sized elements"
    return None


def to_array(tensor: Any) -> np.ndarray:
    """The tensor's elements as a numpy array sharing its memory when it is on the CPU
    (strided views stay views); raw unsigned bits for dtypes numpy lacks."""
    t = _host(tensor)
    try:
        return t.numpy()
    except TypeError:  # bfloat16, float8, complex32: numpy has no such dtype
        raw = _RAW[t.element_size()]
        return t.view(getattr(_torch(), f"int{8 * raw.itemsize}")).numpy().view(raw)


def storage_dtype(torch_dtype: str) -> np.dtype:
    """The numpy dtype a tensor of ``torch_dtype`` is stored as."""
    torch = _torch()
    dt = getattr(torch, torch_dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {torch_dtype!r}")
    return to_array(torch.empty(0, dtype=dt)).dtype


def from_array(
    array: np.ndarray, torch_dtype: str, requires_grad: bool = False, device: Any = None
) -> Any:
    """A new tensor of ``torch_dtype`` holding ``array``'s elements: on the CPU (sharing
    the array's memory when it is writable and C-contiguous), or copied onto ``device``."""
    torch = _torch()
    dt = getattr(torch, torch_dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown torch dtype {torch_dtype!r} in the checkpoint")
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, order="C")
    if array.dtype.kind == "u" and array.dtype.itemsize > 1 and not _numpy_has(dt):
        signed = array.view(array.dtype.str.replace("u", "i"))
        t = torch.from_numpy(signed).view(dt)
    else:
        t = torch.from_numpy(array)
        if t.dtype != dt:
            t = t.view(dt)
    t = devices.to_device(t, device)
    if requires_grad and t.is_floating_point():
        t.requires_grad_(True)
    return t


def _numpy_has(dt: Any) -> bool:
    try:
        _torch().empty(0, dtype=dt).numpy()
    except TypeError:
        return False
    return True


def writable_view(tensor: Any) -> np.ndarray | None:
    """A C-contiguous numpy view of a CPU tensor's memory to read a restore into, or None
    when it has none (another device, a strided view, a conjugate view)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    if tensor.is_conj() or tensor.is_neg() or check_supported(tensor) is not None:
        return None
    view = to_array(tensor)
    return view if view.flags.c_contiguous and view.flags.writeable else None


def shares_memory(tensor: Any, array: np.ndarray) -> bool:
    """Whether ``array`` is exactly ``tensor``'s memory (a restore read straight into it)."""
    if tensor.device.type != "cpu" or not array.size:
        return False
    start = array.__array_interface__["data"][0]
    return start == tensor.data_ptr() and array.nbytes == tensor.numel() * tensor.element_size()


def copy_into(tensor: Any, array: np.ndarray) -> None:
    """Overwrite ``tensor``'s elements in place (any device, any strides) with ``array``'s."""
    devices.copy_back(tensor, from_array(array, dtype_name(tensor)))


def nbytes(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor`` (FSDP2's parameters and
    optimizer moments, tensor parallelism), told by its type without importing torch."""
    return any(
        c.__name__ == "DTensor" and c.__module__.startswith("torch.distributed")
        for c in type(value).__mro__
    )


def local_part(dtensor: Any) -> Any:
    """The tensor a DTensor holds on this rank (its local shard), sharing its memory."""
    with _torch().no_grad():
        return dtensor.to_local()
