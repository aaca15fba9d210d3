"""Directories a user cannot write, made as root: without CAP_DAC_OVERRIDE (a mode that
refuses), or immutable (``chattr +i``: refused even to root). Missing tools are failures,
never skips."""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path


def as_a_user() -> list[str]:
    """A command prefix that runs without root's power over file modes (CAP_DAC_OVERRIDE),
    so that a directory's mode refuses the command as it refuses a user; none when not root."""
    if os.geteuid() != 0:
        return []
    assert shutil.which("setpriv"), "setpriv (util-linux) is needed to drop CAP_DAC_OVERRIDE"
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]


def who(number: int, kind: str = "uid") -> str:
    """A user or group as hpcckpt names it: ``root (uid 0)``, or ``uid 1000`` alone."""
    try:
        name = (pwd.getpwuid(number) if kind == "uid" else grp.getgrgid(number))[0]
    except KeyError:
        return f"{kind} {number}"
    return f"{name} ({kind} {number})"


def set_immutable(path: Path, on: bool = True) -> None:
    assert shutil.which("chattr"), "chattr (e2fsprogs) is needed for an immutable directory"
    r = subprocess.run(["chattr", "+i" if on else "-i", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"chattr on {path} failed (no immutable flag here?): {r.stderr}"


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    """``chattr +i`` on ``path`` for the block: not even root may create files in it."""
    set_immutable(path)
    try:
        yield
    finally:
        set_immutable(path, on=False)
