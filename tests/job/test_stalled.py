"""Stops without progress (hpcckpt/job/stalled.py): counting them, giving up."""

from __future__ import annotations

from hpcckpt.job import stalled


def ev(kind, restart=0, **fields):
    return {"event": kind, "restart": restart, **fields}


def test_stalled_stops_count_in_a_row_across_requeues_and_chains():
    log = [
        ev("wrapper_start", 0, attempt="a"),
        ev("requeue", 0, cause="stop", progress=False),
        ev("wrapper_start", 1, attempt="b"),
        ev("chain", 1, cause="stop", progress=False),
        ev("wrapper_start", 2, attempt="c"),
    ]
    assert stalled.stalled_stops(log) == 2
    kept = [*log, ev("restart_set", 2, attempt="c", set=1), ev("requeue", 2, cause="stop")]
    assert stalled.stalled_stops(kept) == 0  # a kept set ends the streak
    assert stalled.stalled_stops([*log, ev("requeue", 2, cause="stop")]) == 0  # progress
    assert stalled.stalled_stops([*log, ev("wrapper_start", 0)]) == 0  # submitted again


def test_third_stop_in_a_row_without_progress_gives_up_with_the_numbers():
    log = [
        ev("wrapper_start", 0, attempt="a"),
        ev("requeue", 0, cause="stop", progress=False),
        ev("wrapper_start", 1, attempt="b"),
        ev("requeue", 1, cause="stop", progress=False),
        ev("wrapper_start", 2, attempt="c"),
    ]
    facts = stalled.RunFacts(run_seconds=60, stop_before_end=-8, first_write=None)
    d = stalled.decide_after_stop(log, attempt="c", facts=facts)
    assert not d.progress and d.give_up and d.stalled == stalled.MAX_STALLED_STOPS == 3
    assert d.message.startswith("giving up: 3 runs in a row ended before the application")
    assert "the run had 60 s up to the job's end time" in d.message
    assert "no restart write of the application was seen" in d.message
    assert "longer --time" in d.message
    d = stalled.decide_after_stop(log[:3], attempt="b", facts=facts)
    assert not d.give_up and d.stalled == 2 and "run 2 of 3 in a row" in d.message


def test_a_kept_set_or_a_checkpoint_is_progress():
    log = [ev("wrapper_start", 0, attempt="a"), ev("requeue", 0, cause="stop", progress=False)]
    log += [ev("wrapper_start", 1, attempt="b"), ev("requeue", 1, cause="stop", progress=False)]
    got = stalled.decide_after_stop(
        [*log, ev("restart_set", 2, attempt="c", set=4)], attempt="c", facts=stalled.RunFacts()
    )
    assert got.progress and not got.give_up and got.kept == "restart set 4"
    api = stalled.RunFacts(restart_files=False, first_write=12.0, write_cut=True)
    got = stalled.decide_after_stop(log, attempt="c", facts=api)
    assert got.give_up and "committed checkpoint" in got.message
    assert "first checkpoint began after 12 s, cut by the stop" in got.message


def test_what_cannot_be_seen_is_never_a_reason_to_give_up():
    log = [ev("requeue", 0, cause="stop", progress=False)] * 5
    unseen = stalled.RunFacts(observable=False)
    assert stalled.decide_after_stop(log, attempt="x", facts=unseen).progress
    assert stalled.decide_after_stop(None, attempt="x", facts=stalled.RunFacts()).progress
