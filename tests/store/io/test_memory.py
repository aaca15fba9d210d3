"""Memory as the kernel reports it: available, the cgroup's room, the resident set and its peak."""

from __future__ import annotations

import numpy as np

from hpcckpt.store.io import memory

MiB = 1 << 20


def test_available_memory_is_positive_and_at_most_the_total() -> None:
    total = memory._meminfo("MemTotal")
    avail = memory.available_bytes()
    assert total and avail and 0 < avail <= total


def test_the_peak_resident_set_follows_an_allocation_and_resets() -> None:
    memory.reset_peak()
    before = memory.peak_rss_bytes()
    block = np.ones(64 * MiB // 8)  # touched: resident
    grown = memory.peak_rss_bytes()
    del block
    assert grown - before >= 60 * MiB
    memory.reset_peak()
    assert memory.peak_rss_bytes() < grown
    assert memory.rss_bytes() <= memory.peak_rss_bytes()


def test_a_cgroup_limit_gives_the_room_left_under_it(tmp_path, monkeypatch) -> None:
    """The parser on a copy of a v1 memory cgroup's files (the real one: the mpi tests)."""
    root = tmp_path / "cg"
    cg = root / "memory" / "job"
    cg.mkdir(parents=True)
    (cg / "memory.limit_in_bytes").write_text(str(1024 * MiB))
    (cg / "memory.usage_in_bytes").write_text(str(900 * MiB))
    (cg / "memory.stat").write_text(f"cache 1\ntotal_inactive_file {100 * MiB}\n")
    monkeypatch.setattr(memory, "_cgroup_paths", lambda: (None, "/job"))
    assert memory.cgroup_room(root) == 224 * MiB
    (cg / "memory.limit_in_bytes").write_text(str(1 << 62))  # v1's "no limit"
    assert memory.cgroup_room(root) is None


def test_memory_being_populated_counts_as_taken_until_settled(monkeypatch) -> None:
    """Two reservations made at once: the second sees the first's bytes as taken, though
    MemAvailable does not show them yet (their pages are still being faulted in)."""
    monkeypatch.setattr(memory, "_meminfo", lambda field: 8 << 30)
    monkeypatch.setattr(memory, "cgroup_room", lambda: None)
    assert memory.available_bytes() == 8 << 30
    memory.promise(3 << 30)
    assert memory.available_bytes() == 5 << 30
    memory.promise(6 << 30)
    assert memory.available_bytes() == 0, "never negative"
    memory.settle(6 << 30)
    memory.settle(3 << 30)
    assert memory.available_bytes() == 8 << 30
