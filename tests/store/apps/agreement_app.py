"""Test app: the ranks deciding together through one Agreement (hpcckpt/store/agreement.py).

    agreement_app.py

Run on 3 ranks. Every rank makes the same calls, some failing on one rank only, and
prints one JSON line: its rank and what each call gave it (the value, or the error's
type and message). A rank that hung in a call would leave mpirun to the test's timeout.
"""

import json

import numpy as np
from mpi4py import MPI

from hpcckpt.store.agreement import Agreement, describe
from hpcckpt.store.errors import CheckpointError, CorruptCheckpoint

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
agreement = Agreement(comm)
out: dict = {"rank": rank}


def outcome(call):
    """What ``call()`` gave this rank: its value, or the error it raised."""
    try:
        return {"value": call()}
    except Exception as exc:  # the report names the type: the test checks it
        got = {"error": type(exc).__name__, "message": str(exc)}
        if isinstance(exc, CorruptCheckpoint):
            got["culprit"] = exc.culprit
        return got


# agree: only rank 1 fails, then nobody does (the extras' sums ride along)
mine = ValueError("disk on fire") if rank == 1 else None
out["agree_one_failed"] = outcome(lambda: agreement.agree(mine, "checking step 4", extra=(rank,)))
mine = OSError(28, "No space left on device") if rank == 1 else None
out["agree_as_type_error"] = outcome(lambda: agreement.agree(mine, "encoding", TypeError))
out["agree_sums"] = outcome(lambda: agreement.agree(None, "counting", extra=(rank + 1, 10)))
# a failure every other rank only echoes (rank 0 failed, the others heard it from rank 0),
# and one every rank met alike: each reason is named once
cause = ValueError("disk on fire")
mine = cause if rank == 0 else CheckpointError(f"rank 0 could not create x.h5: {describe(cause)}")
out["agree_echoed"] = outcome(lambda: agreement.agree(mine, "writing step 5"))
mine = OSError(13, "Permission denied") if rank != 1 else KeyError("k")
out["agree_alike"] = outcome(lambda: agreement.agree(mine, "pruning"))
mine = RuntimeError("root only") if rank == 0 else None
out["agree_root"] = outcome(lambda: agreement.agree_root(mine, "pruning"))

# findings: rank 2 alone finds the checkpoint unusable here; damage on rank 1 (a culprit)
fatal = "array 'u' does not fit this run" if rank == 2 else None
out["findings_fatal"] = outcome(lambda: agreement.findings(None, fatal))
problem = "ckpt-2.h5: block 3 fails its checksum" if rank == 1 else None
culprit = "/ck/ckpt-2.h5" if rank == 1 else None
out["findings_problem"] = outcome(lambda: agreement.findings(problem, None, None, culprit))
problem = "ckpt-2.h5: damaged" if rank == 0 else None
out["findings_fatal_first"] = outcome(lambda: agreement.findings(problem, fatal))
payload = {"rows": rank} if rank != 1 else None
out["findings_payloads"] = outcome(lambda: agreement.findings(None, None, payload))

# the reductions
out["slowest"] = outcome(lambda: agreement.slowest(rank * 1.5, 10.0 - rank))
out["total"] = outcome(lambda: agreement.total(rank + 1))
out["anyone"] = outcome(lambda: [agreement.anyone(rank == 2), agreement.anyone(False)])
out["everyone"] = outcome(lambda: [agreement.everyone(rank < 3), agreement.everyone(rank != 1)])
out["from_root"] = outcome(lambda: agreement.from_root(lambda: f"computed on rank {rank}"))
array = np.arange(12, dtype=np.int32).reshape(3, 4) if rank == 0 else None
got = agreement.bcast_array(array)
out["bcast_array"] = {"value": [got.dtype.str, list(got.shape), got.ravel().tolist()]}
print(json.dumps(out), flush=True)
