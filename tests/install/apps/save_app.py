"""Test app: one Checkpointer save under mpirun, and where its packages came from.

    save_app.py DIR

Every rank saves its own small array at step 3 and finishes. Rank 0 prints one JSON
line per rank: ``hpcckpt`` (the package's folder), ``h5py_mpi``, ``hdf5`` (the HDF5
h5py was built with), ``mpi`` (the MPI library mpi4py loaded) and ``saved`` (the step).
"""

import json
import os
import sys

import h5py
import numpy as np
from mpi4py import MPI

import hpcckpt

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
state = {"u": np.arange(1000, dtype=np.float64) * (rank + 1), "t": 0.5}
ck = hpcckpt.Checkpointer(sys.argv[1], comm=comm, every_steps=1)
saved = ck.save(3, state)
ck.finish()
report = {
    "rank": rank,
    "hpcckpt": os.path.dirname(hpcckpt.__file__),
    "h5py_mpi": bool(h5py.get_config().mpi),
    "hdf5": h5py.version.hdf5_version,
    "mpi": MPI.Get_library_version().splitlines()[0],
    "saved": None if saved is None else saved.step,
}
reports = comm.gather(report, root=0)
if rank == 0:
    print("\n".join(json.dumps(r) for r in reports), flush=True)
