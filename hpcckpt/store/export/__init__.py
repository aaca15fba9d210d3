"""Exports of one checkpoint for tools that know nothing of hpcckpt: a flat HDF5 file
of the global state, and the model weights as safetensors.

May import :mod:`hpcckpt.store.io`, :mod:`hpcckpt.store.tree`,
:mod:`hpcckpt.store.file` and :mod:`~hpcckpt.store.errors`; no MPI.
"""
