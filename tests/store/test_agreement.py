"""How the ranks agree (hpcckpt/store/agreement.py): in one process (MPI.COMM_SELF), then
on 3 ranks under real mpirun, where one rank's failure must reach every rank alike."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from hpcckpt.store.agreement import (
    SHOWN,
    Agreement,
    Call,
    CallAgreement,
    Refused,
    describe,
    places,
)
from hpcckpt.store.errors import CallMismatch, CheckpointError, CorruptCheckpoint
from tests.mpi_helpers import mpirun, rank_reports

APP = Path(__file__).parent / "apps" / "agreement_app.py"


@pytest.fixture
def alone() -> Agreement:
    return Agreement(MPI.COMM_SELF)


# -- one process -----------------------------------------------------------------------------
def test_an_agreement_knows_its_ranks(alone):
    assert (alone.comm.mpi, alone.rank, alone.nranks) == (MPI.COMM_SELF, 0, 1)


def test_agree_returns_the_sums_of_the_extras(alone):
    assert alone.agree(None, "saving") == []
    assert alone.agree(None, "saving", extra=(3, 0, 1)) == [3, 0, 1]
    assert alone.agree(None, "saving", extra=(True, 2**40)) == [1, 2**40]


def test_agree_raises_the_kind_asked_with_the_reason_and_the_cause(alone):
    cause = ValueError("disk on fire")
    with pytest.raises(CheckpointError) as got:
        alone.agree(cause, "writing checkpoint of step 7", extra=(5,))
    assert (
        str(got.value) == "writing checkpoint of step 7 failed (rank 0: ValueError: disk on fire)"
    )
    assert got.value.__cause__ is cause
    with pytest.raises(TypeError, match=r"^encoding failed \(rank 0: KeyError: 'x'\)$"):
        alone.agree(KeyError("x"), "encoding", TypeError)


def test_agree_root_raises_only_for_an_error(alone):
    alone.agree_root(None, "pruning")
    with pytest.raises(CheckpointError, match=r"^pruning failed \(rank 0: OSError: gone\)$"):
        alone.agree_root(OSError("gone"), "pruning")


def test_describe_names_the_type_and_the_text():
    assert describe(OSError(28, "No space left")) == "OSError: [Errno 28] No space left"
    assert SHOWN >= 1


def test_findings_without_a_problem_give_the_payloads(alone):
    assert alone.findings(None, None) == [None]
    assert alone.findings(None, None, {"rows": 3}) == [{"rows": 3}]
    assert alone.findings(None, None, True) == [True]


def test_a_fatal_finding_is_refused(alone):
    with pytest.raises(Refused, match="^does not fit$"):
        alone.findings(None, "does not fit")
    with pytest.raises(Refused, match="^does not fit$"):  # refused before damage
        alone.findings("damaged", "does not fit", culprit="/ck/a.h5")


def test_a_problem_is_a_corrupt_checkpoint_naming_its_culprits(alone, tmp_path):
    with pytest.raises(CorruptCheckpoint, match="^a.h5: block 3 fails$") as got:
        alone.findings("a.h5: block 3 fails", None, culprit=tmp_path / "a.h5")
    assert got.value.culprit == [str(tmp_path / "a.h5")]
    with pytest.raises(CorruptCheckpoint, match="^damaged$") as got:
        alone.findings("damaged", None)
    assert got.value.culprit == []


def test_the_reductions_of_one_rank(alone):
    assert alone.slowest(1.5, 2.0, -3.0) == [1.5, 2.0, -3.0]
    assert alone.slowest() == []
    assert alone.total(7) == 7 and alone.total(np.int64(3)) == 3
    assert alone.anyone(True) and not alone.anyone(False)
    assert alone.everyone(True) and not alone.everyone(0)
    calls = []
    assert alone.from_root(lambda: calls.append(1) or "x") == "x" and calls == [1]


@pytest.mark.parametrize(
    "array",
    [np.arange(12, dtype=np.float32).reshape(3, 4), np.array(2.5), np.zeros((0, 3), np.int16)],
)
def test_bcast_array_of_one_rank_is_the_array(alone, array):
    got = alone.bcast_array(array)
    assert got.dtype == array.dtype and got.shape == array.shape and np.array_equal(got, array)


# -- the call agreement: which call and step each rank is in --------------------
def test_a_call_reads_as_written():
    assert (str(Call("save", 5)), str(Call("finish")), str(Call("due", -3))) == (
        "save(step=5)",
        "finish()",
        "due(step=-3)",
    )


def test_one_rank_always_agrees_and_gets_its_flags_back():
    calls = CallAgreement(MPI.COMM_SELF, flags=2)
    assert calls.complete() is None  # nothing in flight
    calls.slots[0], calls.slots[1] = 1, 0
    calls.post("due", 7, lagged=True)
    assert calls.complete() == [1, 0]
    calls.enter("finish")  # waits for its own agreement
    assert calls.request is None


@pytest.mark.parametrize("step", [None, 0, 5, -2, 2**34, 2**40])
def test_a_call_key_keeps_the_call_step_and_rank(step):
    calls = CallAgreement(MPI.COMM_SELF)
    calls.post("save", step)
    calls.complete()
    top = int(calls.recv[0])
    rank, call = calls._decode(top)
    assert rank == 0 and call.name == "save"
    if step is None or abs(step) < 2**34:  # the key keeps 36 bits of the step
        assert call.step == step


def test_calls_are_grouped_by_place():
    text = places({0: Call("save", 5), 1: Call("finish"), 2: Call("save", 5)})
    assert text == "ranks 0, 2 are in save(step=5), rank 1 is in finish()"
    many = places({r: Call("due", 3) for r in range(10)})
    assert many == f"ranks 0, 1, 2, 3 and {10 - SHOWN} more are in due(step=3)"


def test_a_mismatch_is_a_runtime_error_not_a_checkpoint_error():
    assert issubclass(CallMismatch, RuntimeError)
    assert not issubclass(CallMismatch, CheckpointError)


# -- three ranks -----------------------------------------------------------------------------
@pytest.mark.mpi
def test_three_ranks_reach_the_same_outcome_whichever_rank_fails():
    r = mpirun(3, [APP], timeout=120)  # a rank left waiting in a call would time out
    assert r.returncode == 0, r.stderr
    reports = rank_reports(r.stdout, 3)

    def every(key):
        got = [rep[key] for rep in reports]
        assert all(g == got[0] for g in got), (key, got)
        return got[0]

    failed = every("agree_one_failed")  # only rank 1 failed: every rank raises alike
    assert failed == {
        "error": "CheckpointError",
        "message": "checking step 4 failed (rank 1: ValueError: disk on fire)",
    }
    assert every("agree_as_type_error") == {
        "error": "TypeError",
        "message": "encoding failed (rank 1: OSError: [Errno 28] No space left on device)",
    }
    assert every("agree_echoed") == {  # the echoes of rank 0's error are not repeated
        "error": "CheckpointError",
        "message": "writing step 5 failed (rank 0: ValueError: disk on fire)",
    }
    assert every("agree_alike") == {  # one reason per distinct text, with its ranks
        "error": "CheckpointError",
        "message": "pruning failed (ranks 0, 2: PermissionError: [Errno 13] Permission denied; "
        "rank 1: KeyError: 'k')",
    }
    assert every("agree_sums") == {"value": [1 + 2 + 3, 30]}
    assert every("agree_root") == {
        "error": "CheckpointError",
        "message": "pruning failed (rank 0: RuntimeError: root only)",
    }
    assert every("findings_fatal") == {
        "error": "Refused",
        "message": "array 'u' does not fit this run",
    }
    assert every("findings_problem") == {
        "error": "CorruptCheckpoint",
        "message": "ckpt-2.h5: block 3 fails its checksum",
        "culprit": ["/ck/ckpt-2.h5"],
    }
    assert every("findings_fatal_first")["error"] == "Refused"
    assert every("findings_payloads") == {"value": [{"rows": 0}, None, {"rows": 2}]}
    assert every("slowest") == {"value": [3.0, 10.0]}
    assert every("total") == {"value": 6}
    assert every("anyone") == {"value": [True, False]}
    assert every("everyone") == {"value": [True, False]}
    assert every("from_root") == {"value": "computed on rank 0"}
    assert every("bcast_array") == {"value": ["<i4", [3, 4], list(range(12))]}
