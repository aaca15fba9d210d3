"""Which checkpoints the mirror keeps: the newest N, milestones, and thinning by age.

Rules (all optional; a checkpoint stays when any rule keeps it, and with no rule at all
nothing is deleted):

- ``mirror_keep_last=N``: the N newest good mirrored checkpoints;
- ``mirror_keep_every=K``: milestones, one per window of K steps (the oldest good one
  of each window, so it stays as newer ones arrive);
- ``mirror_thinning``: tiers by age, e.g. ``"6h:all,7d:1d,*:1w"`` keeps every
  checkpoint younger than 6 hours, one a day among those younger than 7 days and one a
  week beyond (``*``: any age; without a ``*`` tier, checkpoints older than the last tier
  are not kept by this rule). Windows are calendar-free: ``floor(time / spacing)``.

The newest good checkpoint always stays, and whatever a kept checkpoint is built on
(its chain) stays with it. Bad or incomplete copies are deleted only with
``delete_bad``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from hpcckpt.store.retention import Candidate, newest_good, one_per_window, with_chains

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """Seconds of "90s", "30m", "6h", "7d", "2w" or a plain number of seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([smhdw]?)\s*", str(text))
    if match is None:
        raise ValueError(f"{text!r} is not a duration; write e.g. 90s, 30m, 6h, 7d or 2w")
    value = float(match.group(1)) * _UNITS[match.group(2) or "s"]
    if value <= 0:
        raise ValueError(f"duration {text!r} must be more than zero")
    return value


@dataclass(frozen=True)
class Tier:
    """Checkpoints younger than ``max_age`` seconds (inf: any) keep one per ``spacing``
    seconds (0: every one)."""

    max_age: float
    spacing: float


def parse_thinning(text: str) -> tuple[Tier, ...]:
    """The tiers of a thinning rule like ``"6h:all,7d:1d,*:1w"``, youngest first."""
    tiers = []
    for part in str(text).split(","):
        age, sep, keep = part.strip().partition(":")
        if not sep:
            raise ValueError(
                f"mirror_thinning {text!r}: each tier is AGE:KEEP, e.g. '6h:all,7d:1d,*:1w' "
                "(every checkpoint of the last 6 hours, one a day for a week, one a week after)"
            )
        max_age = math.inf if age.strip() == "*" else parse_age(age)
        spacing = 0.0 if keep.strip() == "all" else parse_age(keep)
        tiers.append(Tier(max_age, spacing))
    if [t.max_age for t in tiers] != sorted(t.max_age for t in tiers) or len(
        {t.max_age for t in tiers}
    ) != len(tiers):
        raise ValueError(f"mirror_thinning {text!r}: list the tiers youngest first, each once")
    return tuple(tiers)


def check_rules(
    keep_last: int | None, keep_every: int | None, thinning: str | None
) -> tuple[Tier, ...] | None:
    """ValueError for a rule that makes no sense; the thinning's tiers (None: no thinning)."""
    for name, value in (("mirror_keep_last", keep_last), ("mirror_keep_every", keep_every)):
        if value is not None and (isinstance(value, bool) or int(value) != value or value < 1):
            raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return None if thinning is None else parse_thinning(thinning)


def steps_to_keep(
    candidates: Iterable[Candidate],
    now: float,
    keep_last: int | None = None,
    keep_every: int | None = None,
    thinning: str | None = None,
    delete_bad: bool = False,
) -> set[int]:
    """The steps among the mirror's ``candidates`` the rules above keep at time ``now``."""
    tiers = check_rules(keep_last, keep_every, thinning)
    all_ = sorted(candidates, key=lambda c: c.step)
    if keep_last is None and keep_every is None and tiers is None:
        return {c.step for c in all_}
    good, keep = newest_good(all_, keep_last, delete_bad)
    if keep_every is not None:
        keep |= one_per_window(good, keep_every, "step")
    if tiers is not None:
        seen_tier: set[tuple[int, int]] = set()
        for c in sorted(good, key=lambda c: (c.time, c.step)):  # oldest first
            age = now - c.time
            index = next((i for i, t in enumerate(tiers) if age < t.max_age), None)
            if index is None:
                continue
            tier = tiers[index]
            if tier.spacing == 0:
                keep.add(c.step)
                continue
            window = (index, math.floor(c.time / tier.spacing))
            if window not in seen_tier:
                seen_tier.add(window)
                keep.add(c.step)
    return with_chains(all_, keep)
