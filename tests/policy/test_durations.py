import math

import pytest

from hpcckpt.policy.durations import format_duration, format_hms, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300", 300.0),
        ("1.5e3", 1500.0),
        (" 42s ", 42.0),
        ("5m", 300.0),
        ("5min", 300.0),
        ("1.5H", 5400.0),
        ("1h30m", 5400.0),
        ("1h 30m 15s", 5415.0),
        ("2d", 172800.0),
        ("1w", 604800.0),
        ("5y", 5 * 365.25 * 86400),
        ("01:30:00", 5400.0),
        ("90:00", 5400.0),  # MM:SS, minutes may exceed 59 as in Slurm
        ("2-12:00:00", 216000.0),
        ("1-02:30", 95400.0),
        ("1-0", 86400.0),
        ("0", 0.0),
        (300, 300.0),
        (2.5, 2.5),
    ],
)
def test_parse_duration_accepts(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "abc",
        "5x",
        "-5",
        "1:60:00",
        "1:2:3:4",
        "h",
        "5m3",
        "inf",
        "1e400",
        "nan",
        -1.0,
        math.nan,
    ],
)
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError) as info:
        parse_duration(text)
    assert repr(text) in str(info.value)


def test_error_lists_accepted_forms():
    with pytest.raises(ValueError, match=r"1h30m.*HH:MM:SS"):
        parse_duration("twelve hours")


def test_parse_duration_rejects_bool():
    with pytest.raises(ValueError):
        parse_duration(True)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.5, "0.5 s"),
        (42, "42 s"),
        (300, "5 min"),
        (330, "5.5 min"),
        (5091.17, "1.41 h"),
        (54 * 3600, "54 h"),
        (3 * 86400, "3 d"),
        (5 * 365.25 * 86400, "5 y"),
        (-90, "-1.5 min"),
        (math.inf, "inf"),
    ],
)
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "00:00:00"), (4893.13, "01:21:33"), (86399.6, "1-00:00:00"), (216000, "2-12:00:00")],
)
def test_format_hms_round_trips(seconds, text):
    assert format_hms(seconds) == text
    assert parse_duration(text) == round(seconds)


def test_format_hms_rejects_infinity():
    with pytest.raises(ValueError):
        format_hms(math.inf)
