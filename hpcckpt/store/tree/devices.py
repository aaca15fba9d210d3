"""Tensors on a GPU (or any device other than the CPU): what differs from a CPU tensor.

The store reads and writes host memory only. A save copies a device tensor into host
memory first: for CUDA into a pinned buffer (a DMA copy, no pageable bounce), issued on
the tensor's current stream so that it runs after every kernel already queued there,
and waited for through an event, so the bytes saved are the tensor's values at
``save()`` even while later work is queued. A restore copies the host values back onto
the tensor's own device, in place, on the same stream, and waits for the copy before
the host buffer is released. Tensors on the ``meta`` device hold no values: refused.

torch is imported only once a tensor is in hand (``import hpcckpt`` stays torch-free).
This is the one module that knows about devices; ``store/tensors.py`` calls it.
"""

from __future__ import annotations

from typing import Any

#: Devices that hold no values to save.
VALUELESS = frozenset({"meta"})


def _torch() -> Any:
    import torch  # only reached with a tensor in hand

    return torch


def on_host(tensor: Any) -> bool:
    """Whether ``tensor``'s memory is host memory numpy can share (the CPU device)."""
    return tensor.device.type == "cpu"


def unsupported(tensor: Any) -> str | None:
    """Why a tensor on this device cannot be checkpointed, or None."""
    kind = tensor.device.type
    if kind in VALUELESS:
        return (
            f"a tensor on the {kind} device has no values to save; materialize it first "
            "(e.g. module.to_empty(device=...) and load or initialize its weights)"
        )
    return None


def _refuse(tensor: Any) -> None:
    why = unsupported(tensor)
    if why is not None:
        raise TypeError(why)


def pinned(tensor: Any) -> bool:
    """Whether host copies of ``tensor`` go through pinned (page-locked) memory: a CUDA
    tensor while CUDA is usable."""
    return tensor.device.type == "cuda" and _torch().cuda.is_available()


def to_host(tensor: Any) -> Any:
    """A CPU tensor holding ``tensor``'s values as they are now (detached).

    A CPU tensor is returned as itself (no copy). A CUDA tensor is copied into a new
    pinned buffer on its current stream and the copy is waited for with an event;
    torch's caching host allocator reuses pinned buffers freed by earlier saves. Any
    other device is copied with a plain synchronous ``copy_``.
    """
    t = tensor.detach()
    if on_host(t):
        return t
    _refuse(t)
    torch = _torch()
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned(t))
    if pinned(t):
        stream = torch.cuda.current_stream(t.device)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # the bytes in `host` are the values at this call
    else:
        host.copy_(t)
    return host


def copy_back(tensor: Any, source: Any) -> None:
    """Overwrite ``tensor`` (any device, any strides) in place with the CPU tensor
    ``source`` of the same number of elements; returns once ``source`` may be freed."""
    torch = _torch()
    src = source.reshape(tensor.shape)
    with torch.no_grad():
        if on_host(tensor):
            tensor.copy_(src)
            return
        _refuse(tensor)
        if pinned(tensor):
            stream = torch.cuda.current_stream(tensor.device)
            with torch.cuda.stream(stream):
                tensor.copy_(src, non_blocking=src.is_pinned())
                done = torch.cuda.Event()
                done.record(stream)
            done.synchronize()  # `source` is host memory the caller frees next
        else:
            tensor.copy_(src)


def to_device(tensor: Any, device: Any) -> Any:
    """``tensor`` (a CPU tensor) on ``device`` (None or the CPU: itself)."""
    if device is None:
        return tensor
    torch = _torch()
    target = torch.device(device)
    if target.type == "cpu":
        return tensor
    if target.type in VALUELESS:
        raise TypeError(
            f"cannot restore a tensor onto the {target.type} device: it holds no values"
        )
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device=target)
    copy_back(out, tensor)
    return out
