"""The Checkpointer's settings (coord/options.py): routing, the environment, checks."""

from __future__ import annotations

import dataclasses
import inspect
import re
import time
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt import Checkpointer
from hpcckpt.coord import options as opts
from hpcckpt.coord.options import (
    KEYWORD_CLASSES,
    CheckpointerOptions,
    JobEnvironment,
    LevelOptions,
    ScheduleOptions,
)
from hpcckpt.store.io.filesystem import TuningOptions
from hpcckpt.store.options import IncrementalOptions, fields_of

ROOT = Path(__file__).resolve().parents[2]


def resolve(directory="d", env=None, **keywords):
    return CheckpointerOptions.resolve(directory, keywords, env or JobEnvironment(node_name="n1"))


def documented_keywords() -> list[str]:
    """The keywords of ``Checkpointer(...)`` as docs/api.md shows its signature."""
    text = (ROOT / "docs" / "api.md").read_text()
    block = text.split("### `Checkpointer`", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    names = re.findall(r"^    (\w+):", block, re.M)
    return [n for n in names if n not in ("directory", "comm")]


# -- every keyword has one home -------------------------------------------------------------
def test_every_keyword_belongs_to_exactly_one_class():
    names = [f.name for kind in KEYWORD_CLASSES for f in dataclasses.fields(kind)]
    assert len(names) == len(set(names)), "two option classes share a field name"
    params = list(inspect.signature(Checkpointer).parameters)
    assert params[:2] == ["directory", "comm"]
    assert params[2:] == names


def test_the_signature_shows_each_default():
    params = inspect.signature(Checkpointer).parameters
    assert params["keep_last"].default == 3
    assert params["policy"].default == "daly"
    assert params["max_chain"].default == 8
    assert params["validate"].default == "finite"
    assert params["interval"].kind is inspect.Parameter.KEYWORD_ONLY


def test_docs_and_docstring_list_every_keyword():
    keywords = list(inspect.signature(Checkpointer).parameters)[2:]
    assert documented_keywords() == keywords
    doc = inspect.getdoc(Checkpointer) or ""
    missing = [k for k in keywords if not re.search(rf"``{k}(``|=)", doc)]
    assert not missing, f"the Checkpointer's docstring does not mention {missing}"


def test_a_field_added_to_a_class_is_a_keyword_with_no_other_change(monkeypatch):
    @dataclasses.dataclass(frozen=True)
    class Wider(IncrementalOptions):
        new_field: int = 0

    classes = tuple(Wider if k is IncrementalOptions else k for k in KEYWORD_CLASSES)
    monkeypatch.setattr(opts, "KEYWORD_CLASSES", classes)
    monkeypatch.setattr(opts, "IncrementalOptions", Wider)
    assert "new_field" in opts.init_signature().parameters
    got = resolve(new_field=7, max_chain=3)
    assert got.store.incremental.new_field == 7 and got.store.incremental.max_chain == 3


@pytest.mark.parametrize(
    ("keyword", "hint"),
    [("intervall", "interval"), ("keep_lst", "keep_last"), ("node", "node_name")],
)
def test_a_misspelt_keyword_is_a_type_error_naming_the_nearest(tmp_path, keyword, hint):
    with pytest.raises(TypeError, match=rf"'{keyword}'.*did you mean '{hint}'"):
        Checkpointer(tmp_path, comm=MPI.COMM_SELF, **{keyword: 1})
    assert not (tmp_path / "hpcckpt.lock").exists()  # refused before anything happened


def test_an_unknown_keyword_is_named_even_with_nothing_near(tmp_path):
    with pytest.raises(TypeError, match=r"Checkpointer\(\) got an unexpected keyword .*'zzz'"):
        Checkpointer(tmp_path, comm=MPI.COMM_SELF, zzz=1)


def test_every_documented_keyword_works(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    values = {
        "interval": "1m",
        "every_steps": 4,
        "policy": "young",
        "mtbf": "6h",
        "node_mtbf": "100h",
        "initial_cost": 0.5,
        "end_time": time.time() + 3600,
        "deadline_safety": 2.0,
        "deadline_margin": 10.0,
        "signal": "USR2",
        "stop_signals": ("TERM",),
        "keep_last": 2,
        "keep_every": 10,
        "keep_every_seconds": 3600.0,
        "distributed": ["u"],
        "replicated": ["model"],
        "fs_tuning": TuningOptions(),
        "share_group": True,
        "on_save_error": "warn",
        "validate": "finite",
        "call_timeout": "30s",
        "incremental": True,
        "block_size": 1 << 16,
        "max_chain": 4,
        "max_chain_fraction": 0.25,
        "min_delta_saving": 1024,
        "change_detection": "hashes",
        "async_save": True,
        "staging_budget": "64M",
        "cache": tmp_path / "cache-%n",
        "redundancy": None,  # partner/xor need ranks on two nodes
        "redundancy_set": None,
        "node_name": "n0",
        "drain_every": 2,
        "local_fraction": 0.5,
        "mirror": tmp_path / "mirror",
        "mirror_every": 2,
        "mirror_interval": None,  # every Nth or an interval, not both
        "mirror_bandwidth": "500M",
        "mirror_wait": "5s",
        "mirror_retry_max": "1m",
        "mirror_keep_last": 3,
        "mirror_keep_every": 100,
        "mirror_thinning": "6h:all,7d:1d,*:1w",
        "mirror_verify": "readback",
        "mirror_compress": "zstd",
    }
    assert sorted(values) == sorted(documented_keywords())
    ck = Checkpointer(tmp_path / "ck", MPI.COMM_SELF, **values)
    try:
        o = ck.options
        assert o.schedule.interval == 60.0 and o.schedule.signal == "USR2"
        assert o.retention.keep_every == 10 and o.store.arrays.distributed == {"u": None}
        assert o.store.incremental.block_size == 1 << 16
        assert o.store.files.share_group and o.guard.on_save_error == "warn"
        assert o.guard.call_timeout == 30.0
        assert o.staging.staging_budget == 64 << 20 and o.levels.drain_every == 2
        assert ck.cache == tmp_path / "cache-n0"
        m = o.store.mirror
        assert m.mirror == str(tmp_path / "mirror") and m.mirror_every == 2
        assert m.mirror_bandwidth == 500e6 and m.mirror_wait == 5.0 and m.mirror_retry_max == 60
        assert (m.mirror_keep_last, m.mirror_keep_every) == (3, 100)
        assert (m.mirror_verify, m.mirror_compress) == ("readback", "zstd")
        state = {"u": np.arange(8.0), "model": {"w": np.ones(3)}}
        ck.save(3, state)  # node-local only (drain_every=2)
        assert ck.last_save is not None and ck.last_save.tier == "cache"
    finally:
        ck.close()


# -- the environment -------------------------------------------------------------------------
def test_the_job_environment_is_read_once():
    env = JobEnvironment.from_env(
        {
            "HPCCKPT_DIR": "/ck",
            "HPCCKPT_ATTEMPT": "a1",
            "HPCCKPT_SIGNAL": "USR2",
            "HPCCKPT_LOG_LEVEL": "verbose",
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NUM_NODES": "3",
            "SLURMD_NODENAME": "n7",
        }
    )
    assert (env.directory, env.attempt, env.signal, env.job_id) == ("/ck", "a1", "USR2", "42")
    assert (env.nodes, env.node_name, env.log_level) == (3, "n7", 1)
    assert env.cache is None and env.end_time is None


def test_arguments_first_then_the_wrapper_then_the_defaults():
    env = JobEnvironment(directory="/env", signal="USR2", end_time="1800000000", cache="/c/%n")
    got = resolve(None, env)
    assert got.directory == Path("/env") and got.schedule.signal == "USR2"
    assert got.schedule.end_time == 1800000000.0 and got.end_time_source == "environment"
    assert got.store.tier.cache == Path(f"/c/{env.node_name}")
    got = resolve("/arg", env, signal="HUP", end_time=1700000000, cache="/mine")
    assert got.directory == Path("/arg") and got.schedule.signal == "HUP"
    assert got.end_time_source == "argument" and got.store.tier.cache == Path("/mine")
    bare = resolve("d", JobEnvironment())
    assert bare.schedule.signal == "USR1" and bare.end_time_source is None
    assert bare.store.tier.cache is None
    assert resolve("d", JobEnvironment(job_id="7")).end_time_source == "slurm"


def test_the_cache_is_this_node_s_absolute_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    got = resolve(cache="shm/%n-%%", node_name="c3")
    assert got.store.tier.cache == tmp_path / "shm" / "c3-%"
    assert got.store.tier.node_name == "c3"
    from mpi4py import MPI

    from hpcckpt.coord.checkpointer import Checkpointer

    with pytest.raises(ValueError, match="is the checkpoint directory itself"):
        Checkpointer(tmp_path / "ck", MPI.COMM_SELF, cache=tmp_path / "ck")
    assert not (tmp_path / "ck").exists()  # refused before anything was created


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HPCCKPT_REDUNDANCY": "xor:4"}, ("xor", 4, 1)),
        ({"HPCCKPT_REDUNDANCY": "partner", "HPCCKPT_DRAIN_EVERY": "5"}, ("partner", 8, 5)),
        ({"HPCCKPT_DRAIN_EVERY": "auto"}, (None, 8, "auto")),
    ],
)
def test_the_environment_sets_the_levels_for_a_whole_job(env, expected):
    got = resolve(env=JobEnvironment.from_env(env), cache="c")
    tier = got.store.tier
    assert (tier.redundancy, tier.redundancy_set, got.levels.drain_every) == expected


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"HPCCKPT_REDUNDANCY": "xor:four"}, "HPCCKPT_REDUNDANCY='xor:four'"),
        ({"HPCCKPT_DRAIN_EVERY": "often"}, "HPCCKPT_DRAIN_EVERY='often'"),
    ],
)
def test_a_malformed_variable_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        resolve(env=JobEnvironment.from_env(env), cache="c")


def test_call_timeout_from_the_argument_or_the_environment():
    assert resolve().guard.call_timeout is None  # no limit by default
    assert resolve(call_timeout="2m").guard.call_timeout == 120.0
    env = JobEnvironment.from_env({"HPCCKPT_CALL_TIMEOUT": "30"})
    assert resolve(env=env).guard.call_timeout == 30.0
    assert resolve(env=env, call_timeout=5).guard.call_timeout == 5.0
    with pytest.raises(ValueError, match="HPCCKPT_CALL_TIMEOUT='soon'"):
        resolve(env=JobEnvironment.from_env({"HPCCKPT_CALL_TIMEOUT": "soon"}))
    with pytest.raises(ValueError, match="call_timeout must be a positive duration"):
        resolve(call_timeout=0)


def test_arguments_win_over_the_environment():
    env = JobEnvironment.from_env({"HPCCKPT_REDUNDANCY": "xor:4", "HPCCKPT_DRAIN_EVERY": "5"})
    got = resolve(
        env=env, cache="c", redundancy="partner", redundancy_set=3, drain_every=2,
        local_fraction=0.5,
    )  # fmt: skip
    tier = got.store.tier
    assert (tier.redundancy, tier.redundancy_set) == ("partner", 3)
    assert (got.levels.drain_every, got.levels.local_fraction) == (2, 0.5)


def test_redundancy_from_the_environment_needs_a_cache():
    with pytest.raises(ValueError, match=r"pass cache=PATH too \(or set HPCCKPT_CACHE\)"):
        resolve(env=JobEnvironment.from_env({"HPCCKPT_REDUNDANCY": "xor"}))


# -- the checks ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": -1}, r"Checkpointer\(interval=-1\)"),
        ({"interval": 0}, "interval must be a positive number of seconds, not 0"),
        ({"every_steps": 1.5}, "every_steps must be a positive integer, not 1.5"),
        ({"mtbf": "soon"}, r"Checkpointer\(mtbf='soon'\)"),
        ({"initial_cost": "x"}, r"Checkpointer\(initial_cost='x'\)"),
        ({"deadline_safety": 0.5}, "safety must be a factor >= 1"),
        ({"end_time": "tomorrow-ish"}, "tomorrow-ish"),
    ],
)
def test_schedule_checks(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ScheduleOptions(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"on_save_error": "ignore"}, "on_save_error must be 'raise' or 'warn', not 'ignore'"),
        ({"validate": "sane"}, "validate must be 'finite', a callable or None"),
        ({"staging_budget": "lots"}, "staging_budget must be a number of bytes"),
        ({"drain_every": 0}, "drain_every must be a positive integer or 'auto', not 0"),
        ({"local_fraction": 2}, r"local_fraction must be in \[0, 1\], not 2"),
        ({"keep_last": 0}, "keep_last"),
        ({"block_size": 3}, "block_size"),
    ],
)
def test_each_class_checks_its_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(**kwargs)


def test_schedule_values_are_parsed_once():
    s = ScheduleOptions(interval="5m", mtbf="1h", node_mtbf="2d", initial_cost="30s")
    assert (s.interval, s.mtbf, s.node_mtbf, s.initial_cost) == (300.0, 3600.0, 172800.0, 30.0)
    assert ScheduleOptions(**dataclasses.asdict(s)) == s  # checked values check again


def test_the_policy_follows_the_schedule():
    assert ScheduleOptions(interval=60).interval_policy(1).name == "fixed"
    assert ScheduleOptions(every_steps=10).interval_policy(1) is None
    daly = ScheduleOptions(node_mtbf="100h").interval_policy(100)
    assert daly.name == "daly" and daly.mtbf == pytest.approx(3600.0)
    with pytest.raises(ValueError, match="unknown interval policy"):
        ScheduleOptions(policy="sometimes", mtbf=10).interval_policy(1)


def test_the_drain_period():
    assert LevelOptions().period == 1 and LevelOptions().local_fraction == 0.8
    assert LevelOptions(drain_every=3).period == 3
    assert LevelOptions(drain_every="auto").period is None


def test_keywords_route_to_their_class():
    parts = opts.route("Checkpointer", {"keep_last": 1, "cache": "c"}, *KEYWORD_CLASSES)
    owners = fields_of(*KEYWORD_CLASSES)
    assert {k: v for kind, given in parts.items() for k, v in given.items()} == {
        "keep_last": 1,
        "cache": "c",
    }
    assert owners["keep_last"].__name__ == "RetentionOptions"
    assert owners["cache"].__name__ == "TierOptions"


def test_the_mirror_keyword_wins_over_hpcckpt_mirror_and_its_wait():
    env = opts.JobEnvironment.from_env(
        {"HPCCKPT_MIRROR": "/project/env", "HPCCKPT_MIRROR_WAIT": "12"}
    )
    from_env = opts.mirror_from_env(env)
    assert (from_env.mirror, from_env.mirror_wait) == ("/project/env", 12.0)
    given = opts.mirror_from_env(env, mirror="s3://b/run", mirror_wait=3)
    assert (given.mirror, given.mirror_wait) == ("s3://b/run", 3.0)
    default = opts.mirror_from_env(opts.JobEnvironment.from_env({}))
    assert default.mirror is None and default.mirror_wait == 300.0  # docs/tiers.md
    assert (default.mirror_every, default.mirror_retry_max) == (1, 60.0)
    keep = (default.mirror_keep_last, default.mirror_keep_every, default.mirror_thinning)
    assert keep == (None, None, None)  # no rule: the mirror keeps everything
