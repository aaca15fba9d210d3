"""The mirror, the second tier beyond scratch: its backends (a directory, S3), the
verified copy of one checkpoint and its manifest, the background worker that copies
each commit, and what the mirror keeps.

May import :mod:`hpcckpt.store.io`, :mod:`hpcckpt.store.file`,
:mod:`~hpcckpt.store.retention` and :mod:`~hpcckpt.store.errors`; no MPI.
"""
