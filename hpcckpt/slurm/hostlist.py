"""Slurm's hostlist form: ``n[1-3,5],gpu[01-02]`` to a list of node names."""

from __future__ import annotations

import re

_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,5],gpu[01-02]`` -> ``[n1, n2, n3, n5, gpu01, gpu02]`` (Slurm's hostlist form).

    Handles one bracket group per name with ranges and zero padding, which is what Slurm
    prints for ``SLURM_JOB_NODELIST`` and ``NodeList=``. ``(null)`` and empty give ``[]``.
    """
    text = (text or "").strip()
    if not text or text in ("(null)", "None"):
        return []
    names: list[str] = []
    for item in _split_top(text):
        m = _BRACKET.match(item)
        if not m:
            names.append(item)
            continue
        prefix, body, suffix = m.groups()
        for part in body.split(","):
            lo, sep, hi = part.partition("-")
            if not sep:
                names.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                names.append(f"{prefix}{str(i).zfill(width)}{suffix}")
    return list(dict.fromkeys(names))


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out
