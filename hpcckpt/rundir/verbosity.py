"""How much the wrapper and the Checkpointer say: ``HPCCKPT_LOG_LEVEL`` = quiet, normal, verbose.

The wrapper's ``--quiet`` / ``--verbose`` set it for itself and export it to the step,
so the job log changes as a whole. quiet: warnings and decisions that need the
user (crash, give-up, failed requeue) only; normal: one line per checkpoint and per
wrapper decision; verbose: also every rank's lines and the wrapper's details.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hpcckpt.rundir.env import LOG_LEVEL_ENV

QUIET, NORMAL, VERBOSE = -1, 0, 1
_NAMES = {"quiet": QUIET, "normal": NORMAL, "verbose": VERBOSE}


def level_from_env(environ: Mapping[str, str] | None = None) -> int:
    """The level named in the environment; unknown or unset means normal."""
    env = os.environ if environ is None else environ
    return _NAMES.get(env.get(LOG_LEVEL_ENV, "").strip().lower(), NORMAL)


def level_name(level: int) -> str:
    return {v: k for k, v in _NAMES.items()}[max(QUIET, min(VERBOSE, level))]
