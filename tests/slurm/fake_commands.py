"""Fake Slurm commands for tests that need only a command's arguments and output."""

from __future__ import annotations

from pathlib import Path


def fake_command(tmp_path: Path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)
