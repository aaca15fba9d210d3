"""The store's settings (hpcckpt/store/options.py): each class checks its values once,
when made, with the messages users have always seen; None means the default where the
Checkpointer documents it; :func:`route` sends each keyword to the class that owns it."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hpcckpt.store.io import blocks, filesystem
from hpcckpt.store.options import (
    ArrayOptions,
    FileOptions,
    IncrementalOptions,
    RetentionOptions,
    StoreOptions,
    TierOptions,
    fields_of,
    route,
)
from hpcckpt.store.tier import redundancy


def exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def first_rows(rows, nranks, rank):
    return (0, rows) if rank == 0 else (rows, rows)


# -- ArrayOptions ----------------------------------------------------------------------------
def test_distributed_as_a_name_a_collection_or_a_mapping_to_splits():
    assert ArrayOptions(distributed="fields/u").splits == {"fields/u": None}
    assert ArrayOptions(distributed=["a", "b"]).splits == {"a": None, "b": None}
    mapped = ArrayOptions(distributed={"a": first_rows, "b": None})
    assert mapped.splits == {"a": first_rows, "b": None} and mapped.distributed is mapped.splits
    assert ArrayOptions().splits == {} and ArrayOptions().replicated == ()


def test_replicated_names_are_key_paths_without_slashes_once_each():
    assert ArrayOptions(replicated="model").replicated == ("model",)
    assert ArrayOptions(replicated=["/model/", "opt", "model"]).replicated == ("model", "opt")
    with pytest.raises(
        ValueError, match=exactly("replicated names key paths such as 'model', not '/'")
    ):
        ArrayOptions(replicated=["/"])
    with pytest.raises(ValueError, match="key paths"):
        ArrayOptions(replicated=[3])


@pytest.mark.parametrize(
    "distributed", ["model", ["model", "u"], {"model": None}, {"model": first_rows}]
)
def test_a_name_both_distributed_and_replicated_is_refused(distributed):
    with pytest.raises(
        ValueError, match=exactly("['model'] declared both distributed and replicated; choose one")
    ):
        ArrayOptions(distributed=distributed, replicated=["/model", "opt"])


def test_array_options_are_the_same_when_made_again_from_themselves():
    made = ArrayOptions(distributed={"a": first_rows}, replicated=["m/"])
    again = dataclasses.replace(made)
    assert again == made and again.splits == {"a": first_rows} and again.replicated == ("m",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.replicated = ()  # type: ignore[misc]


# -- IncrementalOptions ----------------------------------------------------------------------
def test_incremental_defaults_and_none_meaning_the_default():
    default = IncrementalOptions()
    assert default.block_size == blocks.DEFAULT_BLOCK_SIZE
    assert default.min_delta_saving == blocks.DEFAULT_MIN_DELTA_SAVING
    assert (default.incremental, default.max_chain, default.max_chain_fraction) == (True, 8, 0.5)
    assert default.change_detection == "auto"
    nones = IncrementalOptions(block_size=None, min_delta_saving=None)
    assert nones == default
    assert type(IncrementalOptions(block_size=8192.0).block_size) is int


@pytest.mark.parametrize("bad", [100, 4096 + 8, 4096.5, 0, -4096, "4096"])
def test_a_bad_block_size_is_refused(bad):
    message = (
        f"block_size must be an integer >= {blocks.MIN_BLOCK_SIZE} and a multiple of 16 bytes, "
        f"not {bad!r}"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        IncrementalOptions(block_size=bad)


def test_a_bad_change_detection_is_refused():
    with pytest.raises(
        ValueError,
        match=exactly("change_detection must be one of auto, kernel, hashes, not 'magic'"),
    ):
        IncrementalOptions(change_detection="magic")
    assert IncrementalOptions(change_detection="hashes").change_detection == "hashes"


@pytest.mark.parametrize(
    "given, message",
    [
        ({"max_chain": 0}, "max_chain must be a positive integer, not 0"),
        ({"max_chain": 2.5}, "max_chain must be a positive integer, not 2.5"),
        ({"max_chain_fraction": 0.0}, "max_chain_fraction must be positive, not 0.0"),
        (
            {"min_delta_saving": -1},
            "min_delta_saving must be a byte count >= 0 (0: any saving), not -1",
        ),
        (
            {"min_delta_saving": True},
            "min_delta_saving must be a byte count >= 0 (0: any saving), not True",
        ),
        (
            {"min_delta_saving": 1.5},
            "min_delta_saving must be a byte count >= 0 (0: any saving), not 1.5",
        ),
    ],
)
def test_bad_chain_bounds_are_refused_when_made(given, message):
    with pytest.raises(ValueError, match=exactly(message)):
        IncrementalOptions(**given)


def test_the_chain_policy_is_made_of_the_options():
    policy = IncrementalOptions(
        incremental=0, max_chain=3, max_chain_fraction=0.25, min_delta_saving=0
    ).chain_policy
    assert policy == blocks.ChainPolicy(
        incremental=False, max_chain=3, max_chain_fraction=0.25, min_delta_saving=0
    )


# -- FileOptions -----------------------------------------------------------------------------
def test_file_options_default_tuning_and_a_given_one():
    assert FileOptions().tuning == filesystem.TuningOptions() and not FileOptions().share_group
    tuning = filesystem.TuningOptions(direct_io=False)
    assert FileOptions(fs_tuning=tuning).tuning is tuning


# -- TierOptions -----------------------------------------------------------------------------
def test_tier_options_without_a_cache_have_no_path():
    tier = TierOptions()
    assert tier.cache is None and tier.path is None
    assert tier.redundancy is None and tier.redundancy_set == redundancy.DEFAULT_SET_SIZE


def test_the_cache_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tier = TierOptions(cache="local/cache")
    assert tier.path == tmp_path / "local" / "cache" and tier.path.is_absolute()
    assert tier.cache == tier.path and isinstance(tier.cache, Path)


def test_redundancy_set_none_means_the_default_and_is_an_int():
    assert TierOptions(redundancy_set=None).redundancy_set == redundancy.DEFAULT_SET_SIZE
    given = TierOptions(redundancy="xor", redundancy_set=4.0)
    assert given.redundancy_set == 4 and type(given.redundancy_set) is int


@pytest.mark.parametrize(
    "given, message",
    [
        ({"redundancy": "raid"}, "redundancy must be 'partner', 'xor' or None, not 'raid'"),
        (
            {"redundancy": "xor", "redundancy_set": 1},
            "redundancy_set must be an integer >= 2 (nodes per set), not 1",
        ),
        (
            {"redundancy": "partner", "redundancy_set": 2.5},
            "redundancy_set must be an integer >= 2 (nodes per set), not 2.5",
        ),
    ],
)
def test_a_bad_redundancy_is_refused(given, message):
    with pytest.raises(ValueError, match=exactly(message)):
        TierOptions(**given)


# -- RetentionOptions ------------------------------------------------------------------------
def test_retention_defaults():
    rules = RetentionOptions()
    assert (rules.keep_last, rules.keep_every, rules.keep_every_seconds) == (3, None, None)
    assert RetentionOptions(keep_last=None).keep_last is None  # None: keep all


@pytest.mark.parametrize(
    "given, message",
    [
        ({"keep_last": 0}, "keep_last must be a positive integer, not 0"),
        ({"keep_last": 1.5}, "keep_last must be a positive integer, not 1.5"),
        ({"keep_every": -2}, "keep_every must be a positive integer, not -2"),
        ({"keep_every_seconds": 0}, "keep_every_seconds must be positive, not 0"),
    ],
)
def test_bad_retention_rules_are_refused(given, message):
    with pytest.raises(ValueError, match=exactly(message)):
        RetentionOptions(**given)


# -- StoreOptions and route ------------------------------------------------------------------
def test_from_keywords_gives_each_keyword_to_its_class(tmp_path):
    tuning = filesystem.TuningOptions(direct_io=False)
    options = StoreOptions.from_keywords(
        distributed=["u"],
        block_size=8192,
        max_chain=2,
        fs_tuning=tuning,
        share_group=True,
        cache=tmp_path / "cache",
        node_name="n1",
    )
    assert options.arrays == ArrayOptions(distributed=["u"])
    assert options.incremental == IncrementalOptions(block_size=8192, max_chain=2)
    assert options.files == FileOptions(fs_tuning=tuning, share_group=True)
    assert options.tier == TierOptions(cache=tmp_path / "cache", node_name="n1")
    assert StoreOptions.from_keywords() == StoreOptions()


def test_from_keywords_checks_what_it_makes():
    with pytest.raises(ValueError, match="block_size must be an integer >= 4096"):
        StoreOptions.from_keywords(block_size=100)


def test_from_keywords_names_its_owner_and_the_nearest_keyword():
    with pytest.raises(TypeError) as got:
        StoreOptions.from_keywords("Checkpointer", redundnacy="xor")
    assert str(got.value) == (
        "Checkpointer() got an unexpected keyword argument 'redundnacy' "
        "(did you mean 'redundancy'?)"
    )
    with pytest.raises(TypeError, match=r"^CheckpointStore\(\) got an unexpected keyword"):
        StoreOptions.from_keywords(keep_last=2)  # retention is not the store's


def test_route_sends_keywords_to_their_owners_every_class_getting_a_dict():
    given = {"keep_last": 5, "block_size": 8192, "incremental": False}
    parts = route("Thing", given, IncrementalOptions, RetentionOptions, TierOptions)
    assert parts == {
        IncrementalOptions: {"block_size": 8192, "incremental": False},
        RetentionOptions: {"keep_last": 5},
        TierOptions: {},
    }
    assert list(parts) == [IncrementalOptions, RetentionOptions, TierOptions]
    assert route("Thing", {}, FileOptions) == {FileOptions: {}}


def test_route_refuses_an_unknown_keyword_with_or_without_a_guess():
    with pytest.raises(TypeError) as got:
        route("Thing", {"max_chian": 3}, IncrementalOptions, RetentionOptions)
    assert str(got.value) == (
        "Thing() got an unexpected keyword argument 'max_chian' (did you mean 'max_chain'?)"
    )
    with pytest.raises(TypeError) as got:
        route("Thing", {"zzz": 3}, IncrementalOptions)
    assert str(got.value) == "Thing() got an unexpected keyword argument 'zzz'"
    with pytest.raises(TypeError, match="'keep_last'"):  # a field of a class not routed to
        route("Thing", {"keep_last": 3}, IncrementalOptions)


def test_fields_of_names_each_keyword_and_its_class():
    owners = fields_of(ArrayOptions, TierOptions)
    assert owners == {
        "distributed": ArrayOptions,
        "replicated": ArrayOptions,
        "cache": TierOptions,
        "redundancy": TierOptions,
        "redundancy_set": TierOptions,
        "node_name": TierOptions,
    }
