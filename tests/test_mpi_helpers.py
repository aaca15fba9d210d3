"""The helper that reads the ranks' JSON reports out of mpirun's output."""

import pytest

from tests.mpi_helpers import rank_reports


def test_reports_joined_on_one_line_are_all_read_and_sorted_by_rank():
    out = 'hpcckpt: saved step 1\n{"rank": 2, "ok": true}{"rank": 0, "ok": true}\n{"rank": 1}\n'
    assert [r["rank"] for r in rank_reports(out, 3)] == [0, 1, 2]


def test_a_missing_report_fails_with_the_output():
    with pytest.raises(AssertionError, match="expected 3 rank reports, got 2"):
        rank_reports('{"rank": 0}\n{"rank": 1}\n', 3)
