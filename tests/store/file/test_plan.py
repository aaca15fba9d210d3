"""Where each rank's bytes lie in a checkpoint file: ``hpcckpt.store.file.plan``, pure.

Every rank's specs go in as a gather would hand them to rank 0; no file, no MPI.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file.format import FULL, INCREMENTAL
from hpcckpt.store.file.plan import (
    ArraySpec,
    array_info,
    array_specs,
    plan_file,
    plan_layouts,
    rank_counts,
)
from hpcckpt.store.io import blocks
from hpcckpt.store.tree.state_tree import TAG, encode

F8 = np.dtype("float64").str


def spec(path: str, shape: tuple[int, ...], dtype: str = F8, **kw) -> ArraySpec:
    return ArraySpec(path, dtype, shape, **kw)


def test_the_plan_loads_neither_hdf5_nor_mpi():
    code = (
        "import sys, hpcckpt.store.file.plan; "
        "print(sorted(m for m in ('h5py', 'mpi4py') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_equal_trailing_shapes_stack_along_axis_0():
    (lay,) = plan_layouts([[spec("u", (3, 4))], [spec("u", (5, 4))], [spec("u", (0, 4))]])
    assert lay.layout == "rows" and lay.offsets == [0, 3, 8, 8]
    assert lay.global_shape == (8, 4) and lay.dtype == np.dtype("float64")
    assert all(type(o) is int for o in lay.offsets)  # JSON takes them as they are


def test_other_shapes_concatenate_their_elements():
    (lay,) = plan_layouts([[spec("v", (2, 3))], [spec("v", (3, 2, 1))], [spec("v", ())]])
    assert lay.layout == "flat" and lay.offsets == [0, 6, 12, 13]
    assert lay.global_shape == (13,)


def test_layouts_come_in_path_order_with_their_declarations():
    ranks = [[spec("b", (2,)), spec("a", (1,))], [spec("b", (2,)), spec("a", (1,))]]
    a, b = plan_layouts(ranks, distributed={"b"}, replicated={"a"})
    assert (a.path, a.replicated, a.distributed) == ("a", True, False)
    assert (b.path, b.replicated, b.distributed) == ("b", False, True)


@pytest.mark.parametrize(
    "per_rank, kwargs, message",
    [
        ([[spec("u", (1,))], [spec("w", (1,))]], {}, "rank 0 and rank 1 differ in ['u', 'w']"),
        ([[spec("u", (1,))]], {"distributed": {"x"}}, "declared distributed are not numpy"),
        ([[spec("u", (1,))]], {"distributed": {"u"}, "replicated": {"u"}}, "both distributed"),
        ([[spec("u", (1,))], [spec("u", (1,), "<f4")]], {}, "different dtypes on different"),
        (
            [[spec("u", (1,))], [spec("u", (1,), torch_dtype="bfloat16")]],
            {},
            "torch tensor on some ranks and not on others",
        ),
        ([[spec("u", (2, 3))], [spec("u", (2, 4))]], {"distributed": {"u"}}, "beyond axis 0"),
        ([[spec("u", ())]], {"distributed": {"u"}}, "(or are 0-d)"),
    ],
)
def test_states_that_do_not_fit_one_layout_name_the_array(per_rank, kwargs, message):
    with pytest.raises(CheckpointError) as err:
        plan_layouts(per_rank, **kwargs)
    assert message in str(err.value)


def dtensor(shape, offset, held, holder=True):
    return spec("w", held, global_shape=shape, offset=offset if holder else None)


def test_dtensor_pieces_that_fill_the_global_array_once():
    ranks = [[dtensor((4, 2), (0, 0), (2, 2))], [dtensor((4, 2), (2, 0), (2, 2))]]
    (lay,) = plan_layouts(ranks)
    assert lay.dtensor == ((4, 2), [(0, 0), (2, 0)])
    replica = [[dtensor((2,), (0,), (2,))], [dtensor((2,), (0,), (2,), holder=False)]]
    (lay,) = plan_layouts(replica)
    assert lay.dtensor == ((2,), [(0,), None])


@pytest.mark.parametrize(
    "ranks, kwargs, message",
    [
        ([[dtensor((4,), (0,), (4,))], [spec("w", (4,))]], {}, "DTensor on some ranks"),
        ([[dtensor((4,), (0,), (4,))], [dtensor((5,), (0,), (5,))]], {}, "global shapes"),
        ([[dtensor((4,), (0,), (4,))]], {"replicated": {"w"}}, "do not declare it"),
        ([[dtensor((4,), (2,), (4,))]], {}, "does not lie inside the global shape [4]"),
        ([[dtensor((5,), (0,), (2,))], [dtensor((5,), (2,), (2,))]], {}, "stored once"),
    ],
)
def test_dtensor_pieces_are_checked(ranks, kwargs, message):
    with pytest.raises(CheckpointError) as err:
        plan_layouts(ranks, **kwargs)
    assert message in str(err.value)


def test_array_specs_of_an_encoded_state():
    tree, arrays = encode({"u": np.zeros((3, 2), "<f4"), "n": 1})
    assert array_specs(tree, arrays) == [ArraySpec("u", "<f4", (3, 2))]
    node = {TAG: "tensor", "path": "w", "dtype": "bfloat16"}
    node["dtensor"] = {"shape": [8], "offset": [4], "holder": True}
    held = {"w": np.zeros(4, "<u2")}
    assert array_specs(node, held) == [ArraySpec("w", "<u2", (4,), "bfloat16", (8,), (4,))]
    node["dtensor"] = {"shape": [8], "offset": [4], "holder": False}
    assert array_specs(node, held)[0].offset is None


def test_rank_counts_of_a_full_and_of_a_delta():
    bs = 64  # 8 float64 per block
    arrays = {"u": np.zeros(20)}
    hashes = {"u": blocks.block_hashes(arrays["u"], bs)}
    assert rank_counts(arrays, hashes, None, bs) == {"u": (3, 3, 20)}
    assert rank_counts(arrays, hashes, {"u": np.array([2])}, bs) == {"u": (3, 1, 4)}


def gathered_for(nranks: int, dirty: int, fits: bool = True):
    """What ``nranks`` ranks holding u: float64[8] in blocks of 2 elements send rank 0."""
    specs = [spec("u", (8,))]
    return [(specs, 10 + r, fits, {"u": (4, dirty, 2 * dirty)}) for r in range(nranks)]


def parent(nranks: int) -> blocks.ChainState:
    hashes = {"u": np.zeros(4, np.uint64)}
    chain = (("ckpt-1.h5", 1, "id"),)
    return blocks.ChainState(1, "id", 16, nranks, {}, hashes, chain, 0, 64 * nranks)


def test_a_full_file_planned():
    plan = plan_file(gathered_for(2, 4), 2, {"u"}, (), None, blocks.ChainPolicy())
    assert plan.kind == FULL and not plan.incremental and plan.why_full
    assert plan.tree_offsets.tolist() == [0, 10, 21]
    assert plan.hash_offsets.tolist() == [0, 4, 8]
    assert (plan.state_bytes, plan.data_bytes) == (128, 128)
    assert (plan.total_blocks, plan.dirty_blocks) == (8, 8)


def test_a_delta_planned_and_refused():
    policy = blocks.ChainPolicy(min_delta_saving=0)
    plan = plan_file(gathered_for(2, 1), 2, {"u"}, (), parent(2), policy)
    assert plan.kind == INCREMENTAL and plan.why_full is None
    assert (plan.delta_bytes, plan.data_bytes, plan.dirty_blocks) == (32, 32, 2)
    unfit = plan_file(gathered_for(2, 1, fits=False), 2, {"u"}, (), parent(2), policy)
    assert unfit.kind == FULL and "differ from the last checkpoint" in unfit.why_full
    assert (unfit.data_bytes, unfit.dirty_blocks) == (128, 8)


def test_array_info_says_how_the_ranks_parts_lie():
    (lay,) = plan_layouts([[spec("u", (3, 4))], [spec("u", (5, 4))]], distributed={"u"})
    assert array_info(lay, False, 64) == {
        "layout": "rows",
        "rank_offsets": [0, 3, 8],
        "rank_shapes": [(3, 4), (5, 4)],
        "distributed": True,
    }
    delta = array_info(lay, True, 64)
    assert delta["shape"] == (8, 4) and delta["block_elems"] == 8
    ranks = [[dtensor((4,), (0,), (4,), holder=True)], [dtensor((4,), (0,), (4,), False)]]
    (lay,) = plan_layouts(ranks)
    assert array_info(lay, False, 64)["dtensor"] == {"shape": [4], "offsets": [[0], None]}
    (rep,) = plan_layouts([[spec("r", (2,), torch_dtype="bfloat16")]], replicated={"r"})
    info = array_info(rep, False, 64)
    assert info["replicated"] is True and info["torch_dtype"] == "bfloat16"
