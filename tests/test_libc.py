"""The process's C library, loaded once and without running ``ldconfig``."""

from __future__ import annotations

import ctypes
import os
import subprocess

from hpcckpt import libc
from hpcckpt.store.io import filesystem


def test_functions_are_found_and_each_caller_gets_its_own():
    getpid = libc.function("getpid")
    assert getpid is not None and getpid() == os.getpid()
    other = libc.function("getpid")
    other.restype = ctypes.c_char  # a caller's argtypes/restype must not leak to another
    assert getpid.restype is not ctypes.c_char
    assert libc.function("no_such_function_in_any_libc") is None


def test_detecting_a_file_system_starts_no_process(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a child process was started: {args!r:.80}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    found = filesystem.detect(tmp_path)
    assert found.magic is not None and found.kind == "local"
