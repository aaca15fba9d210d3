"""Every ``HPCCKPT_*`` environment variable, named once.

A leaf of constants (no imports of hpcckpt): every layer may import it, the Slurm
client included. The one name not here is ``HPCCKPT_FAULT``, the store's
fault-injection switch (:mod:`hpcckpt.store.io.faults`): the store imports nothing above
itself. ``HPCCKPT_TEST_CLUSTER_DIR``/``_PORT`` belong to the test suite (tests/conftest.py).
"""

from __future__ import annotations

from collections.abc import Mapping

# -- the contract between the wrapper and the application's ranks (docs/wrapper.md) --------
#: The checkpoint directory, exported by the wrapper (``--ckpt-dir``).
DIR_ENV = "HPCCKPT_DIR"
#: A fresh token per wrapper attempt; a status file carrying another one is stale.
ATTEMPT_ENV = "HPCCKPT_ATTEMPT"
#: The stop signal's name (``USR1``) for the application, which may choose to listen to it.
SIGNAL_ENV = "HPCCKPT_SIGNAL"
#: ``1`` when the step resumes (a restart set exists, or this is a restart), else ``0``.
RESTART_ENV = "HPCCKPT_RESTART"
#: The periodic checkpoint interval in whole seconds (``--ckpt-every``), for the app's flags.
INTERVAL_ENV = "HPCCKPT_INTERVAL"
#: How much the wrapper and the Checkpointer say: quiet, normal, verbose.
LOG_LEVEL_ENV = "HPCCKPT_LOG_LEVEL"
#: The job's end time for the Checkpointer's deadline (Unix time or ISO), overriding Slurm's.
END_TIME_ENV = "HPCCKPT_END_TIME"
#: Turns on the Checkpointer's node-local cache for a whole job (``cache``).
CACHE_ENV = "HPCCKPT_CACHE"
#: Redundancy of the node-local tier for every Checkpointer of the job: "xor", "partner",
#: optionally with the set size ("xor:4"); ``redundancy=`` wins.
REDUNDANCY_ENV = "HPCCKPT_REDUNDANCY"
#: Drain only every Nth node-local checkpoint to the directory (``drain_every=`` wins).
DRAIN_EVERY_ENV = "HPCCKPT_DRAIN_EVERY"
#: Seconds a rank waits in a Checkpointer call for the others before it gives up
#: (``call_timeout``; ``call_timeout=`` wins).
CALL_TIMEOUT_ENV = "HPCCKPT_CALL_TIMEOUT"
#: The mirror (second tier) of every Checkpointer of the job: a directory or
#: s3://bucket/prefix (``mirror=`` wins; ``hpcckpt srun --mirror`` sets it).
MIRROR_ENV = "HPCCKPT_MIRROR"
#: Seconds finish() and a stop wait for the newest checkpoint to reach the mirror
#: (``mirror_wait=`` wins; ``hpcckpt srun --mirror-wait`` sets it).
MIRROR_WAIT_ENV = "HPCCKPT_MIRROR_WAIT"

# -- chains of jobs (hpcckpt/slurm/chain.py) ------------------------------------------------
#: This job's position in a chain of jobs (0 for the first).
CHAIN_COUNT_ENV = "HPCCKPT_CHAIN_COUNT"
#: The batch script to submit again (the templates set it to ``$0``).
CHAIN_SCRIPT_ENV = "HPCCKPT_CHAIN_SCRIPT"
#: Its arguments, shell-quoted (the templates set it with bash's ``${*@Q}``).
CHAIN_ARGS_ENV = "HPCCKPT_CHAIN_ARGS"
#: sbatch options given on the command line, shell-quoted (``hpcckpt submit`` records it).
SBATCH_ARGS_ENV = "HPCCKPT_SBATCH_ARGS"

# -- where Slurm's clients are (sites that keep them elsewhere; tests) -----------------------
SCONTROL_ENV = "HPCCKPT_SCONTROL"
SQUEUE_ENV = "HPCCKPT_SQUEUE"
SBATCH_ENV = "HPCCKPT_SBATCH"
SINFO_ENV = "HPCCKPT_SINFO"
SCANCEL_ENV = "HPCCKPT_SCANCEL"
#: The ``srun`` that ``hpcckpt srun`` runs.
SRUN_ENV = "HPCCKPT_SRUN"
#: A directory of sbatch templates to use instead of the packaged ones.
TEMPLATES_ENV = "HPCCKPT_TEMPLATES"
#: The venv the batch-script templates and examples activate (their "load your
#: environment" lines; ``hpcckpt submit --venv`` writes it into the script instead).
VENV_ENV = "HPCCKPT_VENV"

# -- the local cluster (hpcckpt/cluster/) -------------------------------------------------------
CLUSTER_DIR_ENV = "HPCCKPT_CLUSTER_DIR"
CLUSTER_PORT_ENV = "HPCCKPT_CLUSTER_PORT"
#: Marks the daemons a cluster started, so that ``down`` finds exactly its own.
CLUSTER_DAEMON_ENV = "HPCCKPT_CLUSTER_DAEMON"


def chain_count(environ: Mapping[str, str]) -> int:
    """This job's position in the chain (``$HPCCKPT_CHAIN_COUNT``; 0 for the first)."""
    value = (environ.get(CHAIN_COUNT_ENV) or "").strip()
    return int(value) if value.isdigit() else 0
