"""How saves become incremental: block size, chain bounds, change detection."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hpcckpt.store.io import blocks
from hpcckpt.store.save import change_detection as detection


@dataclass(frozen=True)
class IncrementalOptions:
    """Incremental saves (docs/format.md, "Incremental checkpoints").

    ``incremental``: write only the blocks of ``block_size`` bytes changed since the
    last checkpoint; a full one follows ``max_chain`` incrementals, or once they pass
    ``max_chain_fraction`` of a full one's bytes, or when a delta would leave out fewer
    than ``min_delta_saving`` bytes per array and rank. ``change_detection``: how a
    synchronous save finds the changed blocks, "kernel", "hashes" or "auto".
    """

    incremental: bool = True
    block_size: int | None = blocks.DEFAULT_BLOCK_SIZE
    max_chain: int = 8
    max_chain_fraction: float = 0.5
    min_delta_saving: int | None = blocks.DEFAULT_MIN_DELTA_SAVING
    change_detection: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size is None:  # None: the default, as the Checkpointer documents it
            object.__setattr__(self, "block_size", blocks.DEFAULT_BLOCK_SIZE)
        if self.min_delta_saving is None:
            object.__setattr__(self, "min_delta_saving", blocks.DEFAULT_MIN_DELTA_SAVING)
        object.__setattr__(self, "block_size", blocks.check_block_size(self.block_size))
        object.__setattr__(self, "incremental", bool(self.incremental))
        detection.check_mode(self.change_detection)
        self.chain_policy  # noqa: B018 (checks the chain's bounds)

    @property
    def chain_policy(self) -> blocks.ChainPolicy:
        """When a save may be a delta and when the chain restarts (:class:`.ChainPolicy`,
        which takes the fields it declares from these options)."""
        wanted = (f.name for f in dataclasses.fields(blocks.ChainPolicy))
        return blocks.ChainPolicy(**{name: getattr(self, name) for name in wanted})


@dataclass(frozen=True)
class Modes:
    """The permissions of what the store creates: files and directories."""

    file: int
    directory: int
