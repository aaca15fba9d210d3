"""The node-local tier's settings: its directory, its redundancy, this rank's node."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from hpcckpt.store.tier import redundancy as schemes


@dataclass(frozen=True)
class TierOptions:
    """The node-local tier: ``cache`` (a node-local directory; None: no tier), its
    redundancy across nodes (``"partner"``, ``"xor"`` or None) over sets of
    ``redundancy_set`` ranks on distinct nodes, and this rank's node (``node_name``:
    the failure group; default the host name)."""

    cache: str | os.PathLike[str] | None = None
    redundancy: str | None = None
    redundancy_set: int | None = schemes.DEFAULT_SET_SIZE
    node_name: str | None = None

    def __post_init__(self) -> None:
        if self.redundancy_set is None:
            object.__setattr__(self, "redundancy_set", schemes.DEFAULT_SET_SIZE)
        schemes.check_scheme(self.redundancy, self.redundancy_set)
        object.__setattr__(self, "redundancy_set", int(self.redundancy_set))
        if self.cache is not None:
            object.__setattr__(self, "cache", Path(self.cache).absolute())

    @property
    def path(self) -> Path | None:
        """The node-local directory, absolute (None: no node-local tier)."""
        return self.cache  # type: ignore[return-value]  (made an absolute Path above)
