"""The staging budget: which way a staged save takes for a state, a budget and the memory left."""

from __future__ import annotations

import pytest

from hpcckpt.store.save import staging_budget as sb

MiB = 1 << 20
GiB = 1 << 30


def test_a_state_within_the_budget_is_copied_whole() -> None:
    p = sb.plan(512 * MiB, GiB, available=16 * GiB, local_ranks=4)
    assert (p.mode, p.staging_bytes, p.budget) == (sb.COPY, 512 * MiB, GiB)


def test_a_state_over_the_budget_goes_through_a_ring_of_the_budget() -> None:
    p = sb.plan(2 * GiB, 256 * MiB, available=16 * GiB, local_ranks=2)
    assert (p.mode, p.staging_bytes) == (sb.PIECES, 256 * MiB)


def test_the_default_budget_is_a_fraction_of_the_nodes_memory_shared_by_its_ranks() -> None:
    p = sb.plan(GiB, None, available=8 * GiB, local_ranks=4)  # 2 GiB per rank, half of it
    assert p.budget == int(sb.DEFAULT_FRACTION * 2 * GiB) == GiB
    assert p.mode == sb.COPY
    p = sb.plan(3 * GiB, None, available=8 * GiB, local_ranks=4)
    assert (p.mode, p.staging_bytes) == (sb.PIECES, GiB)


def test_memory_held_by_the_previous_save_counts_as_available() -> None:
    short = sb.plan(GiB, None, available=100 * MiB, local_ranks=1)
    assert short.mode == sb.SYNC
    reused = sb.plan(GiB, None, available=100 * MiB, local_ranks=1, held=4 * GiB)
    assert reused.mode == sb.COPY


def test_a_budget_larger_than_the_memory_left_is_cut_to_it() -> None:
    p = sb.plan(4 * GiB, 8 * GiB, available=GiB, local_ranks=1)
    assert (p.mode, p.staging_bytes) == (sb.PIECES, GiB - sb.RESERVE_BYTES)


def test_too_little_memory_for_a_ring_means_a_synchronous_save_with_the_reason() -> None:
    p = sb.plan(GiB, GiB, available=2 * 100 * MiB, local_ranks=2)
    assert p.mode == sb.SYNC and p.staging_bytes == 0
    assert "1024 MiB to stage" in p.reason and "100 MiB available" in p.reason
    assert sb.plan(GiB, 32 * MiB, available=None, local_ranks=1).mode == sb.SYNC


def test_unknown_memory_trusts_the_budget() -> None:
    assert sb.plan(GiB, None, available=None, local_ranks=8).mode == sb.COPY
    assert sb.plan(GiB, 128 * MiB, available=None, local_ranks=8).mode == sb.PIECES


@pytest.mark.parametrize(
    ("text", "expected"),
    [(None, None), (1000, 1000), ("4G", 4 * GiB), ("512MiB", 512 * MiB), ("1.5g", 3 * GiB // 2)],
)
def test_budgets_parse_from_bytes_or_sizes(text, expected) -> None:
    assert sb.parse_budget(text) == expected


@pytest.mark.parametrize("bad", ["lots", -1, "G", True])
def test_a_bad_budget_names_the_parameter(bad) -> None:
    with pytest.raises(ValueError, match="staging_budget"):
        sb.parse_budget(bad)
