"""The Checkpointer's two levels (coord/levels.py): options, the environment, the drain period."""

from __future__ import annotations

import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.coord import levels
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


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HPCCKPT_REDUNDANCY": "xor:4"}, ("xor", 4, 1)),
        ({"HPCCKPT_REDUNDANCY": "partner", "HPCCKPT_DRAIN_EVERY": "5"}, ("partner", 8, 5)),
        ({"HPCCKPT_DRAIN_EVERY": "auto"}, (None, 8, None)),
    ],
)
def test_the_environment_sets_the_levels_for_a_whole_job(monkeypatch, env, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    got = levels.resolve(None, None, None, None, cache="c")
    assert (got.redundancy, got.redundancy_set, got.drain_every) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HPCCKPT_REDUNDANCY": "xor:four"}, "HPCCKPT_REDUNDANCY='xor:four'"),
        ({"HPCCKPT_DRAIN_EVERY": "often"}, "HPCCKPT_DRAIN_EVERY='often'"),
    ],
)
def test_a_malformed_variable_is_named(monkeypatch, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        levels.resolve(None, None, None, None, cache="c")


def test_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("HPCCKPT_REDUNDANCY", "xor:4")
    monkeypatch.setenv("HPCCKPT_DRAIN_EVERY", "5")
    got = levels.resolve("partner", 3, 2, 0.5, cache="c")
    assert (got.redundancy, got.redundancy_set, got.drain_every, got.local_fraction) == (
        "partner", 3, 2, 0.5,
    )  # fmt: skip


def test_a_fixed_drain_period_drains_every_nth_save():
    lv = levels.Levels(levels.resolve(None, None, 3, None, cache="c"))
    assert lv.plan(3600.0, 1.0, 10.0, cached=True) is None  # fixed: no model
    pattern = []
    for _ in range(6):
        local = lv.local_only(None)
        pattern.append(local)
        lv.local_saves = lv.local_saves + 1 if local else 0
    assert pattern == [True, True, False, True, True, False]
