"""The checkpoint file: the format's constants, the names in a checkpoint directory,
planning where each rank's bytes lie, creating the HDF5 file, and reading it back with
every check before trusting it (descriptions, global heaps).

May import :mod:`hpcckpt.store.io`, :mod:`hpcckpt.store.tree` and
:mod:`~hpcckpt.store.errors`; MPI only in the writer (rank 0 creates the file, the
ranks agree on it), so the readers serve the one-process command-line tools.
"""
