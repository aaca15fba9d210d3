"""Bytes on a file system: writing extents past the page cache, fsync and the one atomic
write, the direct/buffered choice, file-system detection and tuning, file modes and
links, the directory lock, memory left, checksums and block hashes, fault points.

The floor of the store: imports only :mod:`hpcckpt.store.errors`, ``procfs`` and
``libc``; knows nothing of checkpoints, states or HDF5.
"""
