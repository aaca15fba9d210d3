"""A real, local Slurm cluster on this machine: one controller and N ``slurmd`` "nodes".

It exists to try hpcckpt and to test fault handling (time limits, requeues, node
failures) against the real Slurm daemons. It is not a production Slurm: every node
is ``localhost``, the configuration trusts its own CPU counts, and ``down`` forgets
every job.

Layout of the state directory (default ``$XDG_STATE_HOME/hpcckpt/cluster``)::

    slurm.conf          generated; clients need SLURM_CONF=<this file>
    cluster.json        the parameters the configuration was generated from
    ctld/               StateSaveLocation
    log/                slurmctld.log, slurmd-<node>.log, *.stdout of the daemons
    run/                pid files
    spool/<node>/       SlurmdSpoolDir of each node
    tmp-<node>/         TmpFS of each node (PMIx puts its per-step directories here)

Everything here uses the standard library only; every command is an argument list
run with a timeout.

Over 500 lines on purpose: :class:`LocalCluster` is one object whose methods share its
state directory, lock and daemon bookkeeping; configuration, munge, /proc and Slurm
commands live in config.py, munge.py, hpcckpt.procfs and hpcckpt.slurm.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hpcckpt import procfs
from hpcckpt.atomicfile import atomic_write
from hpcckpt.cluster import config
from hpcckpt.cluster.config import (
    DEBIAN_HINT,
    ClusterConfig,
    ClusterError,
    default_port,
    default_state_dir,
    read_pid,
    render_slurm_conf,
    slurm_env,
)
from hpcckpt.cluster.munge import ensure_munge, munge_works
from hpcckpt.rundir.env import CLUSTER_DAEMON_ENV as MARKER_ENV
from hpcckpt.rundir.env import CLUSTER_PORT_ENV as PORT_ENV
from hpcckpt.slurm import commands, parse
from hpcckpt.slurm.runner import SlurmCommandFailed, SlurmError

#: How long a daemon may take to fork into the background.
DAEMON_START_TIMEOUT = 30.0


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    left = [p for p in pids if procfs.pid_alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if procfs.pid_alive(p)]
    return left


def _kill(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"  ({path}: no such file)"
    return "\n".join("  " + line for line in text[-lines:]) or f"  ({path}: empty)"


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


@dataclass
class DaemonStatus:
    name: str
    pid: int | None
    running: bool


@dataclass
class NodeStatus:
    name: str
    state: str


class LocalCluster:
    """A local Slurm cluster whose configuration, pid files and logs live in ``state_dir``.

    >>> cluster = LocalCluster("/tmp/my-cluster", port=26817)
    >>> cluster.up(nodes=2)                 # doctest: +SKIP
    >>> subprocess.run(["sinfo"], env=cluster.slurm_env())   # doctest: +SKIP
    """

    def __init__(self, state_dir: str | os.PathLike[str] | None = None, port: int | None = None):
        self.state_dir = Path(state_dir).expanduser() if state_dir else default_state_dir()
        self.state_dir = self.state_dir.absolute()
        self._port = port

    # -- paths -----------------------------------------------------------------------
    @property
    def slurm_conf(self) -> Path:
        return self.state_dir / "slurm.conf"

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    @property
    def run_dir(self) -> Path:
        return self.state_dir / "run"

    def ctld_log(self) -> Path:
        return self.log_dir / "slurmctld.log"

    def slurmd_log(self, node: str) -> Path:
        return self.log_dir / f"slurmd-{node}.log"

    def _ctld_pidfile(self) -> Path:
        return self.run_dir / "slurmctld.pid"

    def _slurmd_pidfile(self, node: str) -> Path:
        return self.run_dir / f"slurmd-{node}.pid"

    @property
    def _munged_record(self) -> Path:
        """The pid of the munged this cluster started (absent if it reused one)."""
        return self.run_dir / "munged-started.pid"

    @property
    def _record(self) -> Path:
        return self.state_dir / "cluster.json"

    # -- environment -----------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """What to merge into a subprocess environment: ``{"SLURM_CONF": ...}``."""
        return {"SLURM_CONF": str(self.slurm_conf)}

    def slurm_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """A full environment for sbatch/squeue/srun against this cluster (see slurm_env)."""
        return slurm_env(self.slurm_conf, base)

    def export_line(self) -> str:
        return f"export SLURM_CONF={self.slurm_conf}"

    # -- configuration ---------------------------------------------------------------
    def config(self) -> ClusterConfig | None:
        """The configuration the current slurm.conf was generated from, if any."""
        try:
            data = json.loads(self._record.read_text())
            return ClusterConfig(**data["config"])
        except (OSError, ValueError, KeyError, TypeError, ClusterError):
            return None

    def nodes(self) -> list[str]:
        cfg = self.config()
        return cfg.node_names if cfg else []

    @contextlib.contextmanager
    def _locked(self, timeout: float = 300.0) -> Iterator[None]:
        """Serialize up/down/fail/restore between processes using the same state dir."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".lock", "a+") as fh:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise ClusterError(
                            f"another hpcckpt process holds {self.state_dir / '.lock'}"
                        ) from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # -- daemons ---------------------------------------------------------------------
    def _daemon_pids(self, kind: str, node: str | None = None) -> list[int]:
        """Live slurmctld/slurmd processes started with our slurm.conf (pid file or scan)."""
        conf = str(self.slurm_conf)
        found = []
        for pid in procfs.all_pids():
            argv = procfs.cmdline(pid)
            if not argv or os.path.basename(argv[0]) != kind or conf not in argv:
                continue
            if node is not None and not _has_node_arg(argv, node):
                continue
            if procfs.pid_alive(pid):
                found.append(pid)
        return sorted(found)

    def ctld_pid(self) -> int | None:
        pids = self._daemon_pids("slurmctld")
        pid = read_pid(self._ctld_pidfile())
        if pid in pids:
            return pid
        return pids[0] if pids else None

    def slurmd_pid(self, node: str) -> int | None:
        pids = self._daemon_pids("slurmd", node)
        pid = read_pid(self._slurmd_pidfile(node))
        if pid in pids:
            return pid
        return pids[0] if pids else None

    def _marked_pids(self) -> list[int]:
        """Every process carrying this cluster's marker: stepds, slurmscriptd, leftovers."""
        prefix = f"{self.state_dir}:"
        spare = procfs.self_and_ancestors()
        return [
            pid
            for pid in procfs.all_pids()
            if pid not in spare
            and procfs.pid_alive(pid)
            and procfs.environ(pid).get(MARKER_ENV, "").startswith(prefix)
        ]

    def _stepd_pids(self, node: str | None = None) -> list[int]:
        """slurmstepd processes of this cluster (of ``node`` only, if given)."""
        prefix = f"{self.state_dir}:"
        found = []
        for pid in procfs.all_pids():
            argv = procfs.cmdline(pid)
            if not argv or not argv[0].startswith("slurmstepd"):
                continue
            marker = procfs.environ(pid).get(MARKER_ENV, "")
            if not marker.startswith(prefix):
                continue
            if node is None or marker == prefix + node:
                found.append(pid)
        return found

    def _task_pids(self, node: str | None = None) -> list[int]:
        """Job processes (batch scripts, tasks) of this cluster.

        Found by their environment (``SLURM_CONF`` is ours and ``SLURMD_NODENAME`` is
        the node) or by descending from one of the node's slurmstepd processes.
        """
        conf = str(self.slurm_conf)
        spare = procfs.self_and_ancestors()
        stepds = set(self._stepd_pids(node))
        parents = procfs.parent_map()
        found = []
        for pid in parents:
            if pid in spare or pid in stepds:
                continue
            env = procfs.environ(pid)
            mine = "SLURM_JOB_ID" in env and env.get("SLURM_CONF") == conf
            if mine and (node is None or env.get("SLURMD_NODENAME") == node):
                found.append(pid)
            elif procfs.descends_from(pid, stepds, parents):
                found.append(pid)
        return found

    def node_pids(self, name: str) -> list[int]:
        """What runs "on" node ``name``: its slurmd, slurmstepds and job processes."""
        pids = self._daemon_pids("slurmd", name) + self._stepd_pids(name)
        return pids + [p for p in self._task_pids(name) if p not in pids]

    def _daemon_env(self, node: str | None) -> dict[str, str]:
        env = slurm_env(self.slurm_conf)
        env[MARKER_ENV] = f"{self.state_dir}:{node or 'ctld'}"
        return env

    def _spawn(self, argv: list[str], name: str, node: str | None) -> None:
        """Start a daemon that forks into the background; its stdout/stderr go to a file."""
        out = self.log_dir / f"{name}.stdout"
        with open(out, "ab") as fh:
            try:
                proc = subprocess.run(
                    argv,
                    env=self._daemon_env(node),
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=fh,
                    timeout=DAEMON_START_TIMEOUT,
                    cwd=self.state_dir,
                )
            except subprocess.TimeoutExpired as exc:
                raise ClusterError(f"{' '.join(argv)} did not daemonize") from exc
        if proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(argv)} exited {proc.returncode}\n{out}:\n{_tail(out)}\n"
                f"{self.log_dir}:\n{self._log_tails()}"
            )

    def _start_ctld(self) -> None:
        self._spawn([_need("slurmctld"), "-c", "-f", str(self.slurm_conf)], "slurmctld", None)

    def _start_slurmd(self, node: str) -> None:
        (self.state_dir / "spool" / node).mkdir(parents=True, exist_ok=True)
        (self.state_dir / f"tmp-{node}").mkdir(parents=True, exist_ok=True)
        argv = [_need("slurmd"), "-N", node, "-f", str(self.slurm_conf)]
        self._spawn(argv, f"slurmd-{node}", node)

    def _log_tails(self, nodes: list[str] | None = None) -> str:
        parts = [f"--- {self.ctld_log()}", _tail(self.ctld_log())]
        for node in nodes if nodes is not None else self.nodes():
            parts += [f"--- {self.slurmd_log(node)}", _tail(self.slurmd_log(node))]
        return "\n".join(parts)

    # -- queries ---------------------------------------------------------------------
    def node_states(self, timeout: float = 10.0) -> dict[str, str]:
        """``{node: state}`` from sinfo (e.g. ``idle``, ``down*``); empty if it cannot ask."""
        if not self.slurm_conf.exists():
            return {}
        try:
            return commands.node_states(timeout=timeout, env=self._client_env("sinfo"))
        except (SlurmError, ClusterError):
            return {}

    def sbatch(self, args: list[str], timeout: float = 30.0) -> int:
        """``sbatch --parsable ARGS`` against this cluster; returns the job id."""
        try:
            return int(commands.submit(args, timeout=timeout, env=self._client_env("sbatch")))
        except SlurmError as exc:
            raise ClusterError(str(exc)) from None

    def job_info(self, job_id: int | str, timeout: float = 10.0) -> dict[str, str]:
        """``scontrol show job -o ID`` as a dict (``JobState``, ``NodeList``, ``Restarts``...).

        Empty if Slurm no longer knows the job (MinJobAge is 300 s).
        """
        try:
            return commands.show_job(str(job_id), timeout=timeout, env=self._client_env("scontrol"))
        except SlurmCommandFailed:
            return {}
        except SlurmError as exc:
            raise ClusterError(str(exc)) from None

    def wait_job(
        self,
        job_id: int | str,
        states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
        timeout: float = 60.0,
    ) -> dict[str, str]:
        """Poll until the job's JobState is one of ``states``; returns its job_info."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"job {job_id} not in {'/'.join(states)} after {timeout:.0f} s "
                    f"(JobState={info.get('JobState', '?')} Reason={info.get('Reason', '?')})"
                )
            time.sleep(0.5)

    def job_ids(self, timeout: float = 15.0) -> list[int]:
        """Ids of every job Slurm lists in squeue (pending, running, completing)."""
        try:
            ids = commands.job_ids(timeout=timeout, env=self._client_env("squeue"))
        except SlurmCommandFailed:
            return []
        except SlurmError as exc:
            raise ClusterError(str(exc)) from None
        return [int(j) for j in ids if j.isdigit()]

    def cancel_jobs(self, timeout: float = 15.0) -> list[int]:
        """``scancel`` every job in squeue; returns their ids."""
        ids = self.job_ids(timeout)
        try:
            commands.cancel(map(str, ids), timeout=timeout, env=self._client_env("scancel"))
        except SlurmCommandFailed:
            pass  # a job that ended meanwhile
        except SlurmError as exc:
            raise ClusterError(str(exc)) from None
        return ids

    def _client_env(self, name: str) -> dict[str, str]:
        """The environment for Slurm client ``name`` against this cluster; ClusterError if
        the client is not installed (it may live in an sbin directory off PATH)."""
        env = self.slurm_env()
        env["PATH"] = os.path.dirname(_need(name)) + os.pathsep + env.get("PATH", "")
        return env

    def is_running(self) -> bool:
        """slurmctld and every configured slurmd are alive."""
        nodes = self.nodes()
        return bool(nodes) and self.ctld_pid() is not None and all(map(self.slurmd_pid, nodes))

    def status(self) -> dict:
        """Daemons (up/down, pids), node states and the SLURM_CONF line, as a plain dict."""
        cfg = self.config()
        nodes = cfg.node_names if cfg else []
        daemons = [DaemonStatus("slurmctld", (p := self.ctld_pid()), p is not None)]
        for node in nodes:
            pid = self.slurmd_pid(node)
            daemons.append(DaemonStatus(f"slurmd {node}", pid, pid is not None))
        states = self.node_states() if daemons[0].running else {}
        return {
            "state_dir": str(self.state_dir),
            "slurm_conf": str(self.slurm_conf),
            "export": self.export_line(),
            "configured": cfg is not None,
            "config": asdict(cfg) if cfg else None,
            "running": daemons[0].running and all(d.running for d in daemons),
            "munge": munge_works(),
            "daemons": [asdict(d) for d in daemons],
            "nodes": [asdict(NodeStatus(n, states.get(n, "unknown"))) for n in nodes],
            "logs": str(self.log_dir),
        }

    def wait_nodes(self, predicate, nodes: list[str] | None = None, timeout: float = 60.0,
                   what: str = "ready") -> float:  # fmt: skip
        """Poll sinfo until ``predicate(state)`` holds for every node; returns seconds waited."""
        nodes = self.nodes() if nodes is None else nodes
        start = time.monotonic()
        states: dict[str, str] = {}
        while True:
            states = self.node_states()
            if nodes and all(n in states and predicate(states[n]) for n in nodes):
                return time.monotonic() - start
            if self.ctld_pid() is None:
                raise ClusterError(f"slurmctld is not running\n{self._log_tails()}")
            if time.monotonic() - start > timeout:
                seen = ", ".join(f"{n}={states.get(n, '?')}" for n in nodes) or "nothing"
                raise ClusterError(
                    f"nodes not {what} after {timeout:.0f} s (sinfo: {seen})\n{self._log_tails()}"
                )
            time.sleep(0.5)

    def wait_idle(self, timeout: float = 60.0, nodes: list[str] | None = None) -> float:
        """Wait until sinfo shows every node ``idle``."""
        return self.wait_nodes(lambda s: s == "idle", nodes, timeout, "idle")

    def wait_responding(self, timeout: float = 60.0, nodes: list[str] | None = None) -> float:
        """Wait until every node answers and is usable (idle, mixed or allocated)."""
        return self.wait_nodes(parse.is_usable, nodes, timeout, "responding")

    # -- life ------------------------------------------------------------------------
    def up(
        self,
        nodes: int | None = None,
        cpus_per_node: int | None = None,
        port: int | None = None,
        kill_wait: int | None = None,
        timeout: float = 60.0,
        preempt: str | None = None,
        grace_time: int | None = None,
    ) -> bool:
        """Start the cluster (or keep the running one if its configuration matches).

        A parameter left at None keeps the value of the existing configuration in the
        state directory, else the default (1 node, 2 CPUs per node, port 16817 or
        ``$HPCCKPT_CLUSTER_PORT``, KillWait 10 s). Returns True if daemons were
        (re)started, False if a matching cluster was already running. A running cluster
        with another configuration is stopped and started again with the new one.
        """
        _check_binaries()
        old = self.config()
        defaults = old or ClusterConfig(port=default_port())
        cfg = ClusterConfig(
            nodes=defaults.nodes if nodes is None else nodes,
            cpus_per_node=defaults.cpus_per_node if cpus_per_node is None else cpus_per_node,
            port=port or self._port or defaults.port,
            kill_wait=defaults.kill_wait if kill_wait is None else kill_wait,
            preempt=defaults.preempt if preempt is None else preempt,
            grace_time=defaults.grace_time if grace_time is None else grace_time,
        )
        text = render_slurm_conf(self.state_dir, cfg)
        with self._locked():
            munged = ensure_munge()
            if munged is not None:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                self._munged_record.write_text(f"{munged}\n")
            current = self.slurm_conf.read_text() if self.slurm_conf.exists() else None
            if current == text and self.config() == cfg and self.ctld_pid() is not None:
                restarted = False
                for node in cfg.node_names:
                    if self.slurmd_pid(node) is None:
                        self._start_slurmd(node)
                        restarted = True
                self.wait_responding(timeout)
                return restarted
            self._down_locked()
            self._write_config(cfg, text)
            busy = [p for p in cfg.ports if not _port_free(p)]
            if busy:
                raise ClusterError(
                    f"port(s) {', '.join(map(str, busy))} already in use by another process; "
                    f"choose other ports with --port (or ${PORT_ENV})"
                )
            self._start_ctld()
            for node in cfg.node_names:
                self._start_slurmd(node)
            try:
                self.wait_idle(timeout)
            except ClusterError:
                self._down_locked()
                raise
            return True

    def _write_config(self, cfg: ClusterConfig, text: str) -> None:
        for sub in ("ctld", "log", "run", "spool"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
        for node in cfg.node_names:
            (self.state_dir / "spool" / node).mkdir(parents=True, exist_ok=True)
            (self.state_dir / f"tmp-{node}").mkdir(parents=True, exist_ok=True)
        atomic_write(self.slurm_conf, text, mode=None, temp=self.slurm_conf.stem + ".tmp")
        record = {"config": asdict(cfg), "created": time.time()}
        self._record.write_text(json.dumps(record, indent=2) + "\n")

    def down(self, timeout: float = 20.0, stop_munge: bool = True) -> list[int]:
        """Stop every daemon of this cluster and its jobs' processes; idempotent.

        With ``stop_munge``, also stops the munged that ``up`` started (never one it
        found running, nor while another slurmctld/slurmd on this machine remains).
        Returns the pids that were signalled.
        """
        with self._locked():
            pids = self._down_locked(timeout)
            return pids + (self._stop_munged_if_ours() if stop_munge else [])

    def _down_locked(self, timeout: float = 20.0) -> list[int]:
        daemons = self._daemon_pids("slurmctld") + self._daemon_pids("slurmd")
        for pidfile in (self._ctld_pidfile(), *self.run_dir.glob("slurmd-*.pid")):
            pid = read_pid(pidfile)
            # a pid file alone is trusted only if that process is a slurm daemon
            if pid and pid not in daemons and procfs.pid_alive(pid) and _is_slurm_daemon(pid):
                if str(self.slurm_conf) in procfs.cmdline(pid):
                    daemons.append(pid)
        _kill(daemons, signal.SIGTERM)
        left = _wait_gone(daemons, timeout)
        if left:
            _kill(left, signal.SIGKILL)
            _wait_gone(left, 5.0)
        jobs = self._task_pids()
        jobs += [p for p in self._marked_pids() if p not in jobs]
        _kill(jobs, signal.SIGKILL)
        _wait_gone(jobs, 5.0)
        for pidfile in (self._ctld_pidfile(), *self.run_dir.glob("slurmd-*.pid")):
            with contextlib.suppress(OSError):
                pidfile.unlink()
        return daemons + jobs

    def _stop_munged_if_ours(self) -> list[int]:
        """Stop the munged that ``up`` started, unless another Slurm daemon still needs it."""
        pid = read_pid(self._munged_record)
        if pid is None:
            return []
        argv = procfs.cmdline(pid)
        if not procfs.pid_alive(pid) or not argv or os.path.basename(argv[0]) != "munged":
            self._munged_record.unlink(missing_ok=True)
            return []
        if any(procfs.pid_alive(p) and _is_slurm_daemon(p) for p in procfs.all_pids()):
            return []  # another cluster (another state dir) still uses it; keep the record
        _kill([pid], signal.SIGTERM)
        if _wait_gone([pid], 10.0):
            _kill([pid], signal.SIGKILL)
        self._munged_record.unlink(missing_ok=True)
        return [pid]

    def fail_node(
        self, name: str, wait: bool = True, timeout: float = 90.0, wipe: Sequence[str] = ()
    ) -> float:
        """Power-loss of node ``name``: SIGKILL its slurmd, slurmstepds and job processes.

        ``wipe``: directories the node loses with it (its node-local storage, the node
        replaced by an empty one), ``%n`` standing for the node's name; removed after the
        kill. With ``wait``, returns once sinfo shows the node down (seconds waited).
        """
        for pattern in wipe:
            if "%n" not in pattern:
                raise ClusterError(
                    f"--wipe {pattern!r} names no node: put %n where the node's name goes "
                    "(e.g. /dev/shm/job/%n), so that only this node's directory is removed"
                )
        self._check_node(name)
        with self._locked():
            killed = []
            for _ in range(3):  # a step launched mid-kill is caught by the next pass
                pids = [p for p in self.node_pids(name) if p not in killed]
                if not pids:
                    break
                _kill(pids, signal.SIGKILL)
                killed += pids
                _wait_gone(pids, 5.0)
            with contextlib.suppress(OSError):
                self._slurmd_pidfile(name).unlink()
            for pattern in wipe:
                shutil.rmtree(pattern.replace("%n", name), ignore_errors=True)
        if not wait:
            return 0.0
        return self.wait_nodes(lambda s: s.startswith("down"), [name], timeout, "down")

    def restore_node(self, name: str, timeout: float = 60.0) -> float:
        """Start node ``name``'s slurmd again and wait until the node is usable."""
        self._check_node(name)
        with self._locked():
            if self.ctld_pid() is None:
                raise ClusterError("the cluster is not running; start it with `hpcckpt cluster up`")
            if self.slurmd_pid(name) is None:
                self._clear_stale_step_files(name)
                self._start_slurmd(name)
        return self.wait_responding(timeout, [name])

    def _clear_stale_step_files(self, name: str) -> None:
        """What a reboot would clear: PMIx sockets and directories of the killed steps.

        A SIGKILLed slurmstepd leaves ``spool/<node>/stepd.slurm.pmix.<job>.<step>``
        and ``pmix.<job>.<step>/`` behind; a requeued job keeps its id, so its next step 0
        on this node failed with "Cannot bind() UNIX socket ... Address already in use" and
        "Cannot create directory .../pmix.<job>.0/: File exists" (seen here).
        """
        if self._stepd_pids(name):
            return
        spool, tmp = self.state_dir / "spool" / name, self.state_dir / f"tmp-{name}"
        stale = [*spool.glob("stepd.slurm.pmix.*"), *spool.glob("pmix.*"), *spool.glob(f"{name}_*")]
        for path in [*stale, *tmp.glob("spmix_appdir_*")]:
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def _check_node(self, name: str) -> None:
        nodes = self.nodes()
        if not nodes:
            raise ClusterError(f"no cluster configured in {self.state_dir}")
        if name not in nodes:
            raise ClusterError(f"unknown node {name!r}; this cluster has {', '.join(nodes)}")
        if len(nodes) < 2:
            raise ClusterError(
                "the cluster has a single node; start several with `hpcckpt cluster up --nodes 2`"
            )


def _has_node_arg(argv: list[str], node: str) -> bool:
    for i, arg in enumerate(argv):
        if arg == "-N" and i + 1 < len(argv) and argv[i + 1] == node:
            return True
        if arg == f"-N{node}":
            return True
    return False


def _is_slurm_daemon(pid: int) -> bool:
    argv = procfs.cmdline(pid)
    return bool(argv) and os.path.basename(argv[0]) in ("slurmctld", "slurmd")


def _need(name: str) -> str:
    path = config.find_binary(name)
    if not path:
        raise ClusterError(f"{name} not found; {DEBIAN_HINT}")
    return path


def _check_binaries() -> None:
    needed = ("slurmctld", "slurmd", "sinfo", "munged", "munge")
    missing = [b for b in needed if not config.find_binary(b)]
    if missing:
        raise ClusterError(f"missing {', '.join(missing)}; {DEBIAN_HINT}")
