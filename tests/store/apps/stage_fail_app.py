"""One rank's copy into host buffers fails (MemoryError) during a staged save: every rank
raises the same CheckpointError, nothing is left in the directory, and the next staged
save commits. Prints one JSON report per rank."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.save.staging import HostBuffers
from hpcckpt.store.store import CheckpointStore

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
directory = Path(sys.argv[1])
store = CheckpointStore(directory, comm, incremental=False)
buffers = HostBuffers()
state = {"u": np.full(100000, float(rank))}


class Failing(HostBuffers):
    def stage(self, *args, **kwargs):
        raise MemoryError("no memory for the staging (test)")


out: dict = {"rank": rank}
try:
    store.begin_save(1, state, buffers=Failing() if rank == 1 else buffers)
    out["raised"] = None
except CheckpointError as exc:
    out["raised"] = str(exc)
comm.Barrier()
out["left"] = sorted(p.name for p in directory.iterdir() if p.name.startswith("ckpt-"))
result = store.finish_save(store.begin_save(2, state, buffers=buffers))
out["committed"] = result.path.name
back = {"u": np.zeros(100000)}
out["restored"] = store.restore(back).step
out["exact"] = bool(np.array_equal(back["u"], state["u"]))
store.close()
print(json.dumps(out), flush=True)
