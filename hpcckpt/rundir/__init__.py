"""What the wrapper and the application's ranks share through the checkpoint directory
and the environment: the ``HPCCKPT_*`` names (:mod:`~hpcckpt.rundir.env`), the status
file (:mod:`~hpcckpt.rundir.status`), the event log (:mod:`~hpcckpt.rundir.events`),
the per-rank heartbeats (:mod:`~hpcckpt.rundir.heartbeat`), how much to say
(:mod:`~hpcckpt.rundir.verbosity`) and what is wrong with a directory that cannot serve
(:mod:`~hpcckpt.rundir.directory`). Stdlib only; never HDF5 or MPI.
"""
