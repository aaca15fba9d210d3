"""Durations as people and Slurm write them, converted to and from seconds.

Every option of hpcckpt that takes a time (``--mtbf 12h``, ``--cost 5m``,
``--work 2d``) goes through :func:`parse_duration`, so the same forms work
everywhere. Note one difference from Slurm: a bare number means *seconds* here,
whereas Slurm's ``--time 90`` means 90 minutes.
"""

from __future__ import annotations

import math
import re

__all__ = ["UNITS", "format_duration", "format_hms", "parse_duration"]

MINUTE = 60.0
HOUR = 3600.0
DAY = 86400.0
YEAR = 365.25 * DAY
"""A Julian year (365.25 days), the usual unit for component MTBF figures."""

UNITS: dict[str, float] = {
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": MINUTE,
    "min": MINUTE,
    "mins": MINUTE,
    "minute": MINUTE,
    "minutes": MINUTE,
    "h": HOUR,
    "hr": HOUR,
    "hrs": HOUR,
    "hour": HOUR,
    "hours": HOUR,
    "d": DAY,
    "day": DAY,
    "days": DAY,
    "w": 7 * DAY,
    "week": 7 * DAY,
    "weeks": 7 * DAY,
    "y": YEAR,
    "yr": YEAR,
    "yrs": YEAR,
    "year": YEAR,
    "years": YEAR,
}
"""Accepted unit suffixes (case-insensitive) and their length in seconds."""

ACCEPTED_FORMS = (
    "seconds as a number (300, 1.5e3), numbers with units s/m/h/d/w/y "
    "(5m, 2.5h, 1h30m, 5y), or Slurm's [D-]HH:MM:SS, MM:SS, D-HH, D-HH:MM"
)

_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_UNIT_TERM = re.compile(rf"\s*({_NUMBER})\s*([a-z]+)\s*")
_PLAIN = re.compile(rf"{_NUMBER}")
_SLURM = re.compile(r"(?:(?P<days>\d+)-)?(?P<a>\d+)(?::(?P<b>\d+))?(?::(?P<c>\d+(?:\.\d*)?))?")


def _bad(text: object) -> ValueError:
    return ValueError(f"invalid duration {text!r}: expected {ACCEPTED_FORMS}")


def _parse_slurm(text: str) -> float | None:
    """Seconds for Slurm's clock forms, or None when *text* is not one of them."""
    match = _SLURM.fullmatch(text)
    if match is None:
        return None
    days, a, b, c = match.group("days", "a", "b", "c")
    if days is None and b is None:
        return None  # a bare integer: handled as seconds by the caller
    if days is not None:  # D-HH, D-HH:MM, D-HH:MM:SS
        total_days, hours, minutes, seconds = float(days), float(a), float(b or 0), float(c or 0)
    elif c is not None:  # HH:MM:SS
        total_days, hours, minutes, seconds = 0.0, float(a), float(b), float(c)
    else:  # MM:SS (minutes may exceed 59, as in Slurm)
        total_days, hours, minutes, seconds = 0.0, 0.0, float(a), float(b)
    if seconds >= 60 or (minutes >= 60 and (days is not None or c is not None)):
        return None
    return total_days * DAY + hours * HOUR + minutes * MINUTE + seconds


def parse_duration(text: str | float) -> float:
    """Seconds from a number or a duration string such as ``"1h30m"`` or ``"2-12:00:00"``.

    Raises ValueError naming the text and the accepted forms when it is none of them,
    or when it is negative or not finite.
    """
    if isinstance(text, bool):
        raise _bad(text)
    if isinstance(text, (int, float)):
        value = float(text)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid duration {text!r}: must be a finite number >= 0")
        return value
    if not isinstance(text, str):
        raise _bad(text)
    s = text.strip().lower()
    if not s:
        raise _bad(text)
    if _PLAIN.fullmatch(s):
        value = float(s)
        if not math.isfinite(value):
            raise _bad(text)
        return value
    slurm = _parse_slurm(s)
    if slurm is not None:
        return slurm
    total = 0.0
    pos = 0
    while pos < len(s):
        match = _UNIT_TERM.match(s, pos)
        if match is None or match.group(2) not in UNITS:
            raise _bad(text)
        total += float(match.group(1)) * UNITS[match.group(2)]
        pos = match.end()
    if not math.isfinite(total):
        raise _bad(text)
    return total


def format_duration(seconds: float) -> str:
    """A short human form with three significant digits: ``"42 s"``, ``"5 min"``, ``"1.41 h"``.

    Uses the largest unit among s, min, h, d, y in which the value is at least 1
    (days only from 3 d up, so "54 h" stays in hours).
    """
    value = float(seconds)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < MINUTE:
        number, unit = value, "s"
    elif value < HOUR:
        number, unit = value / MINUTE, "min"
    elif value < 3 * DAY:
        number, unit = value / HOUR, "h"
    elif value < YEAR:
        number, unit = value / DAY, "d"
    else:
        number, unit = value / YEAR, "y"
    text = f"{number:.3g}"
    if "e" in text:  # .3g switches to exponent form from 1000 on
        text = f"{number:.0f}"
    return f"{sign}{text} {unit}"


def format_hms(seconds: float) -> str:
    """Slurm's clock form, ``HH:MM:SS`` or ``D-HH:MM:SS`` from one day up, rounded to seconds.

    The result parses back with :func:`parse_duration` and can be given to ``sbatch --time``.
    """
    value = float(seconds)
    if not math.isfinite(value):
        raise ValueError(f"cannot format {seconds!r} as HH:MM:SS")
    sign = "-" if value < 0 else ""
    total = int(round(abs(value)))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{sign}{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    return f"{sign}{hours:02d}:{minutes:02d}:{secs:02d}"
