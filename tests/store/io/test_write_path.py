"""Direct or buffered: the probes, the choice, the re-check, and a forced path."""

from __future__ import annotations

from hpcckpt.store.io import write_path as wp

MiB = 1 << 20


def run(chooser: wp.WritePathChooser, nbytes: int, rate: dict[bool, float], saves: int):
    """``saves`` saves of ``nbytes`` per rank, each path writing at ``rate`` bytes/s."""
    paths, decisions = [], []
    for _ in range(saves):
        direct = chooser.direct(nbytes)
        paths.append(direct)
        d = chooser.record(nbytes, direct, nbytes / rate[direct])
        if d:
            decisions.append(d)
    return paths, decisions


def test_the_first_saves_alternate_then_the_faster_path_is_kept() -> None:
    c = wp.WritePathChooser(allowed=True)
    paths, decisions = run(c, 64 * MiB, {True: 1e9, False: 2e9}, 10)
    assert paths[:4] == [True, False, True, False]
    assert paths[4:] == [False] * 6
    assert len(decisions) == 1
    d = decisions[0]
    assert d["path"] == "buffered" and d["size_group_bytes"] == 64 * MiB and not d["changed"]
    assert (d["direct_mb_s"], d["buffered_mb_s"]) == (1000.0, 2000.0)


def test_the_other_path_is_measured_again_and_a_change_is_followed() -> None:
    c = wp.WritePathChooser(allowed=True)
    run(c, 512 * MiB, {True: 3e9, False: 1e9}, wp.RECHECK)
    assert c.direct(512 * MiB) is False  # save RECHECK: the re-check of buffered
    # the device changed: buffered is faster now, and the re-check sees it
    paths, decisions = run(c, 512 * MiB, {True: 0.5e9, False: 4e9}, 3)
    assert paths[0] is False and decisions and decisions[0]["changed"]
    assert decisions[0]["path"] == "buffered" and paths[1:] == [False, False]


def test_each_size_group_is_decided_on_its_own() -> None:
    c = wp.WritePathChooser(allowed=True)
    run(c, 64 * MiB, {True: 1e9, False: 2e9}, 4)
    assert c.direct(64 * MiB) is False
    assert c.direct(600 * MiB) is True  # 512 MiB group: not measured yet, probe direct
    assert wp.size_group(600 * MiB) == 512 * MiB


def test_small_writes_forced_paths_and_file_systems_without_direct_io_are_not_measured() -> None:
    assert run(wp.WritePathChooser(True), 4 * MiB, {True: 1e9, False: 9e9}, 6) == ([True] * 6, [])
    forced = wp.WritePathChooser(True, forced=False)
    assert run(forced, 64 * MiB, {True: 9e9, False: 1e9}, 6) == ([False] * 6, [])
    forced = wp.WritePathChooser(False, forced=True)  # the user's choice wins
    assert run(forced, 64 * MiB, {True: 1e9, False: 9e9}, 6) == ([True] * 6, [])
    none = wp.WritePathChooser(allowed=False)
    assert run(none, 64 * MiB, {True: 9e9, False: 1e9}, 6) == ([False] * 6, [])
