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
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from hpcckpt.store.io.options import FileOptions
from hpcckpt.store.mirror.options import MirrorOptions
from hpcckpt.store.retention import RetentionOptions
from hpcckpt.store.save.options import IncrementalOptions
from hpcckpt.store.tier.options import TierOptions
from hpcckpt.store.tree.options import ArrayOptions, Split

__all__ = [
    "ArrayOptions",
    "FileOptions",
    "IncrementalOptions",
    "MirrorOptions",
    "RetentionOptions",
    "Split",
    "StoreOptions",
    "TierOptions",
    "fields_of",
    "route",
]

T = TypeVar("T")


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
