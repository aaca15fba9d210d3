"""The Checkpointer: every rank checkpoints at the same step, and resumes from the newest good one.

It joins the *when* (interval, step count, stop signals) with the *where* (the
store) over MPI. All public methods are collective: every rank of ``comm`` calls
them in the same order with the same step.

Over 500 lines on purpose: it is the one public class, and every method is a collective
step whose order the ranks must agree on; the mechanics live in policy/, store/, rundir/.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcckpt import slurm
from hpcckpt.coord.levels import Levels, free_cache, restore_extra, scavenge_copy
from hpcckpt.coord.levels import resolve as resolve_levels
from hpcckpt.coord.signals import StopSignals
from hpcckpt.coord.validate import Validator, make_validator
from hpcckpt.coord.validate import guard as _validate_guard
from hpcckpt.policy import (
    CostTracker,
    Deadline,
    IntervalPolicy,
    initial_cost_estimate,
    job_mtbf,
    make_policy,
    multilevel,
    parse_duration,
    parse_end_time,
)
from hpcckpt.policy.durations import format_duration
from hpcckpt.rundir import events as job_events
from hpcckpt.rundir import status as job_status
from hpcckpt.rundir import verbosity
from hpcckpt.rundir.env import (
    ATTEMPT_ENV,
    CACHE_ENV,
    DIR_ENV,
    END_TIME_ENV,
    SIGNAL_ENV,
)
from hpcckpt.rundir.heartbeat import HeartbeatWriter
from hpcckpt.store import fast_tier, faults, safety, tensors
from hpcckpt.store.filesystem import TuningOptions
from hpcckpt.store.lock import DirectoryLock, DirectoryLocked
from hpcckpt.store.resharding import Split
from hpcckpt.store.retention import check_rules
from hpcckpt.store.staging import HostBuffers
from hpcckpt.store.staging_budget import parse_budget
from hpcckpt.store.state_tree import is_stateful
from hpcckpt.store.store import (
    CheckpointError,
    CheckpointStore,
    PendingSave,
    SaveResult,
    StagingRefused,
)

log = logging.getLogger("hpcckpt")

# Slots of the flag vector the ranks reduce (MAX) to agree on a decision. _BUSY is 0 only
# when every rank's background write of the pending staged save has finished.
_SIGNAL, _TIME, _DEADLINE, _BUSY = 0, 1, 2, 3

#: How often rank 0 asks Slurm again for the job's end time (it can be extended).
END_TIME_REFRESH = 300.0


def _configure_logging(rank: int) -> None:
    """One stderr handler with a rank prefix: rank 0's info lines, every rank's warnings.

    ``HPCCKPT_LOG_LEVEL`` (set by the wrapper's --quiet/--verbose): quiet keeps warnings
    only; verbose shows every rank's lines and the debug details.
    """
    if log.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"hpcckpt[{rank}] %(message)s"))
    log.addHandler(handler)
    level = verbosity.level_from_env()
    if level == verbosity.QUIET:
        log.setLevel(logging.WARNING)
    elif level == verbosity.VERBOSE:
        log.setLevel(logging.DEBUG)
    else:
        log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


class Checkpointer:
    """Coordinated checkpoints of per-rank state into one parallel HDF5 file per checkpoint.

    ``directory`` defaults to ``$HPCCKPT_DIR`` (set by the ``hpcckpt`` wrapper).

    When: with ``interval`` (seconds) or ``every_steps`` N (at steps N-1, 2N-1, ...,
    i.e. after every N steps of a loop counted from 0) the schedule is fixed;
    otherwise ``policy`` ("daly", the default, or "young") sets the interval from
    the job's MTBF (``mtbf``, or ``node_mtbf`` divided by the job's node count) and
    the checkpoint cost measured at every save, so it follows the real I/O cost.
    A stop signal (``signal``: ``$HPCCKPT_SIGNAL`` from the wrapper, else SIGUSR1;
    and SIGTERM) on any rank, or the
    job's end time coming close (``end_time``, ``$HPCCKPT_END_TIME`` or Slurm's),
    makes a checkpoint due at once; after it, ``stop_requested`` is true on every rank.

    Where: after each committed save the directory is pruned to the ``keep_last``
    newest good checkpoints (3 by default; None keeps all), plus one per
    ``keep_every`` steps and one per ``keep_every_seconds``. Arrays named in
    ``distributed`` are split along axis 0 across ranks and can be restored on
    another rank count; ``fs_tuning`` overrides the Lustre/GPFS tuning. See
    docs/format.md and docs/filesystems.md.

    Incremental saves (on by default, ``incremental=True``): only the blocks of
    ``block_size`` bytes (default 1 MiB) changed since the previous checkpoint are
    written; a full checkpoint follows ``max_chain`` incremental ones (8) or once the
    incrementals since the last full one pass ``max_chain_fraction`` (0.5) of its
    bytes, and a save is full when a delta would leave out fewer than
    ``min_delta_saving`` bytes (64 KiB) per array and rank. Retention keeps whatever a
    kept checkpoint is built on. ``change_detection`` says how a synchronous save finds
    the changed blocks: ``"kernel"`` (the pages
    written since the last save, as the kernel saw them; ValueError naming the reason
    where it cannot), ``"hashes"`` (hash every block), ``"auto"`` (the kernel's where it
    can, else hashes). See docs/format.md, "Incremental checkpoints".

    Safety (docs/reliability.md): rank 0 locks the directory (``DIR/hpcckpt.lock``) until
    ``finish()``/``close()``/exit, so a second job on it fails with DirectoryLocked naming
    the owner. Checkpoints are 0600 in a 0700 directory; ``share_group=True`` makes them
    0640/0750. A save that fails (e.g. ENOSPC) raises CheckpointError on every rank, or
    with ``on_save_error="warn"`` is logged and the run goes on.

    Poisoned state (docs/hang-and-poison.md): before every save each rank checks its state,
    ``validate="finite"`` (default: no NaN/Inf in float/complex arrays and float scalars),
    a callable ``validate(state) -> bool | str`` or None. If any rank rejects, nothing is
    committed, the state is kept as ``ckpt-<step>.h5.rejected``, an event ``rejected``
    names the ranks and arrays, and PoisonedState is raised on every rank.

    Saves that do not block for the write (docs/performance.md, "Asynchronous saves"):
    with ``async_save=True`` ``save`` copies the arrays into host buffers reused from
    save to save (one more copy of the rank's arrays in memory) and returns, within
    ``staging_budget`` bytes per rank (e.g. ``"4G"``; default half the node's available
    memory shared by its ranks): a larger state is copied in pieces while earlier pieces
    are written, and a save short of memory is written synchronously (event
    ``staging_refused``); with
    ``cache=PATH`` (e.g. ``/dev/shm/$SLURM_JOB_ID`` or a node-local NVMe) it writes
    them there instead, where they also survive a crash of the job's processes
    (``$HPCCKPT_CACHE`` sets ``cache`` for a whole job; ``finish()`` deletes the copies). A
    thread per rank then writes the checkpoint file; it is committed by the first
    ``due()`` (or ``save``, ``wait``, ``finish``, ``close``) after every rank's write is
    durable. One background write at a time: a save waits for the previous one. A
    background failure is raised (or warned, with ``on_save_error="warn"``) by the call
    that commits, and the checkpoint never becomes good. Checkpoints on a stop signal
    or at the deadline are written synchronously. ``restore`` takes a node-local copy
    newer than the directory's newest checkpoint when every rank still holds its part,
    on the same host, and it verifies.

    PyTorch training (docs/torch.md): a state may hold torch tensors and objects with
    ``state_dict()``/``load_state_dict()`` (modules, optimizers, schedulers, data loaders,
    :class:`hpcckpt.training.RNGState`...). ``replicated`` names key paths whose values
    are identical on every rank (a data-parallel model and optimizer): checked equal by
    checksum at each save, written once by rank 0, restorable on any rank count.

    Surviving a node (docs/async-and-fast-tier.md): ``%n`` in ``cache`` is the node's
    name (``node_name``, default ``$SLURMD_NODENAME`` or the hostname). With
    ``redundancy="partner"`` (a copy on the next node of the set) or ``"xor"`` (parity
    over a set) each save also writes redundancy across sets of ``redundancy_set`` ranks
    on distinct nodes (8; fewer nodes make smaller sets; ranks on one node only are an
    error) before it returns; ``restore`` then rebuilds a lost node's copies, moves copies
    to where the ranks now run, verifies every array, and falls back to the directory
    when it cannot. ``drain_every`` N keeps N-1 of N saves on the node-local tier only
    (``"auto"``: the interval and N from the two-level model, with ``local_fraction`` of
    failures survivable by the tier, 0.8 by default); ``finish()`` and ``close()`` drain
    a newest checkpoint the directory lacks. ``$HPCCKPT_REDUNDANCY`` ("xor", "xor:4",
    "partner") and ``$HPCCKPT_DRAIN_EVERY`` set them for a whole job.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        comm: MPI.Comm | None = None,
        *,
        interval: float | str | None = None,
        every_steps: int | None = None,
        policy: str | IntervalPolicy = "daly",
        mtbf: float | str | None = None,
        node_mtbf: float | str | None = None,
        initial_cost: float | str | None = None,
        end_time: float | str | None = None,
        deadline_safety: float = 1.5,
        deadline_margin: float = 20.0,
        signal: str | int | None = None,
        stop_signals: Iterable[str | int] = ("TERM",),
        keep_last: int | None = 3,
        keep_every: int | None = None,
        keep_every_seconds: float | None = None,
        distributed: Iterable[str] | Mapping[str, Split | None] = (),
        fs_tuning: TuningOptions | None = None,
        on_save_error: str = "raise",
        share_group: bool = False,
        incremental: bool = True,
        block_size: int | None = None,
        max_chain: int = 8,
        max_chain_fraction: float = 0.5,
        min_delta_saving: int | None = None,
        change_detection: str = "auto",
        validate: str | Validator | None = "finite",
        async_save: bool = False,
        cache: str | os.PathLike[str] | None = None,
        replicated: Iterable[str] = (),
        staging_budget: int | str | None = None,
        redundancy: str | None = None,
        redundancy_set: int | None = None,
        drain_every: int | str | None = None,
        local_fraction: float | None = None,
        node_name: str | None = None,
    ) -> None:
        directory = directory if directory is not None else os.environ.get(DIR_ENV)
        if not directory:
            raise ValueError(
                "Checkpointer needs a directory: pass Checkpointer(directory, ...) "
                f"or set {DIR_ENV} (the hpcckpt wrapper sets it from --ckpt-dir)"
            )
        if interval is not None:
            interval = _duration("interval", interval)
            if interval <= 0:
                raise ValueError(f"interval must be a positive number of seconds, not {interval!r}")
        if every_steps is not None and (int(every_steps) != every_steps or every_steps < 1):
            raise ValueError(f"every_steps must be a positive integer, not {every_steps!r}")
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.nranks = self.comm.Get_size()
        _configure_logging(self.rank)
        self.directory = Path(directory).absolute()
        self.every_steps = every_steps
        self.policy = self._make_policy(policy, interval, every_steps, mtbf, node_mtbf)
        self.costs = CostTracker()
        self._initial_cost = (
            None if initial_cost is None else _duration("initial_cost", initial_cost)
        )
        self._end_time_source, end = self._find_end_time(end_time)
        self.deadline = Deadline(end, safety=deadline_safety, margin=deadline_margin)
        self._end_time_checked = time.monotonic()
        check_rules(keep_last, keep_every, keep_every_seconds)
        if on_save_error not in ("raise", "warn"):
            raise ValueError(f"on_save_error must be 'raise' or 'warn', not {on_save_error!r}")
        self.on_save_error = on_save_error
        #: The poisoned-state guard run before every save (coord/validate.py).
        self.validator = make_validator(validate)
        self.retention = {
            "keep_last": keep_last,
            "keep_every": keep_every,
            "keep_every_seconds": keep_every_seconds,
        }
        levels = resolve_levels(redundancy, redundancy_set, drain_every, local_fraction, cache)
        #: The two levels: node-local saves and every how many one is drained.
        self.levels = Levels(levels)
        #: Every how many node-local checkpoints one is drained to the directory (None: chosen
        #: by the two-level model from the measured costs, see :meth:`level_plan`).
        self.drain_every = levels.drain_every
        self.local_fraction = levels.local_fraction
        #: This rank's node: the failure group of redundancy sets, ``%n`` in ``cache``.
        self.node_name = node_name or slurm.node_name() or socket.gethostname()
        self.store = CheckpointStore(
            self.directory,
            self.comm,
            redundancy=levels.redundancy,
            redundancy_set=levels.redundancy_set,
            node=self.node_name,
            distributed=distributed,
            tuning=fs_tuning,
            share_group=share_group,
            incremental=incremental,
            max_chain=max_chain,
            max_chain_fraction=max_chain_fraction,
            change_detection=change_detection,
            replicated=replicated,
            **({} if block_size is None else {"block_size": block_size}),
            **({} if min_delta_saving is None else {"min_delta_saving": min_delta_saving}),
        )
        cache = cache if cache is not None else (os.environ.get(CACHE_ENV) or None)
        self.cache = (
            Path(fast_tier.node_path(os.fspath(cache), self.node_name)).absolute()
            if cache is not None
            else None
        )
        if self.cache is not None:
            fast_tier.check_cache_dir(self.cache, self.directory)
        #: Host memory an async save stages into (None: not async, or staged to ``cache``).
        budget = parse_budget(staging_budget)  # docs/async-and-fast-tier.md, memory budget
        self.buffers = HostBuffers(budget) if async_save and self.cache is None else None
        self._pending: PendingSave | None = None
        self._pending_reason = ""
        #: The full cost of a checkpoint (staging to commit): what a deadline save costs.
        self.durable_costs = CostTracker()
        signal = signal if signal is not None else os.environ.get(SIGNAL_ENV, "USR1")
        self._signals = StopSignals([signal, *stop_signals])
        self._attempt = os.environ.get(ATTEMPT_ENV)

        self._send = np.zeros(4, dtype=np.int32)
        self._recv = np.zeros(4, dtype=np.int32)
        self._request: MPI.Request | None = None
        self._last_save_time = time.monotonic()
        self._last_save_step: int | None = None
        self._stop_pending: str | None = None
        self._last_step_seen: int | None = None
        self._stop_requested = False
        self._finished = False
        self.last_save: SaveResult | None = None

        error = None
        self._lock: DirectoryLock | None = None  # rank 0: one job per directory
        if self.rank == 0:
            try:
                safety.make_directory(self.directory, self.store.dir_mode)
                self._lock = DirectoryLock(
                    self.directory, mode=self.store.file_mode, job_id=slurm.job_id()
                ).acquire()
            except DirectoryLocked as exc:
                error = ("locked", str(exc))
            except OSError as exc:
                error = ("os", f"cannot create checkpoint directory {self.directory}: {exc}")
        error = self.comm.bcast(error)
        if error:
            raise DirectoryLocked(error[1]) if error[0] == "locked" else OSError(error[1])
        self._heartbeat = HeartbeatWriter(self.directory, self.rank)
        self._heartbeat.beat(None, force=True)
        # Every rank has its handlers now: the wrapper may forward signals.
        self.comm.Barrier()
        self._report(job_status.RUNNING)
        self._event(
            job_events.START,
            pid=os.getpid(),
            policy=self.describe_schedule(),
            end_time=self.deadline.end_time,
            end_time_source=self._end_time_source,
        )

    # -- when ----------------------------------------------------------------------
    def _make_policy(
        self,
        policy: str | IntervalPolicy,
        interval: float | None,
        every_steps: int | None,
        mtbf: float | str | None,
        node_mtbf: float | str | None,
    ) -> IntervalPolicy | None:
        """The time policy, or None when only ``every_steps`` (and stop requests) apply."""
        if interval is not None:
            return make_policy("fixed", interval=interval)
        if every_steps is not None:
            return None
        if isinstance(policy, IntervalPolicy):
            return policy
        if mtbf is not None:
            m = _duration("mtbf", mtbf)
        else:
            kwargs = {} if node_mtbf is None else {"node_mtbf": _duration("node_mtbf", node_mtbf)}
            m = job_mtbf(nodes=slurm.node_count(), **kwargs)
        return make_policy(policy, mtbf=m)

    def _find_end_time(self, given: float | str | None) -> tuple[str | None, float | None]:
        """(source, Unix end time): the argument, $HPCCKPT_END_TIME, or Slurm (rank 0 asks)."""
        if given is not None:
            return "argument", parse_end_time(given)
        text = os.environ.get(END_TIME_ENV)
        if text:
            return "environment", parse_end_time(text)
        job = slurm.job_id()
        if job is None:
            return None, None
        return "slurm", self.comm.bcast(self._ask_slurm_end_time(job) if self.rank == 0 else None)

    @staticmethod
    def _ask_slurm_end_time(job: str) -> float | None:
        try:
            end = slurm.end_time(job)
        except slurm.SlurmError as exc:
            log.warning(
                "cannot read the job's end time from Slurm (%s): no deadline checkpoint", exc
            )
            return None
        return None if end is None else end.timestamp()

    def _refresh_end_time(self) -> None:
        """Ask Slurm again, rarely (collective: called from save)."""
        if self._end_time_source != "slurm":
            return
        if time.monotonic() - self._end_time_checked < END_TIME_REFRESH:
            return
        self._end_time_checked = time.monotonic()
        job = slurm.job_id()
        end = self.comm.bcast(self._ask_slurm_end_time(job) if self.rank == 0 and job else None)
        if end is not None:
            self.deadline = Deadline(end, safety=self.deadline.safety, margin=self.deadline.margin)

    def describe_schedule(self) -> str:
        """The schedule in words, for logs and events."""
        parts = [] if self.policy is None else [self.policy.describe()]
        if self.every_steps is not None:
            parts.append(f"every {self.every_steps} steps")
        return " or ".join(parts)

    @property
    def cost_estimate(self) -> float:
        """Seconds one checkpoint is expected to take: measured, else the initial guess."""
        if self._initial_cost is None:
            self._initial_cost = initial_cost_estimate(0)
        return self.costs.get(self._initial_cost)

    @property
    def durable_cost_estimate(self) -> float:
        """Seconds a synchronous checkpoint is expected to take (the deadline plans with it)."""
        return self.durable_costs.get(self.cost_estimate)

    @property
    def staged(self) -> bool:
        """Whether saves return before the checkpoint file is written (async or cache)."""
        return self.buffers is not None or self.cache is not None

    @property
    def interval(self) -> float | None:
        """Seconds of work between checkpoints now (None when only steps count)."""
        if self.policy is None:
            return None
        plan = self.level_plan() if self.drain_every is None else None
        if plan is not None:  # two levels: the node-local interval of the model
            low = getattr(self.policy, "min_interval", 0.0)
            high = getattr(self.policy, "max_interval", plan.interval)
            return min(max(plan.interval, low), high)
        return self.policy.interval(self.cost_estimate)

    # -- helpers -----------------------------------------------------------------
    def _report(self, state: str, step: int | None = None, reason: str = "") -> None:
        if self.rank == 0:
            job_status.write_status(
                self.directory, job_status.RunStatus(state, self._attempt, step, reason)
            )

    def _event(self, kind: str, **fields: Any) -> None:
        if self.rank == 0:
            job_events.append_event(
                self.directory, kind, source="checkpointer", nranks=self.nranks, **fields
            )

    def _drain(self) -> None:
        """Complete and discard the reduction in flight (after a save it is stale)."""
        if self._request is not None:
            self._request.Wait()
            self._request = None

    # -- public API --------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """True on every rank once the checkpoint taken on a stop signal is committed."""
        return self._stop_requested

    def restore(self, state: dict[str, Any], only: Iterable[str] | None = None) -> int | None:
        """Fill ``state`` in place from the newest good checkpoint; its step, or None if none.

        Arrays and tensors are filled in place (the application's references stay valid);
        scalars are replaced in the dict; objects with ``load_state_dict`` get it called
        with their saved state dict. ``only`` restores just those top-level keys (e.g.
        the replicated model and optimizer on another rank count). Collective.
        """
        if self._initial_cost is None:
            nbytes = sum(a.nbytes for a in _arrays_in(state))
            self._initial_cost = initial_cost_estimate(self.comm.allreduce(nbytes))
        self._heartbeat.beat(None, "restore", force=True)  # hang watch: I/O allowance
        self._complete_pending()
        result = self.store.restore(state, cache=self.cache, only=only)
        for step, node, name, reason in self.store.local_set_aside:
            self._event(job_events.LOCAL_SET_ASIDE, step=step, node=node, file=name, reason=reason)
        self.store.local_set_aside = []
        self._heartbeat.beat(None, force=True)  # back to compute
        self._drain()
        self._last_save_time = time.monotonic()
        if result is None:
            log.info("no checkpoint in %s: starting from the beginning", self.directory)
            self._event(job_events.RESTORE, step=None)
            return None
        for step, reason in result.skipped:
            self._event(job_events.SKIP_BAD, step=step, reason=reason)
        for step, reason in result.local_skipped:
            self._event(job_events.LOCAL_SKIPPED, step=step, reason=reason)
        where = "node-local copy " if result.source == "cache" else ""
        how, extra = restore_extra(result, self.store.redundancy)
        log.info("restored step %d from %s%s%s", result.step, where, result.path.name, how)
        self._event(
            job_events.RESTORE, step=result.step, path=result.path.name, tier=result.source, **extra
        )
        if result.source == "cache":
            # The directory must hold the newest durable checkpoint: drain the copy
            # restored from (as it is, in the background) before the run goes on.
            self._event(job_events.CHECKPOINT_BEGIN, step=result.step, reason="restored")
            self._begin_staged(result.step, state, "restored", time.perf_counter(), redrain=True)
            self._last_save_time = time.monotonic()
        self._last_save_step = result.step
        return result.step

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``; collective, cheap, and the same on every rank.

        Ranks exchange their flags (signal seen, interval elapsed) with a non-blocking
        reduction whose result is used at the next call, so no rank waits for the
        others in the common case and all ranks decide on the same step.
        """
        self._last_step_seen = step
        self._heartbeat.beat(step)
        decided = np.zeros(4, dtype=np.int32)
        decided[_BUSY] = 1
        if self._request is not None:
            self._request.Wait()
            self._request = None
            decided[:] = self._recv
        if self._pending is not None and not decided[_BUSY]:
            self._complete_pending()  # every rank's bytes are durable: commit (collective)
        self._send[_SIGNAL] = 1 if self._signals.received is not None else 0
        interval = self.interval
        elapsed = time.monotonic() - self._last_save_time
        self._send[_TIME] = 1 if interval is not None and elapsed >= interval else 0
        cost = self.durable_cost_estimate
        self._send[_DEADLINE] = 1 if self.deadline.must_stop(time.time(), cost) else 0
        self._send[_BUSY] = 0 if self._pending is not None and self._pending.done() else 1
        self._request = self.comm.Iallreduce(self._send, self._recv, op=MPI.MAX)

        if decided[_SIGNAL]:
            self._stop_pending = "signal"
            return True
        if decided[_DEADLINE]:
            self._stop_pending = "deadline"
            return True
        if decided[_TIME]:
            return True
        # every_steps is aligned to the step numbers (steps N-1, 2N-1, ... for a loop from 0),
        # so a run resumed after an off-schedule stop checkpoint returns to the same schedule.
        return self.every_steps is not None and (step + 1) % self.every_steps == 0

    def save(self, step: int, state: dict[str, Any]) -> SaveResult | None:
        """Write a coordinated checkpoint of ``state`` at ``step``; collective.

        Returns once the checkpoint is committed: written by every rank, durable and
        renamed into place. After a save triggered by a stop signal, ``stop_requested``
        becomes true. A failed save (a full disk...) raises CheckpointError on every rank,
        or with ``on_save_error="warn"`` returns None and the run goes on.

        With ``async_save`` or ``cache`` (and not on a stop signal or the deadline) it
        returns once the state is staged: the result's ``blocked_seconds`` is what the
        ranks waited, and the checkpoint is committed later (see the class docs).
        """
        self._drain()
        t0 = time.perf_counter()
        self._complete_pending()  # at most one background write: wait for the previous
        stop = self._stop_pending
        reason = stop or ("steps" if self.policy is None else "interval")
        self._event(job_events.CHECKPOINT_BEGIN, step=step, reason=reason)
        self._heartbeat.beat(step, "save", force=True)
        _validate_guard(self, step, state, event=self._event)  # PoisonedState on every rank
        if self.cache is not None and not stop and self._local_only():
            return self._save_local(step, state, reason, t0)
        if self.staged and not stop:
            self.levels.local_saves = 0
            try:
                return self._begin_staged(step, state, reason, t0)
            except StagingRefused as exc:  # every rank alike: too little memory to stage
                log.warning("checkpoint step %d written synchronously: %s", step, exc)
                self._event(job_events.STAGING_REFUSED, step=step, reason=str(exc))
        try:
            result = self.store.save(step, state, extra_meta={"reason": reason})
        except CheckpointError as exc:  # on every rank alike
            if self._save_failed(step, stop, reason, exc):
                raise
            return None
        faults.fault_point("checkpointer.saved")
        self.costs.add(result.seconds)
        self.durable_costs.add(result.seconds)
        self._committed(result, reason, stop)
        return result

    def _local_only(self) -> bool:
        """Whether this save stays node-local (``drain_every``: only every Nth drains)."""
        return self.levels.local_only(self.level_plan())

    def level_plan(self) -> multilevel.LevelPlan | None:
        """With ``drain_every="auto"``: the two-level model's node-local interval and drain
        period for the measured costs (node-local save: the blocked time; drain: the
        full cost) and the policy's MTBF; None without a cache or an MTBF-based policy."""
        mtbf = getattr(self.policy, "mtbf", None)
        return self.levels.plan(
            mtbf, self.cost_estimate, self.durable_cost_estimate, self.cache is not None
        )

    def _save_local(
        self, step: int, state: dict[str, Any], reason: str, t0: float
    ) -> SaveResult | None:
        """A checkpoint on the node-local tier (and its redundancy) only; no drain."""
        assert self.cache is not None
        try:
            result = self.store.save_local(step, state, self.cache)
        except CheckpointError as exc:
            if self._save_failed(step, None, reason, exc):
                raise
            return None
        self.levels.local_saves += 1
        blocked = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        result = dataclasses.replace(result, blocked_seconds=blocked)
        self.costs.add(blocked)
        self._committed(result, reason, None)
        self._last_save_time = time.monotonic()
        return result

    def _scavenge(self) -> None:
        """The allocation is ending: drain the newest checkpoint if only the node-local
        tier holds it (collective; synchronous)."""
        if self.cache is None or not self.store.local_newer or self.store.local_step is None:
            return
        step = self.store.local_step
        mine = scavenge_copy(self.comm, self.cache, self.directory, step)
        if mine is None:
            return
        self.store.restored_copy = mine
        self._event(job_events.CHECKPOINT_BEGIN, step=step, reason="scavenge")
        try:
            pending = self.store.begin_save(
                step, None, {"reason": "scavenge"}, cache=self.cache, redrain=True
            )
        except CheckpointError as exc:
            self._save_failed(step, None, "scavenge", exc)
            return
        self._pending, self._pending_reason = pending, "scavenge"
        try:
            self._complete_pending()
        except CheckpointError as exc:  # the node-local copy stays (local_newer): say so
            log.warning("draining node-local step %d failed: %s", step, exc)

    def _begin_staged(
        self, step: int, state: dict[str, Any], reason: str, t0: float, redrain: bool = False
    ) -> SaveResult | None:
        """Stage the state and start the background write; the commit comes later."""
        try:
            pending = self.store.begin_save(
                step,
                state,
                extra_meta={"reason": reason},
                buffers=self.buffers,
                cache=self.cache,
                redrain=redrain,
            )
        except CheckpointError as exc:
            if self._save_failed(step, None, reason, exc):
                raise
            return None
        self._heartbeat.beat(step, force=True)
        self._pending, self._pending_reason = pending, reason
        # The cost the job pays: waiting for the previous write plus staging this one.
        blocked = self.comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        pending.blocked = blocked  # reported again with the commit
        self.costs.add(blocked)
        self._last_save_time = time.monotonic()
        w = pending.written
        log.debug(
            "checkpoint step %d staged %s in %.3f s; writing in the background",
            step,
            "in memory" if self.cache is None else f"in {self.cache}",
            blocked,
        )
        self._event(
            job_events.CHECKPOINT_STAGED,
            step=step,
            blocked_seconds=round(blocked, 6),
            bytes=pending.bytes_total,
            save_kind=w.kind,
            staging="memory" if self.cache is None else "cache",
            staging_mode=pending.staging,
        )
        return SaveResult(
            step,
            pending.final,
            pending.bytes_total,
            blocked,
            w.kind,
            w.dirty_blocks,
            w.total_blocks,
            blocked_seconds=blocked,
        )

    def wait(self) -> SaveResult | None:
        """Wait for the background write of the last staged save and commit it; collective.

        Returns the committed checkpoint, or None when nothing was pending. Raises
        CheckpointError when the write failed (unless ``on_save_error="warn"``).
        """
        return self._complete_pending()

    def _complete_pending(self) -> SaveResult | None:
        """Commit the pending staged save (all ranks call this at the same point)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if not pending.done():  # waiting on I/O: the hang watch gives it the save allowance
            self._heartbeat.beat(self._last_step_seen, "save", force=True)
        try:
            result = self.store.finish_save(pending)
        except CheckpointError as exc:
            if self._save_failed(pending.step, None, self._pending_reason, exc, staged=True):
                raise
            return None
        faults.fault_point("checkpointer.saved")
        self.durable_costs.add(result.seconds)
        self._committed(result, self._pending_reason, None)
        return result

    def _committed(self, result: SaveResult, reason: str, stop: str | None) -> None:
        """After a commit: prune, remember, log one line, record the event, honour a stop."""
        step = result.step
        self._heartbeat.beat(step, force=True)
        try:
            self.store.prune(**self.retention)
        except CheckpointError as exc:  # raised on every rank alike; the save stands
            log.warning("retention failed, no checkpoint deleted: %s", exc)
        self.last_save = result
        if result.blocked_seconds is None:
            self._last_save_time = time.monotonic()
        self._last_save_step = step
        self._refresh_end_time()
        if (
            not stop
            and result.blocked_seconds is None
            and self.comm.allreduce(self._signals.received is not None, op=MPI.LOR)
        ):
            stop = "signal"  # it came during this save: the save just committed is the stop one
        interval = self.interval
        mib = result.bytes_written / 2**20
        rate = result.bytes_written / result.seconds / 1e6 if result.seconds > 0 else float("inf")
        upcoming = (
            "stopping"
            if stop
            else (
                f"next in {format_duration(interval)}"
                if interval is not None
                else f"next in {self.every_steps} steps"
            )
        )
        blocked = (
            ""
            if result.blocked_seconds is None
            else f" in the background (blocked {result.blocked_seconds:.2f} s)"
        )
        if result.tier != "directory":
            red = self.store.redundancy
            blocked = " on the node-local tier" + (f" with {red} redundancy" if red else "")
        if result.write_path is not None:  # synchronous: how the changes were found
            found = (
                f"kernel: {result.pages_written} page{'s' * (result.pages_written != 1)} written"
                if result.change_detection == "kernel"
                else "hashes"
            )
            blocked = f" ({found}, {result.bytes_hashed / 2**20:.1f} MiB hashed)"
        if result.kind == "incremental":
            kind = f"incremental ({100 * result.dirty_fraction:.1f} % of blocks)"
        elif result.full_reason and self.store.chain_policy.incremental:
            kind = f"full ({result.full_reason})"
        else:
            kind = "full"
        log.info(
            "checkpoint step %d: %s, %.1f MiB in %.2f s (%.0f MB/s)%s, %s; %s",
            step,
            kind,
            mib,
            result.seconds,
            rate,
            blocked,
            reason,
            upcoming,
        )
        extra: dict[str, Any] = {}
        if result.blocked_seconds is not None:
            extra["blocked_seconds"] = round(result.blocked_seconds, 6)
        if result.staging is not None:
            extra.update(staging_mode=result.staging, staging_bytes=result.staging_bytes)
        if result.write_path is not None:
            extra["write_path"] = result.write_path
            extra.update(
                change_detection=result.change_detection,
                pages_written=result.pages_written,
                bytes_hashed=result.bytes_hashed,
            )
        if result.tracking_audit is not None:
            extra["tracking_audit"] = result.tracking_audit
            log.warning("write tracking is off for the rest of this run: %s", result.tracking_audit)
        if result.tier != "directory":
            extra["tier"] = result.tier  # a node-local checkpoint, not drained
        self._event(
            job_events.CHECKPOINT,
            step=step,
            seconds=round(result.seconds, 6),
            bytes=result.bytes_written,
            save_kind=result.kind,  # "full" or "incremental"
            full_reason=result.full_reason,
            dirty=round(result.dirty_fraction, 6),
            reason=reason,
            path=result.path.name,
            next_interval=interval,
            cost_estimate=round(self.cost_estimate, 6),
            peak_rss=result.peak_rss,
            **extra,
        )
        if result.write_decision:  # the writer measured direct against buffered writes
            d = result.write_decision
            log.info(
                "writer: %s writes for %.0f MiB per rank (direct %.0f MB/s, buffered %.0f MB/s)",
                d["path"],
                d["size_group_bytes"] / 2**20,
                d["direct_mb_s"],
                d["buffered_mb_s"],
            )
            self._event(job_events.WRITE_PATH, step=step, **d)
        if stop:
            self._stop_requested = True
            sig = self._signals.received
            why = f"signal {sig.name}" if stop == "signal" and sig else stop
            self._report(job_status.STOPPED, step, why)
            self._event(job_events.STOP, step=step, reason=stop, signal=sig.name if sig else None)
            log.info("stop requested (%s): checkpoint of step %d committed, leaving", why, step)

    def finish(self) -> None:
        """Mark the run complete so the wrapper does not requeue it; collective.

        A background write still under way is waited for and committed first.
        """
        self._drain()
        self._complete_pending()
        self._scavenge()
        self.comm.Barrier()
        if self.cache is not None and self.store.local_newer:
            log.warning(
                "rank %d keeps its node-local copy in %s: the last drain failed, so it is "
                "newer than the newest checkpoint in %s",
                self.rank,
                self.cache,
                self.directory,
            )
        elif self.cache is not None:  # the job is done: free the node's memory or disk
            free_cache(self.comm, self.cache, self.store.redundancy)
        self._finished = True
        self._report(job_status.FINISHED, self._last_save_step, "finish() called")
        self._event(job_events.FINISH, step=self._last_step_seen, last_step=self._last_save_step)
        self._signals.close()
        self._release_lock()

    def close(self) -> None:
        """Commit a background write under way, release signal handlers, the pending
        reduction and the directory lock (also done by ``finish``); collective."""
        self._drain()
        try:
            self._complete_pending()
            if not self._finished:
                self._scavenge()
        finally:
            self._signals.close()
            self._release_lock()

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _save_failed(
        self, step: int, stop: str | None, reason: str, exc: Exception, staged: bool = False
    ) -> bool:
        """After a failed save (the previous checkpoints are intact): whether to raise.

        ``on_save_error="warn"`` logs, records a ``checkpoint_failed`` event and lets the
        run go on (the next save is due one interval later); a stop request still stops.
        """
        self._heartbeat.beat(step, force=True)
        fields = {"background": True} if staged else {}
        self._event(
            job_events.CHECKPOINT_FAILED, step=step, reason=reason, error=str(exc)[:2000], **fields
        )
        if self.on_save_error == "raise":
            return True
        log.warning("checkpoint of step %d failed; going on (on_save_error='warn'): %s", step, exc)
        self._last_save_time = time.monotonic()
        if stop:
            self._stop_requested = True
            self._report(job_status.STOPPED, self._last_save_step, f"{stop}; checkpoint failed")
            self._event(job_events.STOP, step=step, reason=stop, checkpoint_failed=True)
        return False

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _arrays_in(value: Any) -> list[np.ndarray]:
    """Every numpy array and tensor inside a state (to size the first cost estimate)."""
    if isinstance(value, np.ndarray):
        return [value]
    if tensors.is_tensor(value):
        return [tensors.to_array(value)]
    if is_stateful(value):
        return _arrays_in(value.state_dict())
    if isinstance(value, dict):
        return [a for v in value.values() for a in _arrays_in(v)]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays_in(v)]
    return []


def _duration(name: str, value: float | str) -> float:
    """Seconds from a number or a duration like "5m"; the error names the argument."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"Checkpointer({name}={value!r}): {exc}") from None
