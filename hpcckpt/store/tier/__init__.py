"""The node-local tier (``cache=``): each rank's copy on a node-local directory, partner
copies and XOR parity across nodes, the rebuild when ranks moved or nodes were lost,
and the collective sequence that owns the tier's state.

May import :mod:`hpcckpt.store.io`, :mod:`hpcckpt.store.tree`,
:mod:`hpcckpt.store.file`, :mod:`~hpcckpt.store.results`,
:mod:`~hpcckpt.store.agreement` and :mod:`~hpcckpt.store.errors`.
"""
