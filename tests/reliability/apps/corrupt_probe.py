"""Apply mutations to a copy of a good checkpoint and classify what hpcckpt makes of each.

usage: corrupt_probe.py GOOD.h5 WORKDIR TRIALS.json RESULTS.jsonl START

TRIALS.json: a list of {"kind": "flip", "offset": o, "bit": b} or {"kind": "truncate",
"size": n}. For trial i >= START, one JSON line goes to RESULTS.jsonl:

- "detected": opening fails with CheckpointError or ``catalog.verify`` reports problems;
- "harmless": verify passes and every tree and array read equals the good file's;
- "wrong": verify passes but something read differs (the bug this suite hunts).

Runs in its own process so that a crash inside the HDF5 library on a damaged file
shows as a dead child (the parent records it and resumes with the next trial).
"""

import json
import shutil
import sys
from pathlib import Path

from hpcckpt.store import catalog
from hpcckpt.store.errors import CheckpointError
from hpcckpt.store.file.reader import CheckpointReader

good, work, trials_file, results_file, start = sys.argv[1:6]
good, work = Path(good), Path(work)
trials = json.loads(Path(trials_file).read_text())


def snapshot(path):
    with CheckpointReader(path) as r:
        out = {"step": r.step, "nranks": r.nranks, "arrays": sorted(r.arrays)}
        for rank in range(r.nranks):
            out[f"tree{rank}"] = r.tree_bytes(rank)
            for name in r.arrays:
                a = r.rank_array(name, rank)
                out[f"{name}@{rank}"] = (a.dtype.str, a.shape, a.tobytes())
    return out


reference = snapshot(good)
raw = good.read_bytes()
target = work / good.name
with open(results_file, "a") as results:
    for i in range(int(start), len(trials)):
        trial = trials[i]
        if target.exists():
            target.unlink()
        if trial["kind"] == "flip":
            data = bytearray(raw)
            data[trial["offset"]] ^= 1 << trial["bit"]
        else:
            data = raw[: trial["size"]]
        target.write_bytes(bytes(data))
        try:
            report = catalog.verify(target)
            if not report["good"]:
                verdict, detail = "detected", "; ".join(report["problems"])[:200]
            else:
                same = snapshot(target) == reference
                verdict, detail = ("harmless", "") if same else ("wrong", "verify passed")
        except CheckpointError as exc:
            verdict, detail = "detected", str(exc)[:200]
        except Exception as exc:  # an exception that escaped hpcckpt's checks
            verdict, detail = "escaped", f"{type(exc).__name__}: {exc}"[:200]
        results.write(json.dumps({"i": i, "verdict": verdict, "detail": detail}) + "\n")
        results.flush()
shutil.rmtree(work, ignore_errors=True)
