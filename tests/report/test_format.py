"""How reports write numbers (hpcckpt/report/format.py)."""

from __future__ import annotations

from hpcckpt.report import format as fmt


def test_helpers():
    assert fmt.size(None) == "-" and fmt.size(512) == "512 B"
    assert fmt.size(3 * 1024**3 // 2) == "1.5 GiB"
    assert fmt.pct(None) == "-" and fmt.pct(0.1234) == "12.3%"
    assert fmt.rounded(None) is None and fmt.rounded(1.23456) == 1.235
    assert fmt.dur(None) == "-" and fmt.dur(90) != "-"
    assert fmt.mean([]) is None and fmt.mean([1.0, 3.0]) == 2.0
    assert fmt.median([3.0, 1.0, 2.0]) == 2.0 and fmt.median([1.0, 2.0]) == 1.5
