"""The Checkpointer's two levels (coord/levels.py): the drain period, fixed or from the model.

The options and their environment variables are tested in test_options.py."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.coord.levels import Levels
from hpcckpt.coord.options import LevelOptions
from hpcckpt.policy import multilevel


def test_drain_every_auto_takes_both_intervals_from_the_two_level_model(tmp_path):
    ck = Checkpointer(
        tmp_path / "ck", comm=MPI.COMM_SELF, cache=tmp_path / "cache", mtbf="6h",
        drain_every="auto", local_fraction=0.9,
    )  # fmt: skip
    try:
        ck.costs.add(20.0)  # measured: a node-local save blocks 20 s, a drain costs 300 s
        ck.durable_costs.add(300.0)
        plan = multilevel.plan_levels(20.0, 300.0, 6 * 3600.0, 0.9)
        assert ck.level_plan() == plan and plan.drain_every > 1
        assert ck.interval == pytest.approx(plan.interval)
        assert [ck._local_only() for ck.levels.local_saves in range(plan.drain_every)] == [True] * (
            plan.drain_every - 1
        ) + [False]
    finally:
        ck.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"drain_every": 0}, "drain_every must be a positive integer or 'auto'"),
        ({"redundancy": "xor"}, "pass cache=PATH too"),
        ({"cache": "c", "redundancy": "raid"}, "'partner', 'xor' or None"),
        ({"cache": "c", "local_fraction": 2}, "local_fraction must be in"),
        ({"cache": "c", "redundancy": "xor"}, "on at least 2 nodes, or pass redundancy=None"),
    ],
)
def test_bad_multilevel_options_are_named(tmp_path, monkeypatch, kwargs, message):
    monkeypatch.delenv("HPCCKPT_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        Checkpointer(tmp_path / "ck", comm=MPI.COMM_SELF, **kwargs)


def test_a_fixed_drain_period_drains_every_nth_save():
    lv = Levels(LevelOptions(drain_every=3))
    assert lv.plan(3600.0, 1.0, 10.0, cached=True) is None  # fixed: no model
    pattern = []
    for _ in range(6):
        local = lv.local_only(None)
        pattern.append(local)
        lv.local_saves = lv.local_saves + 1 if local else 0
    assert pattern == [True, True, False, True, True, False]


def test_auto_takes_the_period_from_the_model_and_needs_a_cache_and_an_mtbf():
    lv = Levels(LevelOptions(drain_every="auto", local_fraction=0.9))
    assert lv.plan(6 * 3600.0, 20.0, 300.0, cached=True) == multilevel.plan_levels(
        20.0, 300.0, 6 * 3600.0, 0.9
    )
    assert lv.plan(6 * 3600.0, 20.0, 300.0, cached=False) is None
    assert lv.plan(None, 20.0, 300.0, cached=True) is None
    assert lv.local_only(None) is False  # no plan: every save drains
