"""Restoring: which checkpoint to take (the newest that verifies, the node-local tier or
the mirror when newer or the only copy, bad marks, the crash guard), reading it into
the state, per-rank read plans, DTensor pieces, and resharding to another rank count.

May import io, tree, file, mirror, tier and the front's errors, agreement, results.
"""
