"""The state's values: a nested state to a JSON tree plus arrays and back (the rules,
key matching, read-only queries), torch tensors and devices, DTensors as pieces of
global arrays, replicated values, checks of a tree read from a file, and the
collective encoding of a state for a save and its decoding at a restore.

May import :mod:`hpcckpt.store.io`, :mod:`~hpcckpt.store.errors` and
:mod:`~hpcckpt.store.agreement`; no files, no HDF5.
"""
