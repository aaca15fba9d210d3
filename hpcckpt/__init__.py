"""hpcckpt: coordinated checkpoint/restart for MPI jobs on Slurm.

The package imports lazily: ``import hpcckpt`` is cheap, and MPI, h5py and numpy
load only when :class:`Checkpointer` is first touched, so the command-line wrapper
can install its signal handlers before any heavy import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpcckpt._version import __version__

if TYPE_CHECKING:
    from hpcckpt.coord.checkpointer import Checkpointer

__all__ = ["CheckpointRejected", "Checkpointer", "PoisonedState", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Checkpointer":
        from hpcckpt.coord.checkpointer import Checkpointer

        return Checkpointer
    if name in ("PoisonedState", "CheckpointRejected"):  # the poisoned-state guard
        from hpcckpt.coord import validate

        return getattr(validate, name)
    raise AttributeError(f"module 'hpcckpt' has no attribute {name!r}")
