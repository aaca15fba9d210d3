"""The report: what happened to a job, from its event log (attempts, checkpoints, lost
time, efficiency).

Pure functions over the list of events in ``DIR/events.jsonl`` (see
:mod:`hpcckpt.rundir.events`); no HDF5, no MPI, no Slurm. ``hpcckpt report DIR`` prints
:func:`format_report` of :func:`analyze`, and ``--plot`` draws the timeline with
:mod:`hpcckpt.report.plot`.

The model
---------
An *attempt* is one run of the job: a ``wrapper_start`` (the wrapper's run, possibly
holding several launches of the application) or, without the wrapper, a Checkpointer
``start``. Its wall time is cut into segments:

- ``overhead`` — start-up and restore (from the attempt's start to the ``restore``
  event), and shut-down (after ``stop``/``finish`` until the wrapper's ``step_end``);
- ``checkpoint`` — from ``checkpoint_begin`` to ``checkpoint`` (the commit); for a
  staged save (``async_save``/``cache``) to ``checkpoint_staged``, when the ranks go
  back to work: its later commit protects the work done up to the staging. It is the
  time in ``save()``: the store's part (the event's ``seconds``; a staged save's
  ``blocked_seconds``) and the work around it (checking the state, retention, events);
- ``mirror_wait`` — at ``finish()`` and a stop, the wait for the newest checkpoint to
  reach the mirror (the ``mirror_wait`` event, at its end, with the ``seconds`` waited);
- ``compute`` — the rest of the time the application ran: useful work, except
- ``lost`` — work after the last committed checkpoint of an attempt (or launch) that
  crashed or was killed: it is redone by the next attempt. A checkpoint begun and never
  committed is lost too;
- ``unrecorded`` — an attempt with no final event (killed without the wrapper noticing,
  or an application run without the wrapper that crashed): its end is unknown, so the
  time from its last event to the next attempt's start is somewhere between lost work
  and waiting;
- ``queue`` — between an attempt's end and the next attempt's start (Slurm's queue
  after a requeue, or the time until someone ran the job again).

Failures are attempts (or launches inside an attempt) that ended neither ``finished``
nor ``stopped`` and were followed by another try. The job's MTBF is estimated as the
run time (the sum of the attempts' durations) divided by the number of failures, and
the interval used is compared with Young's and Daly's for the measured checkpoint cost.

Unknown events and missing fields are tolerated: the event log is shared by the
wrapper and the Checkpointer, and both grow new events over time.
"""

from hpcckpt.report.analysis import analyze
from hpcckpt.report.model import SEGMENT_KINDS, Attempt, Segment, load_events, split_attempts
from hpcckpt.report.text import format_report

__all__ = [
    "SEGMENT_KINDS",
    "Attempt",
    "Segment",
    "analyze",
    "format_report",
    "load_events",
    "split_attempts",
]
