"""The wrapper's side of the poisoned-state guard: never requeue into the same poison.

When the Checkpointer rejects a checkpoint because a rank's state failed its check
(NaN/Inf, or the application's own ``validate`` function; :mod:`hpcckpt.coord.validate`),
rank 0 appends an event ``rejected`` carrying this attempt's token and every rank raises
``PoisonedState``. The status file still says ``running``, so the step looks like a
crash; but restarting would resume from the last good checkpoint and, the computation
being deterministic, most likely produce the same NaN again. So a crashed attempt with a
``rejected`` event of its own has the outcome ``poisoned``: no requeue, no chain, a
non-zero exit, and a message saying which ranks and arrays were at fault.

:func:`rejection_of` is pure (event records in, the rejection out).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Any

from hpcckpt.job.outcome import Outcome, StepResult, crash_exit_code
from hpcckpt.rundir.events import REJECTED


def rejection_of(events: Iterable[Mapping[str, Any]], attempt: str) -> dict[str, Any] | None:
    """The newest ``rejected`` event written by this attempt, or None."""
    found = None
    for ev in events:
        if ev.get("event") == REJECTED and ev.get("attempt") == attempt:
            found = dict(ev)
    return found


def describe(rejection: Mapping[str, Any]) -> str:
    ranks = ", ".join(map(str, rejection.get("ranks") or [])) or "?"
    arrays = ", ".join(repr(a) for a in rejection.get("arrays") or [])
    where = f" in {arrays}" if arrays else ""
    kept = f"; kept as {rejection['path']}" if rejection.get("path") else ""
    return (
        f"the checkpoint of step {rejection.get('step')} was rejected: the state of rank(s) "
        f"{ranks} failed the check{where}{kept}"
    )


def classify_poisoned(
    result: StepResult, events: Iterable[Mapping[str, Any]] | None, attempt: str
) -> tuple[StepResult, dict[str, Any] | None]:
    """``result`` turned into a POISONED one if this crashed attempt rejected a checkpoint."""
    if result.outcome is not Outcome.CRASHED or events is None:
        return result, None
    rejection = rejection_of(events, attempt)
    if rejection is None:
        return result, None
    poisoned = replace(
        result, outcome=Outcome.POISONED, reason=f"{describe(rejection)}; {result.reason}"
    )
    return poisoned, rejection


def give_up_messages(result: StepResult, ckpt_dir: str | os.PathLike[str]) -> list[str]:
    """What the wrapper says when it gives up after a poisoned attempt."""
    return [
        f"step stopped on a poisoned state: {result.reason}",
        "not continuing: restarting would resume from the last good checkpoint and most "
        "likely compute the same non-finite values again. What to do: inspect the rejected "
        f"state (hpcckpt ls / hpcckpt inspect in {ckpt_dir}), fix the cause "
        "(time step, input, validate function), then submit again; the last good "
        "checkpoint is untouched",
    ]


def give_up_fields(result: StepResult, step: int | None) -> dict[str, Any]:
    """The fields of the ``give_up`` event after a poisoned attempt."""
    return {
        "reason": "poisoned state: " + result.reason,
        "poisoned": True,
        "exit_code": result.returncode,
        "step": step,
        "wrapper_exit": crash_exit_code(result.returncode),
    }
