"""The local Slurm cluster (``hpcckpt cluster``): real daemons on this machine, for trying
hpcckpt and for the tests.

- :mod:`~hpcckpt.cluster.config` — parameters, ``slurm.conf``, the clients' environment;
- :mod:`~hpcckpt.cluster.munge` — munge, started if needed;
- :mod:`~hpcckpt.cluster.daemons` — :class:`LocalCluster`: up, down, fail and restore a node.

Every Slurm client command goes through :mod:`hpcckpt.slurm`; /proc through
:mod:`hpcckpt.procfs`.
"""

from __future__ import annotations

from hpcckpt.cluster.config import (
    DEFAULT_CPUS,
    DEFAULT_KILL_WAIT,
    DEFAULT_PORT,
    DIR_ENV,
    PORT_ENV,
    ClusterConfig,
    ClusterError,
    render_slurm_conf,
)
from hpcckpt.cluster.daemons import LocalCluster

__all__ = [
    "DEFAULT_CPUS",
    "DEFAULT_KILL_WAIT",
    "DEFAULT_PORT",
    "DIR_ENV",
    "PORT_ENV",
    "ClusterConfig",
    "ClusterError",
    "LocalCluster",
    "render_slurm_conf",
]
