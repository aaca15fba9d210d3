"""The store's settings as small frozen values, checked once when made.

Each class is one concern: which arrays are split or shared across ranks
(:class:`ArrayOptions`), incremental saves (:class:`IncrementalOptions`), the files and
the file system (:class:`FileOptions`), the node-local tier (:class:`TierOptions`), the
mirror (:class:`MirrorOptions`) and retention (:class:`RetentionOptions`).
:class:`StoreOptions` bundles all but retention and
travels whole from the Checkpointer to the store to the code that uses each field.

A field's name is the keyword users pass: :func:`route` sends each keyword of
``CheckpointStore(...)`` or ``Checkpointer(...)`` to the class that owns it, so an
option added to a class is accepted by both without touching their signatures.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from hpcckpt.store import blocks, filesystem, mirror_retention, retention
from hpcckpt.store import change_detection as detection
from hpcckpt.store import redundancy as schemes
from hpcckpt.store import replicated as sharing
from hpcckpt.store.mirror_backend import check_url, parse_bandwidth
from hpcckpt.store.resharding import Split

T = TypeVar("T")


@dataclass(frozen=True)
class ArrayOptions:
    """How arrays lie across ranks.

    ``distributed``: array paths (keys joined by '/', e.g. ``"fields/u"``) split along
    axis 0 across ranks, as a collection or a mapping to a split function
    ``split(global_rows, nranks, rank) -> (lo, hi)`` (or None); stored as the global
    array, restorable on any rank count. ``replicated``: key paths whose values are the
    same on every rank: checked equal by checksum at each save, written once by rank 0.
    """

    distributed: Iterable[str] | Mapping[str, Split | None] = ()
    replicated: Iterable[str] = ()

    def __post_init__(self) -> None:
        given = self.distributed
        names = [given] if isinstance(given, str) else list(given)
        splits = dict(given) if isinstance(given, Mapping) else {}
        object.__setattr__(self, "distributed", {n: splits.get(n) for n in names})
        object.__setattr__(self, "replicated", sharing.normalize(self.replicated))
        clash = sorted(n for n in self.replicated if n in self.distributed)
        if clash:
            raise ValueError(f"{clash} declared both distributed and replicated; choose one")

    @property
    def splits(self) -> dict[str, Split | None]:
        """Each distributed array path and its split function (None: even rows)."""
        return self.distributed  # type: ignore[return-value]


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
class FileOptions:
    """The checkpoint files: the file-system tuning (``fs_tuning``, docs/filesystems.md)
    and who may read them (``share_group``: 0640/0750 instead of 0600/0700)."""

    fs_tuning: filesystem.TuningOptions | None = None
    share_group: bool = False

    @property
    def tuning(self) -> filesystem.TuningOptions:
        return self.fs_tuning or filesystem.TuningOptions()


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


@dataclass(frozen=True)
class RetentionOptions:
    """Which committed checkpoints stay (docs/format.md, "Retention"): the ``keep_last``
    newest good ones (None: all), plus one per ``keep_every`` steps and one per
    ``keep_every_seconds``; whatever a kept checkpoint is built on stays too."""

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_every_seconds: float | None = None

    def __post_init__(self) -> None:
        retention.check_rules(self.keep_last, self.keep_every, self.keep_every_seconds)


@dataclass(frozen=True)
class MirrorOptions:
    """The mirror, a second tier (docs/tiers.md): ``mirror`` is a directory on another
    file system or ``s3://bucket/prefix`` (None: no mirror). A background worker copies
    every ``mirror_every``-th committed checkpoint there or, when ``mirror_interval``
    (seconds or "30m") is set instead, the first one committed that long after the last
    one sent, at most
    ``mirror_bandwidth`` bytes/s ("500M"; None: no cap), retrying with a backoff of up to
    ``mirror_retry_max`` seconds. ``finish()`` and a stop wait up to ``mirror_wait``
    seconds for the newest checkpoint to reach it. The mirror keeps ``mirror_keep_last``
    newest, one per ``mirror_keep_every`` steps and the ``mirror_thinning`` tiers by age
    ("6h:all,7d:1d,*:1w"); with none of them it keeps everything."""

    mirror: str | os.PathLike[str] | None = None
    mirror_every: int = 1
    mirror_interval: float | str | None = None
    mirror_bandwidth: float | str | None = None
    mirror_wait: float | str = 300.0
    mirror_retry_max: float | str = 60.0
    mirror_keep_last: int | None = None
    mirror_keep_every: int | None = None
    mirror_thinning: str | None = None

    def __post_init__(self) -> None:
        if self.mirror is not None:
            object.__setattr__(self, "mirror", check_url(os.fspath(self.mirror)))
        every = self.mirror_every
        if isinstance(every, bool) or int(every) != every or every < 1:
            raise ValueError(f"mirror_every must be a positive integer, not {every!r}")
        for name in ("mirror_interval", "mirror_wait", "mirror_retry_max"):
            value = getattr(self, name)
            if value is None:
                continue
            seconds = float(value) if isinstance(value, (int, float)) else None
            if seconds is None:
                try:
                    seconds = mirror_retention.parse_age(str(value))
                except ValueError as exc:
                    raise ValueError(f"{name}={value!r}: {exc}") from None
            if seconds < 0 or (seconds == 0 and name != "mirror_wait"):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
            object.__setattr__(self, name, seconds)
        if self.mirror_bandwidth is not None:
            value = self.mirror_bandwidth
            rate = float(value) if isinstance(value, (int, float)) else parse_bandwidth(value)
            if rate <= 0:
                raise ValueError(f"mirror_bandwidth must be positive, not {value!r}")
            object.__setattr__(self, "mirror_bandwidth", rate)
        mirror_retention.check_rules(
            self.mirror_keep_last, self.mirror_keep_every, self.mirror_thinning
        )

    @property
    def url(self) -> str | None:
        """The mirror's URL or path (None: no mirror)."""
        return self.mirror  # type: ignore[return-value]


@dataclass(frozen=True)
class StoreOptions:
    """Everything a :class:`~hpcckpt.store.store.CheckpointStore` is set up with."""

    arrays: ArrayOptions = field(default_factory=ArrayOptions)
    incremental: IncrementalOptions = field(default_factory=IncrementalOptions)
    files: FileOptions = field(default_factory=FileOptions)
    tier: TierOptions = field(default_factory=TierOptions)
    mirror: MirrorOptions = field(default_factory=MirrorOptions)

    @classmethod
    def from_keywords(cls, owner: str = "CheckpointStore", **keywords: Any) -> StoreOptions:
        """The options from keywords named as the fields of the five classes."""
        parts = route(
            owner,
            keywords,
            ArrayOptions,
            IncrementalOptions,
            FileOptions,
            TierOptions,
            MirrorOptions,
        )
        return cls(*(kind(**given) for kind, given in parts.items()))


def fields_of(*classes: type) -> dict[str, type]:
    """Each keyword and the class that owns it."""
    return {f.name: kind for kind in classes for f in dataclasses.fields(kind)}


def route(owner: str, keywords: Mapping[str, Any], *classes: type[T]) -> dict[type[T], dict]:
    """``keywords`` sorted by the class that owns each (every class gets a dict, maybe
    empty); TypeError naming ``owner`` and the nearest known keyword for one no class has."""
    owners = fields_of(*classes)
    out: dict[type[T], dict] = {kind: {} for kind in classes}
    for name, value in keywords.items():
        if name not in owners:
            near = difflib.get_close_matches(name, list(owners), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}{hint}")
        out[owners[name]][name] = value  # type: ignore[index]
    return out
