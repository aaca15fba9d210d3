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

An asynchronous save lends :func:`to_host` its own host buffers (:func:`host_buffers`):
the device-to-host copy then goes straight into memory kept from save to save (pinned
for CUDA), which is the save's staged copy: no allocation after the first save, and no
second host copy.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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
    return tensor.device.type == "cuda" and _cuda_usable()


@functools.cache
def _cuda_usable() -> bool:
    """Whether CUDA is usable in this process (asked once: it is asked per tensor)."""
    return bool(_torch().cuda.is_available())


@dataclass(frozen=True)
class _Lender:
    lend: Callable[[Any], Any]
    copy: Callable[[Any, Any], None] | None
    cpu: bool
    #: The CUDA streams holding device-to-host copies issued in the block and not yet
    #: waited for.
    pending: list[Any] = field(default_factory=list)


#: Inside :func:`host_buffers`: where :func:`to_host` copies a device tensor.
_LENDER: contextvars.ContextVar[_Lender | None] = contextvars.ContextVar(
    "hpcckpt_host_lender", default=None
)


@contextlib.contextmanager
def host_buffers(
    lend: Callable[[Any], Any],
    copy: Callable[[Any, Any], None] | None = None,
    cpu: bool = False,
) -> Iterator[None]:
    """Within the block, :func:`to_host` copies a device tensor into ``lend(tensor)``:
    a CPU tensor of the same shape and dtype (from :func:`empty_host`, kept by the
    caller between saves), or None for a new buffer of its own.

    ``copy(tensor, host)``, when given, does the copy into a lent buffer instead of a
    whole copy (it may copy only what changed since the buffer's last copy). ``cpu``:
    CPU tensors are copied into lent buffers too (tests of the device path on a CPU).

    The block's CUDA copies are issued without waiting for each: the host bytes are
    there only after :func:`settle` (or the block's end, which settles). Issuing them
    all first keeps the copy engine busy while Python walks the state.
    """
    token = _LENDER.set(_Lender(lend, copy, cpu))
    try:
        yield
    finally:
        try:
            settle()
        finally:
            _LENDER.reset(token)


def settle() -> None:
    """Wait for the device-to-host copies issued so far inside :func:`host_buffers`: the
    host buffers then hold the values the tensors had when their copies were issued."""
    lender = _LENDER.get()
    if lender is None:
        return
    streams = {id(s): s for s in lender.pending}
    lender.pending.clear()
    for stream in streams.values():  # one event per stream covers every copy on it
        _wait(stream)


def _wait(stream: Any) -> None:
    """Return once the work queued on ``stream`` so far is done."""
    done = _torch().cuda.Event()
    done.record(stream)
    done.synchronize()


def _issued(stream: Any) -> None:
    """A CUDA copy queued on ``stream``: waited for now, or at :func:`settle` inside
    :func:`host_buffers`."""
    lender = _LENDER.get()
    if lender is None:
        _wait(stream)
    else:
        lender.pending.append(stream)


def empty_host(tensor: Any) -> Any:
    """A new CPU tensor of ``tensor``'s shape and dtype, pinned when the copies of
    ``tensor`` go through pinned memory (:func:`pinned`). Pinned memory is allocated
    with ``tensor``'s GPU current (from any thread: a new thread's current GPU is the
    first, where the allocation would otherwise make a context of its own)."""
    torch = _torch()
    if not pinned(tensor):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
    with torch.cuda.device(tensor.device):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)


def to_host(tensor: Any, out: Any = None) -> Any:
    """A CPU tensor holding ``tensor``'s values as they are now (detached).

    A CPU tensor is returned as itself (no copy). Another device's tensor is copied into
    ``out`` (a CPU tensor of its shape and dtype), else into the buffer lent by the
    enclosing :func:`host_buffers` (by its ``copy`` when it has one), else into a new
    one (:func:`empty_host`): for CUDA a pinned buffer, the copy issued on the tensor's
    current stream and waited for with an event; any other device with a plain
    synchronous ``copy_``.
    """
    t = tensor.detach()
    lender = _LENDER.get()
    if on_host(t) and (lender is None or not lender.cpu or out is not None):
        return t
    _refuse(t)
    host = out
    if host is None and lender is not None:
        host = lender.lend(t)
        if host is not None and lender.copy is not None:
            _check_fit(host, t)
            lender.copy(t, host)
            return host
    if host is None:
        host = empty_host(t)
    _check_fit(host, t)
    copy_to_host(t, host)
    return host


def copy_to_host(tensor: Any, host: Any) -> None:
    """Copy every value of ``tensor`` (any device, any strides) into ``host`` (a CPU
    tensor of its shape and dtype); returns once they are there, or inside
    :func:`host_buffers` once they are issued (:func:`settle`). For CUDA the copy is
    issued on the tensor's current stream and waited for with an event."""
    if pinned(tensor):
        torch = _torch()
        stream = torch.cuda.current_stream(tensor.device)
        host.copy_(tensor, non_blocking=True)  # on `stream`: the source device's current
        _issued(stream)  # the bytes in `host` are the values at this call
    else:
        host.copy_(tensor)


def _check_fit(host: Any, t: Any) -> None:
    if tuple(host.shape) != tuple(t.shape) or host.dtype != t.dtype or not on_host(host):
        raise ValueError(
            f"host buffer {host.dtype}{list(host.shape)} on {host.device} does not fit "
            f"a tensor {t.dtype}{list(t.shape)}"
        )


def copy_runs(flat: Any, host: Any, runs: list[tuple[int, int]]) -> None:
    """Copy the element ranges ``runs`` of ``flat`` (a 1-d contiguous tensor, any device)
    into the same ranges of ``host`` (a contiguous CPU tensor of as many elements);
    returns once the bytes are there, or inside :func:`host_buffers` once they are issued
    (:func:`settle`). For CUDA the copies are issued on the tensor's current stream,
    after the kernels queued there, and waited for with one event."""
    dst = host.view(-1)
    if not pinned(flat):
        for a, b in runs:
            dst[a:b].copy_(flat[a:b])
        return
    torch = _torch()
    stream = torch.cuda.current_stream(flat.device)
    if len(runs) == 1 and runs[0] == (0, flat.numel()):
        dst.copy_(flat, non_blocking=True)  # on `stream`: the source device's current
    else:
        for a, b in runs:
            dst[a:b].copy_(flat[a:b], non_blocking=True)
    _issued(stream)


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
