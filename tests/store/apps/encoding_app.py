"""Test app: encoding the ranks' states for a save (hpcckpt/store/tree/encoding.py).

    encoding_app.py

Run on 2 ranks. Each rank encodes a state whose "model" is replicated (the same on both)
and whose "u" is its own, then a state that only rank 1 cannot encode; it prints one JSON
line: its rank, the bytes the save would store, what it keeps of each array, rank 0's
answer as it arrived, and the error of the second encoding.
"""

import json

import numpy as np
from mpi4py import MPI

from hpcckpt.store.agreement import Agreement
from hpcckpt.store.io import blocks
from hpcckpt.store.options import ArrayOptions
from hpcckpt.store.tree.encoding import Encoder

BLOCK = 4096
comm = MPI.COMM_WORLD
rank = comm.Get_rank()
encoder = Encoder(Agreement(comm), ArrayOptions(replicated=["model"]), BLOCK)
model = {"w": np.linspace(0.0, 1.0, 1000), "b": np.ones(24, np.float32), "lr": 0.1}
state = {"model": model, "u": np.full(100 + 10 * rank, rank, np.int64)}
encoded = encoder.encode(3, state, answer=rank == 0)
expected = blocks.block_hashes(model["w"], BLOCK)
out = {
    "rank": rank,
    "state_bytes": encoded.state_bytes,
    "answer": encoded.answer,
    "replicated": sorted(encoded.replicated),
    "kept": {p: [list(a.shape), a.nbytes] for p, a in sorted(encoded.arrays.items())},
    "known_hashes": sorted(encoded.known_hashes),
    "hashes_right": bool(np.array_equal(encoded.known_hashes.get("model/w", expected), expected)),
}
bad = {"model": model, "u": {1, 2} if rank == 1 else np.zeros(3)}
try:
    encoder.encode(4, bad)
except TypeError as exc:
    out["error"] = str(exc)
print(json.dumps(out), flush=True)
