import math
from datetime import datetime, timezone

import pytest

from hpcckpt.policy.deadline import DEFAULT_MARGIN, DEFAULT_SAFETY, Deadline, parse_end_time


def test_parse_iso_local_time_as_slurm_prints_it():
    expected = datetime(2026, 11, 22, 4, 15, 0).timestamp()  # naive = local time
    assert parse_end_time("2026-11-22T04:15:00") == expected
    assert parse_end_time(" 2026-11-22T04:15:00\n") == expected


def test_parse_iso_with_offset():
    assert parse_end_time("2026-11-22T04:15:00+00:00") == 1795320900.0
    assert datetime(2026, 11, 22, 4, 15, tzinfo=timezone.utc).timestamp() == 1795320900.0


def test_parse_unix_seconds():
    assert parse_end_time("1795320900") == 1795320900.0
    assert parse_end_time(1795320900) == 1795320900.0
    assert parse_end_time("1795320900.5") == 1795320900.5


def test_parse_relative():
    assert parse_end_time("+1:30:00", now=1000.0) == 1000.0 + 5400.0
    assert parse_end_time("+2h", now=0.0) == 7200.0


@pytest.mark.parametrize("text", [None, "", "Unknown", "N/A", "UNLIMITED", "  unknown  "])
def test_parse_none(text):
    assert parse_end_time(text) is None


@pytest.mark.parametrize("text", ["tomorrow", "2026-13-01T00:00:00", "3600", 5.0, "nan", True])
def test_parse_rejects(text):
    with pytest.raises(ValueError, match="end time"):
        parse_end_time(text)


def test_small_number_hints_at_relative_form():
    with pytest.raises(ValueError, match=r"\+3600"):
        parse_end_time("3600")


def test_defaults():
    deadline = Deadline(1000.0)
    assert deadline.safety == DEFAULT_SAFETY == 1.5
    assert deadline.margin == DEFAULT_MARGIN == 20.0


def test_must_stop_boundary():
    deadline = Deadline(10_000.0, safety=1.5, margin=10.0)
    # cost 100 s: stop from 10000 - 150 - 10 = 9840 on
    assert deadline.stop_at(100.0) == 9840.0
    assert deadline.must_stop(9839.9, 100.0) is False
    assert deadline.must_stop(9840.0, 100.0) is True
    assert deadline.must_stop(9999.0, 100.0) is True
    assert deadline.remaining(9800.0, 100.0) == pytest.approx(40.0)
    # a dearer checkpoint stops earlier
    assert deadline.must_stop(9700.0, 200.0) is True
    # unknown cost: only the margin
    assert deadline.must_stop(9989.0, None) is False
    assert deadline.must_stop(9990.0, None) is True


def test_no_limit_never_stops():
    deadline = Deadline(None)
    assert deadline.must_stop(1e18, 1e6) is False
    assert deadline.remaining(0.0, 10.0) == math.inf
    assert deadline.stop_at(10.0) is None


def test_deadline_validates():
    with pytest.raises(ValueError, match="safety"):
        Deadline(1.0, safety=0.5)
    with pytest.raises(ValueError, match="margin"):
        Deadline(1.0, margin=-1)
    with pytest.raises(ValueError, match="end time"):
        Deadline(math.inf)


def test_fit_interval_a_realistic_case():
    """cost 10 s, 1 node, a 1 h job: Young with the default MTBF is over 15 h; what is
    exported must let the run write before its stop, with slack for the start-up."""
    from hpcckpt.policy import DEFAULT_NODE_MTBF, fit_interval, young

    raw = young(10.0, DEFAULT_NODE_MTBF)
    assert raw > 15 * 3600
    left = 3600 - 10 * 1.5 - 20  # the end-time stop of a fresh 1 h job
    got = fit_interval(raw, left, cost=10.0)
    assert got == pytest.approx(left * 0.9 - 10)
    assert got + 10.0 <= left * 0.95  # the write ends well before the stop


def test_fit_interval_splits_into_equal_parts_no_longer_than_asked():
    from hpcckpt.policy import fit_interval

    got = fit_interval(1000.0, 4000.0, cost=0.0)  # usable 3600: 4 parts of 900 s
    assert got == pytest.approx(900.0)
    assert fit_interval(100.0, 100_000.0, cost=5.0) <= 100.0
    assert fit_interval(100.0, None) == 100.0 and fit_interval(100.0, float("inf")) == 100.0
    assert fit_interval(500.0, 0.5, cost=10.0) == 1.0  # no write fits any more
    assert fit_interval(500.0, 8.0, cost=10.0) == 8.0
    with pytest.raises(ValueError, match="interval"):
        fit_interval(0.0, 100.0)
