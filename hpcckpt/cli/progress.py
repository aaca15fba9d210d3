"""Progress for long CLI operations, on a terminal only (never in logs, pipes or --json)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

import click

T = TypeVar("T")


def progress(items: Iterable[T], label: str, *, length: int | None = None) -> Iterator[T]:
    """Yield ``items``, drawing a bar on stderr when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield from items
        return
    with click.progressbar(items, length=length, label=label, file=sys.stderr) as bar:
        yield from bar
