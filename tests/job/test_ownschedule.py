"""hpcckpt.job.ownschedule: sets written on the application's own schedule, real files."""

import time

from hpcckpt.job.ownschedule import OwnScheduleWatch
from hpcckpt.job.restart_files import RestartFiles


def _write(path, data: bytes, pieces: int = 3, pause: float = 0.05) -> None:
    with open(path, "wb") as fh:
        step = len(data) // pieces
        for i in range(pieces):
            fh.write(data[i * step : (i + 1) * step] if i < pieces - 1 else data[i * step :])
            fh.flush()
            time.sleep(pause)


def _tick_until(watch, alive: bool, seconds: float):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = watch.tick(alive)
        if got is not None:
            return got
        time.sleep(0.02)
    return None


def test_a_complete_rewrite_is_kept_once(tmp_path):
    files = RestartFiles([str(tmp_path / "rs.*")], tmp_path / "ck", settle=0.3)
    watch = OwnScheduleWatch(files, time.time_ns(), settle=0.3)
    assert watch.tick(True) is None and not watch.writing
    _write(tmp_path / "rs.0", b"a" * 3000)
    assert watch.tick(True) is None and watch.writing  # rs.1 not rewritten yet
    _write(tmp_path / "rs.1", b"b" * 3000)
    done = _tick_until(watch, True, 3)
    assert done is not None and 0 <= files.cost(done) < 2
    assert not watch.writing and _tick_until(watch, True, 0.5) is None  # nothing new since


def test_a_set_whose_writer_died_is_never_kept(tmp_path):
    files = RestartFiles([str(tmp_path / "rs.*")], tmp_path / "ck", settle=0.2)
    (tmp_path / "rs.0").write_bytes(b"old")
    watch = OwnScheduleWatch(files, time.time_ns(), settle=0.2)
    time.sleep(0.01)
    (tmp_path / "rs.0").write_bytes(b"half")  # then the step died
    assert _tick_until(watch, False, 1.0) is None and watch.writing


def test_burst_rule_for_a_fixed_set_and_a_series():
    from hpcckpt.job.ownschedule import burst_complete

    fixed = ["rs.0", "rs.1"]
    assert burst_complete(fixed, fixed, None) and burst_complete(fixed, fixed, fixed)
    assert not burst_complete(["rs.0"], fixed, fixed)  # rs.1 not rewritten yet
    assert not burst_complete(["rs.0"], fixed, None)  # before any set: every file
    series = ["r.1000.bin", "r.2000.bin"]
    assert burst_complete(["r.3000.bin"], series, None)  # the first set of a series
    assert burst_complete(["r.3000.bin"], series, ["r.2000.bin"])  # as many as last time
    two = ["r.2000.0", "r.2000.1"]  # one file per rank
    assert not burst_complete(["r.3000.0"], two, two)
    assert burst_complete(["r.3000.0", "r.3000.1"], two, two)
    assert not burst_complete([], series, None)


def test_a_growing_series_keeps_one_set_per_write_and_never_the_older_files(tmp_path):
    files = RestartFiles([str(tmp_path / "r.*.bin")], tmp_path / "ck", settle=0.3)
    (tmp_path / "r.1000.bin").write_bytes(b"old run")  # the application's own older file
    watch = OwnScheduleWatch(files, time.time_ns(), settle=0.3)
    time.sleep(0.02)
    _write(tmp_path / "r.2000.bin", b"x" * 3000)
    done = _tick_until(watch, True, 3)
    assert done is not None and sorted(done.seen) == [str(tmp_path / "r.2000.bin")]
    kept = files.register(attempt="a", seconds=files.cost(done), paths=sorted(done.seen))
    _write(tmp_path / "r.3000.bin", b"y" * 3000)
    done = _tick_until(watch, True, 3)
    assert done is not None and sorted(done.seen) == [str(tmp_path / "r.3000.bin")]
    second = files.register(attempt="a", seconds=1.0, paths=sorted(done.seen))
    assert [e["path"] for e in second.files] == [str(tmp_path / "r.3000.bin")]
    assert kept.number + 1 == second.number and len(watch.writes) == 2
    assert watch.writes[0].began <= watch.writes[0].ended <= watch.writes[1].began
    assert (tmp_path / "r.1000.bin").read_bytes() == b"old run"


def test_a_series_file_cut_mid_write_is_moved_aside_at_the_next_start(tmp_path):
    files = RestartFiles([str(tmp_path / "r.*.bin")], tmp_path / "ck", settle=0.2)
    (tmp_path / "r.1000.bin").write_bytes(b"older, never kept")
    time.sleep(0.02)
    (tmp_path / "r.2000.bin").write_bytes(b"complete")
    files.register(attempt="a", seconds=1.0, paths=[str(tmp_path / "r.2000.bin")])
    time.sleep(0.02)
    (tmp_path / "r.3000.bin").write_bytes(b"cut")  # the step died here
    # a good copy of a kept file, newer than it: not cut
    (tmp_path / "r.4000.bin").write_bytes((tmp_path / "r.2000.bin").read_bytes())
    assert files.ensure_good() == (1, [])
    moved = files.set_aside_cut()
    assert [src for src, _ in moved] == [str(tmp_path / "r.3000.bin")]
    dest = moved[0][1]
    assert (
        dest.startswith(str(tmp_path / "ck" / "restart-sets" / "cut"))
        and open(dest).read() == "cut"
    )
    assert not (tmp_path / "r.3000.bin").exists()
    left = sorted(p.name for p in tmp_path.glob("r.*.bin"))
    assert left == ["r.1000.bin", "r.2000.bin", "r.4000.bin"]  # older files untouched
    assert files.sets()[-1][0] == 1 and files.current()  # the cut directory is no set


def test_a_file_being_written_when_the_step_died_is_moved_aside_without_any_set(tmp_path):
    files = RestartFiles([str(tmp_path / "r.*.bin")], tmp_path / "ck", settle=0.2)
    (tmp_path / "r.1000.bin").write_bytes(b"older")
    (tmp_path / "r.2000.bin").write_bytes(b"half")
    files.note_unfinished([str(tmp_path / "r.2000.bin")])
    moved = files.set_aside_cut()
    assert [src for src, _ in moved] == [str(tmp_path / "r.2000.bin")]
    assert (tmp_path / "r.1000.bin").exists() and files.set_aside_cut() == []


def test_a_fixed_set_cut_in_place_is_moved_aside_and_the_kept_set_put_back(tmp_path):
    files = RestartFiles([str(tmp_path / "rs.*")], tmp_path / "ck", settle=0.2)
    (tmp_path / "rs.0").write_bytes(b"good 0")
    (tmp_path / "rs.1").write_bytes(b"good 1")
    files.register(attempt="a", seconds=1.0)
    (tmp_path / "rs.1").write_bytes(b"go")  # cut in place
    number, wrong = files.ensure_good()
    assert number == 1 and wrong and "rs.1 has 2 bytes, not 6" in wrong[0]
    assert (tmp_path / "rs.1").read_bytes() == b"good 1"
    aside = list((tmp_path / "ck" / "restart-sets" / "cut").rglob("rs.1"))
    assert len(aside) == 1 and aside[0].read_bytes() == b"go"
    assert files.set_aside_cut() == []
