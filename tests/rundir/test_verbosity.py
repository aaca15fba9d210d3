"""How much to say (hpcckpt/rundir/verbosity.py)."""

from __future__ import annotations

from hpcckpt.rundir import verbosity
from hpcckpt.rundir.env import LOG_LEVEL_ENV


def test_levels_from_the_environment():
    assert verbosity.level_from_env({}) == verbosity.NORMAL
    assert verbosity.level_from_env({LOG_LEVEL_ENV: " Quiet "}) == verbosity.QUIET
    assert verbosity.level_from_env({LOG_LEVEL_ENV: "verbose"}) == verbosity.VERBOSE
    assert verbosity.level_from_env({LOG_LEVEL_ENV: "loud"}) == verbosity.NORMAL
    assert [verbosity.level_name(n) for n in (-5, 0, 5)] == ["quiet", "normal", "verbose"]
