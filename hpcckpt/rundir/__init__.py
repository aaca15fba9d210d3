"""What the wrapper and the application's ranks share through the checkpoint directory
and the environment: the ``HPCCKPT_*`` names (:mod:`~hpcckpt.rundir.env`), the status
file (:mod:`~hpcckpt.rundir.status`), the event log (:mod:`~hpcckpt.rundir.events`),
the per-rank heartbeats (:mod:`~hpcckpt.rundir.heartbeat`) and how much to say
(:mod:`~hpcckpt.rundir.verbosity`). Stdlib only; never HDF5 or MPI.
"""
