"""munge for the local cluster: is it answering, and start one if it is not."""

from __future__ import annotations

import os
import pwd
import subprocess
import time
from pathlib import Path

from hpcckpt.cluster import config
from hpcckpt.cluster.config import DEBIAN_HINT, ClusterError, read_pid


def munge_works(timeout: float = 10.0) -> bool:
    """``munge -n | unmunge`` succeeds (two processes piped, no shell)."""
    munge, unmunge = config.find_binary("munge"), config.find_binary("unmunge")
    if not munge or not unmunge:
        return False
    try:
        producer = subprocess.Popen(
            [munge, "-n"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
    except OSError:
        return False
    try:
        consumer = subprocess.run(
            [unmunge],
            stdin=producer.stdout,
            capture_output=True,
            timeout=timeout,
        )
        producer.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        producer.kill()
        producer.wait()
        return False
    finally:
        if producer.stdout:
            producer.stdout.close()
    return producer.returncode == 0 and consumer.returncode == 0


def ensure_munge(timeout: float = 15.0) -> int | None:
    """Make sure a munged answers; start one as the munge user if needed.

    Returns the pid of the munged this call started, or None if one was already running.
    """
    if munge_works():
        return None
    munged = config.find_binary("munged")
    if not munged:
        raise ClusterError(f"munged not found; {DEBIAN_HINT}")
    if os.geteuid() != 0:
        raise ClusterError(
            "munged is not running and only root can start it here; "
            "start it with `sudo systemctl start munge` (or run as root)"
        )
    try:
        pw = pwd.getpwnam("munge")
    except KeyError as exc:
        raise ClusterError(f"no 'munge' user on this machine; {DEBIAN_HINT}") from exc
    rundir = Path("/run/munge")
    rundir.mkdir(parents=True, exist_ok=True)
    os.chown(rundir, pw.pw_uid, pw.pw_gid)
    rundir.chmod(0o755)
    runuser = config.find_binary("runuser")
    argv = [munged, "--force"]
    if runuser:
        argv = [runuser, "-u", "munge", "--", *argv]
    try:
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"{' '.join(argv)} did not finish within {timeout:.0f} s") from exc
    except OSError as exc:
        raise ClusterError(f"cannot run {argv[0]}: {exc}") from exc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if munge_works():
            return read_pid(rundir / "munged.pid")
        time.sleep(0.2)
    raise ClusterError(
        f"munged did not come up ({' '.join(argv)} exited {proc.returncode}: "
        f"{(proc.stderr or proc.stdout).strip()}); see /var/log/munge/munged.log"
    )
