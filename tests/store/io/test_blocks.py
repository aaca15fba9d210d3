"""ChainPolicy: when a save may be a delta of the last one, and why not."""

import pytest

from hpcckpt.store.io.blocks import DEFAULT_MIN_DELTA_SAVING, ChainPolicy, ChainState

MiB = 1 << 20


def parent(chain_bytes: int = 0, length: int = 1) -> ChainState:
    chain = tuple((f"ckpt-{i}.h5", i, "u") for i in range(length))
    return ChainState(1, "u", MiB, 2, {}, {}, chain, chain_bytes, 0)


def test_a_delta_must_leave_out_min_delta_saving_per_array_and_rank():
    policy = ChainPolicy()
    arrays, ranks = 300, 2
    state = 300 * 2 * 100_000  # 100 kB per array and rank
    # Leaving out 64 KiB of each array on each rank: just worth a delta.
    need = DEFAULT_MIN_DELTA_SAVING * arrays * ranks
    assert policy.why_full(parent(), True, state - need, state, arrays, ranks) is None
    why = policy.why_full(parent(), True, state - need + 600, state, arrays, ranks)
    assert why == (
        "a delta would leave out 65,535 bytes per array and rank, less than min_delta_saving=65,536"
    )
    # 0 turns the rule off: any saving is worth a delta.
    tiny = 600 * 8
    assert policy.why_full(parent(), True, tiny // 4, tiny, arrays, ranks) is not None
    lax = ChainPolicy(min_delta_saving=0)
    assert lax.why_full(parent(), True, tiny // 4, tiny, arrays, ranks) is None


def test_every_other_reason_for_a_full_save_is_named():
    lax = ChainPolicy(max_chain=2, max_chain_fraction=0.5, min_delta_saving=0)
    state = 100 * MiB
    assert lax.why_full(parent(40 * MiB), True, 10 * MiB, state, 1, 1) is None
    cases = [
        (ChainPolicy(incremental=False), parent(), True, "incremental saves are off"),
        (lax, None, True, "no checkpoint of this run to build on"),
        (lax, parent(), False, "the arrays, ranks or block size differ"),
        (lax, parent(length=3), True, "the chain already holds max_chain=2"),
        (lax, parent(45 * MiB), True, "the chain's deltas would pass max_chain_fraction=0.5"),
    ]
    for policy, last, fits, why in cases:
        assert policy.why_full(last, fits, 10 * MiB, state, 1, 1).startswith(why)


@pytest.mark.parametrize("bad", [-1, 1.5, "64K", True])
def test_a_bad_min_delta_saving_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="min_delta_saving must be a byte count"):
        ChainPolicy(min_delta_saving=bad)
