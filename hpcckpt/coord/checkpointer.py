"""The Checkpointer: every rank checkpoints at the same step, and resumes from the newest good one.

It joins the *when* (interval, step count, stop signals) with the *where* (the
store) over MPI. All public methods are collective: every rank of ``comm`` calls
them in the same order with the same step, and each first agrees on which call and
step every rank is making (:mod:`hpcckpt.coord.calls`). Its settings are values checked
once (:mod:`hpcckpt.coord.options`), what it logs and records is worded by
:mod:`hpcckpt.coord.logbook` and written to the directory by :mod:`hpcckpt.coord.record`,
and the store chooses how each save is written and copies it to the mirror, so each
method here is the order of one collective step.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hpcckpt.coord import logbook, teardown
from hpcckpt.coord.calls import Calls, Patience
from hpcckpt.coord.endtime import JobEnd, mirror_wait_bound
from hpcckpt.coord.levels import Levels
from hpcckpt.coord.options import CheckpointerOptions, init_signature
from hpcckpt.coord.record import RunRecord
from hpcckpt.coord.schedule import Schedule
from hpcckpt.coord.signals import StopSignals
from hpcckpt.coord.validate import guard
from hpcckpt.policy import Deadline, multilevel
from hpcckpt.rundir import events as job_events
from hpcckpt.rundir import status as job_status
from hpcckpt.rundir.heartbeat import HeartbeatWriter
from hpcckpt.store import HostBuffers, as_comm, fault_point, state_bytes
from hpcckpt.store.agreement import CallAgreement
from hpcckpt.store.errors import CallMismatch
from hpcckpt.store.store import CheckpointError, CheckpointStore, PendingSave, SaveResult

log = logging.getLogger("hpcckpt")

# Slots of the flag vector the ranks reduce (MAX) to agree on a decision. _BUSY is 0 only
# when every rank's background write of the pending staged save has finished.
_SIGNAL, _TIME, _DEADLINE, _BUSY = 0, 1, 2, 3
_UNDECIDED = (0, 0, 0, 1)  # no reduction was in flight


class Checkpointer:
    """Coordinated checkpoints of per-rank state into one parallel HDF5 file per checkpoint.

    ``directory`` defaults to ``$HPCCKPT_DIR`` (set by the ``hpcckpt`` wrapper).
    ``comm``: an mpi4py communicator, a torch.distributed ``ProcessGroup`` (its ranks
    talk over gloo: itself, or a gloo group made beside an NCCL one) or a
    ``hpcckpt.store.comm.Comm``; by default MPI's ``COMM_WORLD`` when an MPI launcher
    started the job, else the default torch.distributed group when one is initialized.

    When: with ``interval`` (seconds) or ``every_steps`` N (at steps N-1, 2N-1, ...,
    i.e. after every N steps of a loop counted from 0) the schedule is fixed;
    otherwise ``policy`` ("daly", the default, or "young") sets the interval from
    the job's MTBF (``mtbf``, or ``node_mtbf`` divided by the job's node count) and
    the checkpoint cost measured at every save (``initial_cost`` until the first is
    measured), so it follows the real I/O cost. A stop signal (``signal``:
    ``$HPCCKPT_SIGNAL`` from the wrapper, else SIGUSR1; and ``stop_signals``, SIGTERM) on
    any rank, or the job's end time coming close (``end_time``, ``$HPCCKPT_END_TIME`` or
    Slurm's; a save's expected cost times ``deadline_safety`` plus ``deadline_margin``
    seconds before it), makes a checkpoint due at once; after it, ``stop_requested`` is
    true on every rank. A keyword the Checkpointer does not know is a TypeError naming
    the nearest one.

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

    Calls made on only some ranks (docs/hang-and-poison.md): every method first agrees on
    which call and step each rank is making (``due`` on the reduction it makes anyway);
    ranks in different calls raise CallMismatch naming each rank's call, e.g. "rank 0 is
    in save(step=5), rank 1 is in finish()". A rank that waits in a call for ranks that
    never come logs a warning after 60 s and, after ``call_timeout`` seconds (or
    ``$HPCCKPT_CALL_TIMEOUT``; no limit by default), raises CallTimeout naming them and
    where their heartbeats say they are.

    Saves that do not block for the write (docs/performance.md, "Asynchronous saves"):
    with ``async_save=True`` ``save`` copies the arrays into host buffers reused from
    save to save (one more copy of the rank's arrays in memory) and returns, within
    ``staging_budget`` bytes per rank (e.g. ``"4G"``; default half the node's available
    memory shared by its ranks): a larger state is copied in pieces while earlier pieces
    are written, and a save short of memory is written without a copy while its rank
    waits (event ``staging_refused``); with
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

    A second tier (docs/tiers.md): ``mirror`` (a directory on another file system or
    ``s3://bucket/prefix``; ``$HPCCKPT_MIRROR`` for a whole job) gets a verified copy of
    every ``mirror_every``-th committed checkpoint (or one per ``mirror_interval``),
    written by a thread of rank 0 after the commit, never by the ranks' critical path,
    within ``mirror_bandwidth``, retried with a backoff up to ``mirror_retry_max``
    seconds when the mirror refuses; the directory keeps a checkpoint until it is
    verified there. ``restore`` takes the mirror's checkpoint when the directory holds
    nothing newer that is good. ``finish()`` and a stop wait up to ``mirror_wait``
    seconds (``$HPCCKPT_MIRROR_WAIT``) for the newest checkpoint to reach the mirror.
    The mirror keeps ``mirror_keep_last`` newest, one per ``mirror_keep_every`` steps
    and ``mirror_thinning`` tiers by age (``"6h:all,7d:1d,*:1w"``); by default, all.
    ``mirror_verify`` ("auto": the store's checksum on receipt, else a read-back) and
    ``mirror_compress`` ("auto": zstd where the store is slower than the compressor;
    "zstd"; None) say how a copy is checked and stored.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None = None,
        comm: Any = None,
        **keywords: Any,
    ) -> None:
        #: The settings, checked and resolved against the environment (coord/options.py).
        self.options = options = CheckpointerOptions.from_keywords(directory, **keywords)
        schedule = options.schedule
        self.comm = as_comm(comm)  # MPI or torch.distributed (hpcckpt.store.comm)
        self.rank = self.comm.rank
        self.nranks = self.comm.size
        logbook.configure_logging(self.rank, options.job.log_level)
        self.directory = options.directory
        #: Rank 0's lock, status file and events in the directory (coord/record.py).
        self.record = RunRecord(self.directory, self.rank, self.nranks, options.job.attempt)
        #: The poisoned-state guard run before every save (coord/validate.py).
        self.validator = options.guard.validator
        #: Which checkpoints each commit keeps (a RetentionOptions; replace it to change).
        self.retention = options.retention
        #: The two levels: node-local saves and every how many one is drained.
        self.levels = Levels(options.levels)
        #: When the next checkpoint is due (coord/schedule.py); its parts are shown here too.
        self.schedule = Schedule(
            schedule, options.job.nodes, self.levels, options.store.tier.path is not None
        )
        self.policy, self.every_steps = self.schedule.policy, self.schedule.every_steps
        self.costs, self.durable_costs = self.schedule.costs, self.schedule.durable_costs
        #: The store; it copies commits to the mirror and reports to the event log.
        self.store = CheckpointStore(
            self.directory, self.comm, options.store, report=self.record.store_report
        )
        #: How the ranks decide together: the store's, so a failure reads the same anywhere.
        self.agreement = self.store.agreement
        self._end = JobEnd(options, self.agreement)  # collective: rank 0 may ask Slurm
        #: The job's end time and when the last checkpoint must begin before it.
        self.deadline: Deadline = self._end.deadline
        #: Host memory an async save stages into, or a save to ``cache`` on its way there
        #: (None: saves are synchronous).
        staging = options.staging
        self.buffers = (
            HostBuffers(staging.staging_budget)  # type: ignore[arg-type]
            if staging.async_save or self.cache is not None
            else None
        )
        self._pending: PendingSave | None = None
        self._pending_reason = ""
        self._signals = StopSignals([schedule.signal, *schedule.stop_signals])

        #: Every call first agrees on which call and step each rank is in; due()'s flags
        #: ride on its agreement (store/agreement.py, coord/calls.py).
        self._calls = Calls(CallAgreement(self.comm, flags=4))
        self._last_save_time = time.monotonic()
        self._last_save_step: int | None = None
        self._stop_pending: str | None = None
        self._last_step_seen: int | None = None
        self._stop_requested = False
        self._finished = False
        self._released = False
        self.last_save: SaveResult | None = None

        self.record.lock(
            self.agreement, self.store.dir_mode, self.store.file_mode, options.job.job_id
        )
        teardown.register(self)  # released at exit if the application never does
        self._heartbeat = HeartbeatWriter(self.directory, self.rank)
        self._heartbeat.beat(None, force=True)
        self._calls.agreement.watch = Patience(
            self._heartbeat, self.nranks, options.guard.call_timeout, lambda: self._last_step_seen
        )
        # Every rank has its handlers now: the wrapper may forward signals.
        self.comm.barrier()
        self.record.status(job_status.RUNNING)
        self.record.event(
            job_events.START,
            pid=os.getpid(),
            policy=self.describe_schedule(),
            end_time=self.deadline.end_time,
            end_time_source=self._end.source,
        )

    # -- when ----------------------------------------------------------------------
    def describe_schedule(self) -> str:
        """The schedule in words, for logs and events."""
        return self.schedule.describe()

    @property
    def cost_estimate(self) -> float:
        """Seconds one checkpoint is expected to take: measured, else the initial guess."""
        return self.schedule.cost_estimate

    @property
    def durable_cost_estimate(self) -> float:
        """Seconds a synchronous checkpoint is expected to take (the deadline plans with it)."""
        return self.schedule.durable_cost_estimate

    @property
    def cache(self) -> Path | None:
        """This node's directory of the node-local tier (``%n`` replaced), or None."""
        return self.options.store.tier.path

    @property
    def staged(self) -> bool:
        """Whether saves return before the checkpoint file is written (async or cache)."""
        return self.buffers is not None or self.cache is not None

    @property
    def interval(self) -> float | None:
        """Seconds of work between checkpoints now (None when only steps count)."""
        return self.schedule.interval

    # -- helpers -----------------------------------------------------------------
    def _mirror_wait(self, reason: str) -> None:
        """Rank 0: the newest checkpoint on its way to the mirror, waited for up to
        ``mirror_wait`` seconds, cut to end in time for the wrapper's requeue before the
        job's end (:func:`~hpcckpt.coord.endtime.mirror_wait_bound`); the ``mirror_wait``
        event says whether it arrived."""
        if self.store.mirroring is None:
            return
        wait = float(self.store.options.mirror.mirror_wait)  # type: ignore[arg-type]
        end, now = self.deadline.end_time, time.time()
        bound = mirror_wait_bound(wait, end, now)
        cut = (
            None if end is None or bound >= wait else logbook.MirrorCut(wait, bound, end, end - now)
        )
        waited = self.store.mirror_wait(bound)
        if waited is None:
            return
        line, fields = logbook.mirror_waited(waited, reason, self.directory, cut)
        (log.info if waited.done else log.warning)("%s", line)
        self.record.event(job_events.MIRROR_WAIT, **fields)

    @property
    def _redundancy(self) -> str | None:
        """The node-local tier's redundancy scheme (None: none, or no tier)."""
        return None if self.store.tier is None else self.store.tier.redundancy

    # -- public API --------------------------------------------------------------
    @property
    def stop_requested(self) -> bool:
        """True on every rank once the checkpoint taken on a stop signal is committed."""
        return self._stop_requested

    def restore(
        self, state: dict[str, Any], only: Iterable[str] | None = None, *, strict: bool = True
    ) -> int | None:
        """Fill ``state`` in place from the newest good checkpoint; its step, or None if none.

        Arrays and tensors are filled in place (the application's references stay valid);
        scalars are replaced in the dict; objects with ``load_state_dict`` get it called
        with their saved state dict. ``only`` restores just those top-level keys (e.g.
        the replicated model and optimizer on another rank count). Collective.

        ``strict`` (the default): the state must hold the checkpoint's keys, no more, no
        fewer, else CheckpointError on every rank naming both, before anything is read
        into the state (a key renamed in the code). Compared: the keys of every dict of
        the state, at any depth (an empty dict takes whatever the checkpoint holds there),
        and the keys of each object's ``state_dict()``; with ``only``, what lies below
        those keys. ``strict=False`` restores what matches, leaves the state's other keys
        as they are, adds the checkpoint's other keys to the state's dicts (an object
        gets only the keys its ``state_dict()`` has), and says which in the log and the
        ``restore`` event (``skipped_keys``, ``added_keys``, ``ignored_keys``).
        """
        self._calls.enter("restore")
        if self.schedule.needs_size:
            self.schedule.size_first_cost(self.agreement.total(state_bytes(state)))
        self._complete_pending()  # a staged save commits first (it beats on its own)
        # The hang watch's I/O allowance (written by the heartbeat's thread: its cold
        # metadata after a restart, up to tens of ms, is off rank 0's path).
        self._heartbeat.beat(None, "restore", True)
        result = self.store.restore(state, only=only, strict=strict)
        if self.store.tier is not None:  # the first save's node-local data file
            self.store.tier.reserve(state)
        if self.buffers is not None:  # the staging of the saves after, populated meanwhile
            self.buffers.reserve(state, self.comm, copies=1 if self.store.tier is None else 2)
        if self.staged:  # the first save is deferred too
            self.store.prepare_saves(state, self.buffers)
        set_aside = [] if self.store.tier is None else self.store.tier.take_set_aside()
        self._heartbeat.beat(None, force=True)  # back to compute
        self._calls.drain()
        self._last_save_time = time.monotonic()
        line, events = logbook.restored(result, set_aside, self._redundancy, self.directory)
        log.info("%s", line)
        for kind, fields in events:
            self.record.event(kind, **fields)
        if result is None:
            return None
        if result.source == "cache":
            # The directory must hold the newest durable checkpoint: drain the copy
            # restored from (as it is, in the background) before the run goes on.
            self.record.event(job_events.CHECKPOINT_BEGIN, step=result.step, reason="restored")
            self._redrain(result.step, state)
            self._last_save_time = time.monotonic()
        self._last_save_step = result.step
        if result.source == "directory":
            self.store.mirror_wait(0)  # rank 0: a stop's checkpoint the mirror lacks goes there
        return result.step

    def due(self, step: int) -> bool:
        """Whether to checkpoint at ``step``; collective, cheap, and the same on every rank.

        Ranks exchange their flags (signal seen, interval elapsed) with a non-blocking
        reduction whose result is used at the next call, so no rank waits for the
        others in the common case and all ranks decide on the same step. The same
        reduction says which call and step each rank is in: the next call raises
        CallMismatch when they differ.
        """
        self._last_step_seen = step
        self._heartbeat.beat(step)
        decided = self._calls.drain()  # the last due()'s flags; CallMismatch if ranks were apart
        if decided is None:
            decided = _UNDECIDED
        if self._pending is not None and not decided[_BUSY]:
            self._complete_pending()  # every rank's bytes are durable: commit (collective)
        send = self._calls.agreement.slots
        send[_SIGNAL] = 1 if self._signals.received is not None else 0
        interval = self.interval
        elapsed = time.monotonic() - self._last_save_time
        send[_TIME] = 1 if interval is not None and elapsed >= interval else 0
        cost = self.durable_cost_estimate
        send[_DEADLINE] = 1 if self.deadline.must_stop(time.time(), cost) else 0
        send[_BUSY] = 0 if self._pending is not None and self._pending.done() else 1
        self._calls.agreement.post("due", step, lagged=True)  # the flags, and due(step)

        if decided[_SIGNAL]:
            self._stop_pending = "signal"
            return True
        if decided[_DEADLINE]:
            self._stop_pending = "deadline"
            return True
        if decided[_TIME]:
            return True
        return self.schedule.steps_due(step)

    def save(self, step: int, state: dict[str, Any]) -> SaveResult | None:
        """Write a coordinated checkpoint of ``state`` at ``step``; collective.

        Returns once the checkpoint is committed: written by every rank, durable and
        renamed into place. After a save triggered by a stop signal, ``stop_requested``
        becomes true. A failed save (a full disk...) raises CheckpointError on every rank,
        or with ``on_save_error="warn"`` returns None and the run goes on.

        With ``async_save`` or ``cache`` (and not on a stop signal or the deadline) it
        returns once the state is staged: the result's ``blocked_seconds`` is what the
        ranks waited, and the checkpoint is committed later (see the class docs). With
        ``async_save``, and with ``cache`` without ``redundancy``, after ``restore()`` (or
        the first save, when no restore came before it) the ranks decide the kind in the
        background: the result says ``kind="staged"``
        and ``bytes_written=0`` (the commit's result has both), and a value that cannot
        be saved is raised at the commit, on every rank (docs/async-and-fast-tier.md).
        """
        self._calls.enter("save", step)
        t0 = time.perf_counter()
        self._complete_pending()  # at most one background write: wait for the previous
        stop = self._stop_pending
        reason = stop or ("steps" if self.policy is None else "interval")
        self.record.event(job_events.CHECKPOINT_BEGIN, step=step, reason=reason)
        self._heartbeat.beat(step, "save", force=True)
        guard(self, step, state, event=self.record.event)  # PoisonedState on every rank
        local = self.cache is not None and not stop and self._local_only()
        if self.staged and not stop and not local:
            self.levels.local_saves = 0  # this one drains
        try:  # the store takes its path: node-local only, staged, or synchronous
            saved = self.store.checkpoint(
                step, state, reason, stop=bool(stop), local=local, buffers=self.buffers
            )
        except CheckpointError as exc:  # on every rank alike
            if self._save_failed(step, stop, reason, exc):
                raise
            return None
        if isinstance(saved, PendingSave):
            return self._staged(saved, reason, t0)
        if saved.tier == "cache":
            return self._saved_local(saved, reason, t0)
        fault_point("checkpointer.saved")
        self.costs.add(saved.seconds)
        self.durable_costs.add(saved.seconds)
        self._committed(saved, reason, stop)
        return saved

    def _local_only(self) -> bool:
        """Whether this save stays node-local (``drain_every``: only every Nth drains)."""
        return self.levels.local_only(self.level_plan())

    def level_plan(self) -> multilevel.LevelPlan | None:
        """With ``drain_every="auto"``: the two-level model's node-local interval and drain
        period for the measured costs (node-local save: the blocked time; drain: the
        full cost) and the policy's MTBF; None without a cache or an MTBF-based policy."""
        return self.schedule.level_plan()

    def _saved_local(self, result: SaveResult, reason: str, t0: float) -> SaveResult:
        """A checkpoint on the node-local tier (and its redundancy) only; no drain."""
        self.levels.local_saves += 1
        blocked = self.agreement.slowest(time.perf_counter() - t0)[0]
        result = dataclasses.replace(result, blocked_seconds=blocked)
        self.costs.add(blocked)
        self._committed(result, reason, None)
        self._last_save_time = time.monotonic()
        return result

    def _scavenge(self) -> None:
        """The allocation is ending: drain the newest checkpoint if only the node-local
        tier holds it (collective; synchronous)."""
        tier = self.store.tier
        if tier is None or not tier.holds_newest or tier.newest_step is None:
            return
        step = tier.newest_step
        if not tier.hold_for_drain(step):  # it says why
            return
        self.record.event(job_events.CHECKPOINT_BEGIN, step=step, reason="scavenge")
        try:
            pending = self.store.begin_save(step, None, {"reason": "scavenge"}, redrain=True)
        except CheckpointError as exc:
            self._save_failed(step, None, "scavenge", exc)
            return
        self._pending, self._pending_reason = pending, "scavenge"
        try:
            self._complete_pending()
        except CheckpointError as exc:  # the node-local copy stays (holds_newest): say so
            log.warning("draining node-local step %d failed: %s", step, exc)

    def _redrain(self, step: int, state: dict[str, Any]) -> None:
        """Drain the node-local copy just restored from, as it is, in the background."""
        t0 = time.perf_counter()
        try:
            pending = self.store.begin_save(
                step, state, {"reason": "restored"}, buffers=self.buffers, redrain=True
            )
        except CheckpointError as exc:
            if self._save_failed(step, None, "restored", exc):
                raise
            return
        self._staged(pending, "restored", t0)

    def _staged(self, pending: PendingSave, reason: str, t0: float) -> SaveResult:
        """The state is staged and its background write started; the commit comes later."""
        self._heartbeat.beat(pending.step, force=True)
        self._pending, self._pending_reason = pending, reason
        # The cost the job pays: waiting for the previous write plus staging this one;
        # a deferred save's ranks agree on it at the commit (no collective here).
        blocked = time.perf_counter() - t0
        if not pending.deferred:
            blocked = self.agreement.slowest(blocked)[0]
            self.costs.add(blocked)
        pending.blocked = blocked  # reported again with the commit
        self._last_save_time = time.monotonic()
        line, fields = logbook.staged(pending, blocked, self.cache)
        log.debug("%s", line)
        self.record.event(job_events.CHECKPOINT_STAGED, **fields)
        pending.go()  # the write's thread now, not during the event's write
        return pending.staged_result()

    def wait(self) -> SaveResult | None:
        """Wait for the background write of the last staged save and commit it; collective.

        Returns the committed checkpoint, or None when nothing was pending. Raises
        CheckpointError when the write failed (unless ``on_save_error="warn"``).
        """
        self._calls.enter("wait")
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
        fault_point("checkpointer.saved")
        if pending.deferred and result.blocked_seconds is not None:
            self.costs.add(result.blocked_seconds)  # agreed by the commit
        self.durable_costs.add(result.seconds)
        self._committed(result, self._pending_reason, None)
        return result

    def _committed(self, result: SaveResult, reason: str, stop: str | None) -> None:
        """After a commit: prune, remember, log one line, record the event, honour a stop."""
        step = result.step
        self._heartbeat.beat(step, force=True)
        try:  # rank 0, in the background; the store keeps what is on its way to the mirror
            self.store.prune(**dataclasses.asdict(self.retention), background=True)
        except CheckpointError as exc:  # raised on every rank alike; the save stands
            log.warning("retention failed, no checkpoint deleted: %s", exc)
        self.last_save = result
        if result.blocked_seconds is None:
            self._last_save_time = time.monotonic()
        self._last_save_step = step
        self.deadline = self._end.refresh()  # collective
        if (
            not stop
            and result.blocked_seconds is None
            and self.agreement.anyone(self._signals.received is not None)
        ):
            stop = "signal"  # it came during this save: the save just committed is the stop one
        entry = logbook.committed(
            result,
            reason,
            stop=stop,
            interval=self.interval,
            every_steps=self.every_steps,
            cost_estimate=self.cost_estimate,
            redundancy=self._redundancy,
            incremental=self.store.options.incremental.incremental,
        )
        log.info("%s", entry.line)
        if entry.warning:
            log.warning("%s", entry.warning)
        self.record.event(job_events.CHECKPOINT, **entry.fields)
        for line, (kind, fields) in entry.after:  # e.g. the bad mark of the file replaced
            log.info("%s", line)
            self.record.event(kind, **fields)
        if result.write_decision:  # the writer measured direct against buffered writes
            log.info("%s", logbook.writer_line(result.write_decision))
            self.record.event(job_events.WRITE_PATH, step=step, **result.write_decision)
        if stop:
            self._honour_stop(step, stop)

    def _honour_stop(self, step: int, stop: str) -> None:
        """The stop checkpoint is committed: every rank stops; the wrapper is told why."""
        self._stop_requested = True
        sig = self._signals.received
        why = logbook.stop_reason(stop, sig.name if sig else None)
        self._mirror_wait("stop")  # rank 0, before the wrapper hears of the stop
        self.record.status(job_status.STOPPED, step, why)
        self.record.event(job_events.STOP, step=step, reason=stop, signal=sig.name if sig else None)
        log.info("stop requested (%s): checkpoint of step %d committed, leaving", why, step)

    def finish(self) -> None:
        """Mark the run complete so the wrapper does not requeue it; collective.

        A background write still under way is waited for and committed first.
        """
        self._calls.enter("finish")
        self._complete_pending()
        self._scavenge()
        self.comm.barrier()
        self.store.free_tier()  # the job is done: the node's memory or disk
        self._finished = True
        self._mirror_wait("finish")
        self._close_store()  # the mirror's thread joined, staging freed
        self.record.status(job_status.FINISHED, self._last_save_step, "finish() called")
        self.record.event(
            job_events.FINISH, step=self._last_step_seen, last_step=self._last_save_step
        )
        self._heartbeat.beat(self._last_step_seen, "finished", force=True)
        self.release()  # no hpcckpt thread, buffer or reference to the state left

    def close(self) -> None:
        """Commit a background write under way, release signal handlers, the pending
        reduction and the directory lock (also done by ``finish``); collective. After a
        CallMismatch it only releases what this rank holds."""
        if self._calls.broken is None:
            self._calls.enter("close")
        self._close()

    def _close(self) -> None:
        try:
            if self._calls.broken is None:
                self._complete_pending()
                if not self._finished:
                    self._scavenge()
        finally:
            self.release()  # threads joined, buffers and the lock given up

    def release(self, timeout: float = teardown.JOIN_TIMEOUT) -> None:
        """Give up what this rank holds, nothing collective (again is harmless): a staged
        save never committed is dropped (its write joined), the mirror's thread joined,
        the staging freed, the signal handlers restored, the directory lock given back,
        each thread waited for at most ``timeout`` s. ``finish()``, ``close()`` and the
        process's exit end with it."""
        if self._released:
            return
        self._released = True
        try:
            self._close_store(timeout)
        finally:
            self._signals.close()
            self.record.release()
            self._heartbeat.close(max(0.0, timeout))  # its newest beat written ("finished")

    def _close_store(self, timeout: float = teardown.JOIN_TIMEOUT) -> None:
        pending, self._pending = self._pending, None
        teardown.close_store(pending, self.store, self.buffers, timeout)

    def _save_failed(
        self, step: int, stop: str | None, reason: str, exc: Exception, staged: bool = False
    ) -> bool:
        """After a failed save (the previous checkpoints are intact): whether to raise.

        ``on_save_error="warn"`` logs, records a ``checkpoint_failed`` event and lets the
        run go on (the next save is due one interval later); a stop request still stops.
        """
        self._heartbeat.beat(step, force=True)
        fields = {"background": True} if staged else {}
        self.record.event(
            job_events.CHECKPOINT_FAILED, step=step, reason=reason, error=str(exc)[:2000], **fields
        )
        if self.options.guard.on_save_error == "raise":
            return True
        log.warning("checkpoint of step %d failed; going on (on_save_error='warn'): %s", step, exc)
        self._last_save_time = time.monotonic()
        if stop:
            self._stop_requested = True
            self.record.status(
                job_status.STOPPED, self._last_save_step, f"{stop}; checkpoint failed"
            )
            self.record.event(job_events.STOP, step=step, reason=stop, checkpoint_failed=True)
        return False

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
            return
        # Leaving on an error, perhaps on this rank only: no agreement to wait for.
        if self._calls.broken is None:
            try:
                self._calls.drain()
            except CallMismatch:
                pass  # the error on its way out says more
        self._close()


# Every keyword with its default and type, from the option classes (inspect, docs/api.md).
Checkpointer.__init__.__signature__ = init_signature()  # type: ignore[attr-defined]
