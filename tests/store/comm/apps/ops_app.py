"""Every operation of the communicator interface, checked on each rank: the same checks
for both transports. ``ops_app.py mpi`` under mpirun; ``ops_app.py torch N`` starts N
processes with torch.multiprocessing over gloo (no MPI). Each rank prints one JSON line."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

import numpy as np


def check_every_operation(comm) -> dict:
    from hpcckpt.store import comm as C

    n, me = comm.size, comm.rank
    done = []

    def ok(name):
        done.append(name)
        if os.environ.get("OPS_TRACE"):
            print(me, name, file=sys.stderr, flush=True)

    comm.barrier()
    ok("barrier")
    assert comm.bcast({"from": me} if me == n - 1 else None, root=n - 1) == {"from": n - 1}
    ok("bcast")
    got = comm.gather(("r", me), root=n - 1)
    assert got == ([("r", r) for r in range(n)] if me == n - 1 else None), got
    ok("gather")
    assert comm.allgather(me * 10) == [r * 10 for r in range(n)]
    ok("allgather")
    assert comm.scatter([f"item{r}" for r in range(n)] if me == 0 else None) == f"item{me}"
    ok("scatter")
    assert comm.allreduce(me + 1, C.SUM) == n * (n + 1) // 2
    assert comm.allreduce(me, C.MAX) == n - 1 and comm.allreduce(me, C.MIN) == 0
    assert comm.allreduce(0.5 * me, C.MAX) == 0.5 * (n - 1)
    assert comm.allreduce(me == 0, C.LOR) is True and comm.allreduce(me == 0, C.LAND) is False
    assert comm.allreduce(True, C.LAND) is True
    ok("allreduce")
    big = 2**40 + me
    total = comm.allreduce_array(np.array([1, big], dtype=np.int64), C.SUM)
    assert total.dtype == np.int64 and total.tolist() == [n, sum(2**40 + r for r in range(n))]
    worst = comm.allreduce_array(np.array([me * 1.5, -me], dtype=np.float64), C.MAX)
    assert worst.tolist() == [(n - 1) * 1.5, 0.0]
    flags = comm.allreduce_array(np.array([me == 1, 0], dtype=np.int32), C.MAX)
    assert flags.dtype == np.int32 and flags.tolist() == [1, 0]
    ok("allreduce_array")
    send = np.array([me, -me, 7], dtype=np.int64)
    recv = np.zeros(3, dtype=np.int64)
    req = comm.iallreduce_array(send, recv, C.MAX)
    while not req.test():
        pass
    req.wait()
    assert recv.tolist() == [n - 1, 0, 7]
    # a timed wait: rank 0 posts late, so the others' short waits time out, then complete
    if me == 0:
        time.sleep(0.5)
    recv[:] = 0
    req = comm.iallreduce_array(send, recv, C.MAX)
    timed_out = 0
    while not req.wait_for(0.05):
        timed_out += 1
    assert recv.tolist() == [n - 1, 0, 7]
    assert me == 0 or timed_out >= 3, timed_out
    ok("iallreduce_array")
    before = comm.exscan_sum(np.array([me + 1, 2 * (me + 1)], dtype=np.int64))
    assert before.tolist() == [sum(range(1, me + 1)), 2 * sum(range(1, me + 1))], before
    ok("exscan_sum")
    raw = np.arange(1000, dtype=np.uint8) if me == 1 else np.zeros(1000, dtype=np.uint8)
    comm.bcast_bytes(raw, root=1)
    assert raw.tolist() == np.arange(1000, dtype=np.uint8).tolist()
    ok("bcast_bytes")
    words = np.array([1 << (me + 60), 3 << me, 2**64 - 1 - me], dtype=np.uint64)
    xor = np.bitwise_xor.reduce(
        [np.array([1 << (r + 60), 3 << r, 2**64 - 1 - r], np.uint64) for r in range(n)]
    )
    out = np.empty(3, dtype=np.uint64) if me == 1 else None
    comm.reduce_array(words, out, C.BXOR, root=1)
    if me == 1:
        assert out.tolist() == xor.tolist(), (out, xor)
    ok("reduce_array")
    blocks = np.array([[(r + 1) << (4 * me) for _ in range(2)] for r in range(n)], np.uint64)
    mine = np.empty(2, dtype=np.uint64)
    comm.reduce_scatter_block(blocks, mine, C.BXOR)
    want = 0
    for r in range(n):
        want ^= (me + 1) << (4 * r)
    assert mine.tolist() == [want, want]
    ok("reduce_scatter_block")
    right, left = (me + 1) % n, (me - 1) % n
    comm.send({"to": right, "x": [0, 1, 2], "doc": {"step": 7}}, right, tag=11)
    comm.send("second", right, tag=11)
    got = comm.recv(left, tag=11)
    assert got == {"to": me, "x": [0, 1, 2], "doc": {"step": 7}}
    assert comm.recv(left, tag=11) == "second"
    ok("send/recv")
    if me == 0:
        comm.send_bytes(b"abc" * 1000, 1, tag=5)
        comm.send_bytes(np.arange(6, dtype=np.int32), 1, tag=6)
        comm.send_bytes(b"", 1, tag=7)  # nothing to send: nothing travels
    elif me == 1:
        into = bytearray(3000)
        comm.recv_bytes(into, 0, tag=5)
        assert bytes(into) == b"abc" * 1000
        arr = np.zeros(6, dtype=np.int32)
        comm.recv_bytes(arr, 0, tag=6)
        assert arr.tolist() == list(range(6))
        comm.recv_bytes(bytearray(0), 0, tag=7)
    ok("send_bytes/recv_bytes")
    size = 1 << 20
    out_b = np.full(size + me, me + 1, dtype=np.uint8)
    in_b = np.zeros(size + left, dtype=np.uint8)
    comm.sendrecv_bytes(out_b, right, in_b, left, tag=71)
    assert (in_b == left + 1).all()
    empty = np.zeros(0, dtype=np.uint8)
    comm.sendrecv_bytes(empty, right, empty, left, tag=72)
    ok("sendrecv_bytes")
    sub = comm.split(0 if me % 2 == 0 else None, key=-me)
    if me % 2:
        assert sub is None
    else:
        evens = list(range(0, n, 2))
        assert sub.size == len(evens) and sub.rank == len(evens) - 1 - evens.index(me)
        assert sub.allgather(me) == sorted(evens, reverse=True)
        assert sub.allreduce(1, C.SUM) == len(evens)
    pairs = comm.split(me % 2, key=me)
    assert pairs.allgather(me) == [r for r in range(n) if r % 2 == me % 2]
    ok("split")
    node = comm.split_node()
    hosts = comm.allgather(socket.gethostname())
    assert node.size == hosts.count(socket.gethostname())
    assert node.allgather(me) == [r for r in range(n) if hosts[r] == hosts[me]]
    again = comm.split_node()  # a second call: a new group of the same ranks
    assert again.allgather(me) == node.allgather(me)
    ok("split_node")
    # The same ranks for a background thread: its collectives run while the main
    # thread's go on over the original group, neither waiting for the other.
    bg = comm.background()
    assert bg is not None and (bg.rank, bg.size) == (me, n)
    got = {}
    thread = threading.Thread(
        target=lambda: got.update(
            sums=[bg.allreduce(me + k, C.SUM) for k in range(50)],
            root=bg.bcast("bg" if me == 0 else None),
        )
    )
    thread.start()
    mains = [comm.allreduce(1, C.SUM) for _ in range(50)]
    thread.join(60)
    assert not thread.is_alive() and mains == [n] * 50
    assert got["sums"] == [sum(range(n)) + n * k for k in range(50)] and got["root"] == "bg"
    ok("background")
    bg.free()
    again.free()
    pairs.free()
    if sub is not None:
        sub.free()
    ok("free")
    comm.barrier()
    return {"rank": me, "size": n, "done": done, "ops": sorted(C.OPERATIONS)}


def _torch_worker(rank: int, n: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    from hpcckpt.store.comm import as_comm, default_comm

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n)
    comm = default_comm()  # no MPI launcher, a process group: torch.distributed
    assert type(comm).__name__ == "TorchComm", comm
    assert as_comm(dist.group.WORLD).size == n
    report = check_every_operation(comm)
    report["mpi_loaded"] = "mpi4py.MPI" in sys.modules
    print(json.dumps(report), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if sys.argv[1] == "mpi":
        from mpi4py import MPI

        from hpcckpt.store.comm import as_comm, default_comm

        assert default_comm() == as_comm(MPI.COMM_WORLD)
        report = check_every_operation(as_comm(MPI.COMM_WORLD))
        print(json.dumps(report), flush=True)
    else:
        import torch.multiprocessing as mp

        n = int(sys.argv[2])
        assert not any(v in os.environ for v in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
        mp.spawn(_torch_worker, args=(n, free_port(), "gloo"), nprocs=n, join=True)
