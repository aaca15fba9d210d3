"""The wrapper's configuration (hpcckpt/job/config.py): the stop signal's spellings."""

from __future__ import annotations

import signal

import pytest

from hpcckpt.job import config


@pytest.mark.parametrize("text", ["USR1", "usr1", "SIGUSR1", "10", " SigUsr1 "])
def test_parse_signal_spellings(text):
    assert config.parse_signal(text) is signal.SIGUSR1


@pytest.mark.parametrize("text", ["KILL", "SIGSTOP", "9", "CHLD", "USR3", "", "999"])
def test_parse_signal_rejects(text):
    with pytest.raises(ValueError):
        config.parse_signal(text)
