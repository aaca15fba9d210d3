"""Saving: the commit protocol (collective, durable, atomic), staged saves that finish
in the background and where they stage, the staging budget, and incremental saves (how
the changed blocks are found: the kernel's written pages, or hashes).

May import every sub-package below it: io, tree, file, tier; and the front's errors,
agreement and results.
"""
