"""The kernel's list of written pages (hpcckpt/store/save/write_tracking.py), on this machine's
real kernel: writes by us, by the kernel and by another process are reported; memory
that is zapped, replaced or shared is never trusted."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpcckpt import procfs
from hpcckpt.store.save import write_tracking
from hpcckpt.store.save.write_tracking import PAGE, WriteTracker

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_DONTNEED = 4
MAP_FIXED = 0x10
PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
STEP = 64 << 10  # block bytes used by most tests


# Trackers are released between tests (tests/store/conftest.py).
pytestmark = pytest.mark.usefixtures("trackers_released")


def addr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def expected_blocks(a: np.ndarray, offsets, step: int) -> np.ndarray:
    """The blocks of the pages holding the given byte offsets of ``a``."""
    ptr, out = addr(a), set()
    for off in offsets:
        page = (ptr + int(off)) // PAGE * PAGE
        lo, hi = max(page, ptr), min(page + PAGE, ptr + a.nbytes)
        out.update(range((lo - ptr) // step, (hi - 1 - ptr) // step + 1))
    return np.array(sorted(out), dtype=np.int64)


def assert_found(got: np.ndarray, want: np.ndarray, a: np.ndarray, step: int = STEP) -> None:
    """``got`` is ``want`` exactly, but for the first and last block when their page also
    holds memory outside the array (a neighbour's write marks them: a hash more)."""
    edges = set()
    if addr(a) % PAGE:
        edges.add(0)
    if (addr(a) + a.nbytes) % PAGE:
        edges.add(-(-a.nbytes // step) - 1)
    assert set(want.tolist()) <= set(got.tolist()), (got, want)
    assert set(got.tolist()) - set(want.tolist()) <= edges, (got, want)


def tracked(a: np.ndarray, path: str = "a", step: int = STEP) -> WriteTracker:
    t = WriteTracker()
    try:
        assert t.track(path, a, step) is None
        assert t.candidate_blocks(path, a, step) is None  # not trusted before a commit
        t.committed("base")
        assert t.candidate_blocks(path, a, step).size == 0
    except BaseException:
        # A failed test keeps its frames (and this tracker) alive in pytest's report: an
        # open tracker would keep its memory registered, and the next tests' arrays at
        # those addresses would fail to register (EBUSY) for no fault of their own.
        t.close()
        raise
    return t


def test_the_kernel_feature_is_available_here():
    # This machine's kernel has it (6.18, CONFIG_USERFAULTFD, CONFIG_PTE_MARKER_UFFD_WP):
    # a failure here means the feature (or our probe of it) broke, never a skip.
    assert write_tracking.why_unavailable() is None
    assert write_tracking.available()


def test_available_to_an_unprivileged_user():
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to run as nobody"
    probe = "from hpcckpt.store.save import write_tracking as w; print(repr(w.why_unavailable()))"
    r = subprocess.run(
        [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            sys.executable,
            "-c",
            probe,
        ],
        capture_output=True,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "None", r.stdout


def test_random_page_writes_are_found_exactly():
    rng = np.random.default_rng(1)
    a = rng.random(32 << 17)  # 32 MiB
    t = tracked(a)
    for rnd in range(3):
        offsets = rng.choice(a.nbytes // 8, 300, replace=False) * 8
        a.view(np.uint8)[offsets] += 1
        got = t.candidate_blocks("a", a, STEP)
        assert_found(got, expected_blocks(a, offsets, STEP), a)
        t.committed(f"s{rnd}")
        assert t.candidate_blocks("a", a, STEP).size == 0  # the scan protected them again


def test_a_kernel_write_into_the_array_is_found():
    a = np.zeros(4 << 17)
    t = tracked(a)
    r, w = os.pipe()
    os.write(w, b"x" * 100)
    os.readv(r, [memoryview(a).cast("B")[3 * STEP + 10 : 3 * STEP + 110]])
    os.close(r), os.close(w)
    assert 3 in t.candidate_blocks("a", a, STEP).tolist()


def test_a_write_by_another_process_is_found():
    # Open MPI's single-copy (CMA) receive: the sender's process writes into our memory.
    a = np.zeros(8 << 17)
    t = tracked(a)
    target = addr(a) + 5 * STEP + 123
    child = f"""
import ctypes
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
libc = ctypes.CDLL(None, use_errno=True)
data = ctypes.create_string_buffer(b"\\x07" * 64)
local = iovec(ctypes.cast(data, ctypes.c_void_p), 64)
remote = iovec({target}, 64)
n = libc.process_vm_writev({os.getpid()}, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
assert n == 64, ctypes.get_errno()
"""
    libc.prctl(0x59616D61, ctypes.c_ulong(-1 & 0xFFFFFFFFFFFFFFFF), 0, 0, 0)  # PR_SET_PTRACER any
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    assert a.view(np.uint8)[5 * STEP + 123] == 7
    assert_found(t.candidate_blocks("a", a, STEP), expected_blocks(a, [5 * STEP + 123], STEP), a)


def test_zapped_pages_count_as_changed():
    a = np.ones(8 << 17)
    t = tracked(a)
    start = -(-addr(a) // PAGE) * PAGE + 2 * STEP
    assert libc.madvise(start, 3 * PAGE, MADV_DONTNEED) == 0
    assert a.view(np.uint8)[start - addr(a)] == 0  # zeros, without a write
    off = start - addr(a)
    want = expected_blocks(a, [off, off + 2 * PAGE], STEP)
    assert set(want.tolist()) <= set(t.candidate_blocks("a", a, STEP).tolist())
    t.committed("after")
    # Read since (the zero page is mapped): still never trusted to be unchanged.
    assert set(want.tolist()) <= set(t.candidate_blocks("a", a, STEP).tolist())


def test_an_array_at_a_new_address_is_not_trusted():
    a = np.ones(4 << 17)
    t = tracked(a)
    b = np.ones(4 << 17)  # the state now holds another array under the same path
    assert t.candidate_blocks("a", b, STEP) is None
    assert t.track("a", b, STEP) is None
    assert t.candidate_blocks("a", b, STEP) is None  # only from the next commit on
    t.committed("next")
    # b's first page may hold a's tail and the allocator's header of b, written after a's
    # registration: reported once, which costs a hash of block 0, never a missed change.
    assert set(t.candidate_blocks("a", b, STEP).tolist()) <= {0}
    t.committed("after")
    assert t.candidate_blocks("a", b, STEP).size == 0


@pytest.mark.parametrize("unmap_first", [True, False])
def test_memory_replaced_at_the_same_address_is_not_trusted(unmap_first):
    size = 16 * STEP
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    base = libc.mmap(None, size, PROT_RW, flags, -1, 0)
    assert base not in (None, ctypes.c_void_p(-1).value)
    try:
        a = np.frombuffer((ctypes.c_char * size).from_address(base), dtype=np.uint8)
        a[:] = 1
        t = tracked(a)
        if unmap_first:
            assert libc.munmap(base, size) == 0
        again = libc.mmap(base, size, PROT_RW, flags | MAP_FIXED, -1, 0)
        assert again == base
        a[:] = 2  # same address, same size: new memory the kernel never protected
        assert t.candidate_blocks("a", a, STEP) is None
        assert t.tracked == set()  # dropped; the next save registers it again
        assert t.track("a", a, STEP) is None
        t.committed("again")
        a[7 * STEP] = 3
        assert t.candidate_blocks("a", a, STEP).tolist() == [7]
    finally:
        libc.munmap(base, size)


def test_views_sharing_pages_see_each_others_writes():
    buf = np.zeros(16 << 17)
    left, right = buf[: 10 << 17], buf[6 << 17 :]  # overlap: bytes 6..10 MiB of buf
    t = WriteTracker()
    assert t.track("left", left, STEP) is None and t.track("right", right, STEP) is None
    t.committed("base")
    buf[(8 << 17) + 5] = 1  # in both views
    got_left = t.candidate_blocks("left", left, STEP)  # this scan protects the page again
    got_right = t.candidate_blocks("right", right, STEP)
    off = ((8 << 17) + 5) * 8
    assert_found(got_left, expected_blocks(left, [off], STEP), left)
    assert_found(got_right, expected_blocks(right, [off - (6 << 20)], STEP), right)


def test_shared_and_file_backed_memory_is_refused(tmp_path):
    f = tmp_path / "m.bin"
    mapped = np.memmap(f, dtype=np.float64, mode="w+", shape=(1 << 17,))
    t = WriteTracker()
    assert "shared and file-backed" in t.track("m", mapped, STEP)
    shared = mmap.mmap(-1, 1 << 20, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
    s = np.frombuffer(shared, dtype=np.uint8)
    assert "shared" in t.track("s", s, STEP)
    private = mmap.mmap(os.open(f, os.O_RDWR), 1 << 20, flags=mmap.MAP_PRIVATE)
    p = np.frombuffer(private, dtype=np.uint8)
    assert "private and file-backed" in t.track("p", p, STEP)
    assert t.tracked == set()
    assert "C-contiguous" in t.track("n", np.ones((1024, 1024))[:, ::2], STEP)
    assert "smaller than one block" in t.track("tiny", np.ones(10), STEP)
    del s, p
    shared.close()
    private.close()
    del mapped


def test_a_refusal_for_the_memory_is_remembered_while_the_array_stays(tmp_path, monkeypatch):
    # /proc/self/maps takes ms to read in an MPI process: an array refused for its
    # memory is not looked up again at every save, unless it moved.
    reads = []
    real = procfs.memory_maps
    monkeypatch.setattr(procfs, "memory_maps", lambda: reads.append(1) or real())
    mapped = np.memmap(tmp_path / "m.bin", dtype=np.float64, mode="w+", shape=(1 << 17,))
    t = WriteTracker()
    for _ in range(3):
        assert "file-backed" in t.track("m", mapped, STEP)
        assert "file-backed" in t.why_not("m", mapped, STEP)
    assert len(reads) == 1
    other = np.memmap(tmp_path / "n.bin", dtype=np.float64, mode="w+", shape=(1 << 17,))
    assert t.why_not("m", other, STEP) is None  # another address: looked up again
    assert "file-backed" in t.track("m", other, STEP) and len(reads) == 2
    a = np.ones(4 << 17)
    assert t.why_not("a", a, STEP) is None and t.track("a", a, STEP) is None
    assert t.why_not("a", a, STEP) is None and len(reads) == 3
    t.close()
    del mapped, other


def test_procfs_memory_maps_sees_private_anonymous_memory():
    a = np.ones(4 << 17)
    areas = [m for m in procfs.memory_maps() if m.start <= addr(a) < m.end]
    assert len(areas) == 1 and areas[0].private_anonymous
    exe = [m for m in procfs.memory_maps() if m.path == os.path.realpath(sys.executable)]
    assert exe and not any(m.private_anonymous for m in exe)


def test_reset_forgets_everything():
    a = np.ones(4 << 17)
    t = tracked(a)
    t.reset()
    assert t.baseline is None and t.tracked == set()
    assert t.candidate_blocks("a", a, STEP) is None


def test_memory_tracked_by_another_tracker_is_refused():
    a = np.ones(4 << 17)
    first = tracked(a)
    second = WriteTracker()
    assert "cannot register it" in second.track("a", a, STEP)
    first.close()
    assert second.track("a", a, STEP) is None  # closing the first released it
    second.close()


#: A child that blocks the userfaultfd syscall (seccomp, as container runtimes do), then
#: asks for kernel change detection: refused, with the reason and the fix.
BLOCKED = """
import ctypes, sys
from hpcckpt.store.save import write_tracking
nr = write_tracking._SYSCALL[__import__("platform").machine()]
class F(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                ("k", ctypes.c_uint)]
class P(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(F))]
prog = (F * 4)(
    F(0x20, 0, 0, 0),  # load the syscall number
    F(0x15, 0, 1, nr),  # userfaultfd?
    F(0x06, 0, 0, 0x00050000 | 1),  # return ERRNO(EPERM)
    F(0x06, 0, 0, 0x7FFF0000),  # allow
)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(P(4, prog)), 0, 0) == 0, ctypes.get_errno()
from mpi4py import MPI
from hpcckpt.store.store import CheckpointStore
print(write_tracking.why_unavailable())
assert CheckpointStore(sys.argv[1], MPI.COMM_SELF).saver.changes.tracker is None  # auto: hashes
try:
    CheckpointStore(sys.argv[1], MPI.COMM_SELF, change_detection="kernel")
except ValueError as exc:
    print(exc)
"""


def test_without_the_syscall_kernel_detection_is_refused_and_auto_hashes(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", BLOCKED, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    reason, message = r.stdout.strip().splitlines()
    assert reason == "userfaultfd: Operation not permitted"
    assert message.startswith("change_detection='kernel': this kernel cannot track writes")
    assert "Operation not permitted" in message and "change_detection='hashes'" in message
