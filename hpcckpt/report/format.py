"""How the report (and the inspection commands) write numbers: one home for each helper."""

from __future__ import annotations

from hpcckpt.policy.durations import format_duration


def dur(seconds: float | None) -> str:
    """A duration for people (``1h 02m``), ``-`` when unknown."""
    return "-" if seconds is None else format_duration(seconds)


def size(n: float | None) -> str:
    """A byte count in binary units (``512 B``, ``1.5 GiB``), ``-`` when unknown."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def pct(x: float | None) -> str:
    """A fraction as a percentage with one decimal, ``-`` when unknown."""
    return "-" if x is None else f"{100 * x:.1f}%"


def rounded(value: float | None, digits: int = 3) -> float | None:
    """``round(value, digits)``, keeping None (for JSON-ready reports)."""
    return None if value is None else round(value, digits)


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def median(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
