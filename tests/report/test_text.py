"""The report as text (hpcckpt/report/text.py)."""

from __future__ import annotations

from hpcckpt.report import analyze, format_report


def test_empty() -> None:
    r = analyze([])
    assert r["attempts"] == [] and r["efficiency"] == {"run": None, "wall": None}
    assert "no job attempt" in format_report(r)
