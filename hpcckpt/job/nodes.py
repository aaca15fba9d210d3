"""Which nodes a job has, and which of them failed: hostlists, ``sinfo`` and ``scontrol``.

Stdlib only, like the rest of :mod:`hpcckpt.job`. Slurm commands go through
:func:`hpcckpt.job.slurm.run_command` (argument lists, timeouts, own session).

A node counts as *failed* when ``sinfo`` reports it ``down``, ``fail``/``failing`` or
not responding (a trailing ``*``): what Slurm shows after a node stopped answering for
``SlurmdTimeout``. Seen on Slurm 22.05 (docs/local-cluster.md, "Node failures"):
``srun`` of a step on the failed node returns only once the controller has marked the
node down (about 25-30 s after the node died), so when the step has ended, ``sinfo``
already tells which node it was.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from hpcckpt.job import slurm

SINFO_ENV = "HPCCKPT_SINFO"

#: srun's message when a node of its step fails: ``srun: error: Node failure on n2``.
_SRUN_NODE_FAILURE = re.compile(r"Node failure on ([A-Za-z0-9_.\-]+)")
_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def expand_hostlist(text: str) -> list[str]:
    """``n[1-3,5],gpu[01-02]`` -> ``[n1, n2, n3, n5, gpu01, gpu02]`` (Slurm's hostlist form).

    Handles one bracket group per name with ranges and zero padding, which is what Slurm
    prints for ``SLURM_JOB_NODELIST`` and ``NodeList=``. ``(null)`` and empty give ``[]``.
    """
    text = (text or "").strip()
    if not text or text in ("(null)", "None"):
        return []
    names: list[str] = []
    for item in _split_top(text):
        m = _BRACKET.match(item)
        if not m:
            names.append(item)
            continue
        prefix, body, suffix = m.groups()
        for part in body.split(","):
            lo, sep, hi = part.partition("-")
            if not sep:
                names.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo) if lo.startswith("0") else 0
            for i in range(int(lo), int(hi) + 1):
                names.append(f"{prefix}{str(i).zfill(width)}{suffix}")
    return list(dict.fromkeys(names))


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur:
        out.append(cur)
    return out


def parse_srun_failure(text: str) -> list[str]:
    """The nodes srun named in ``Node failure on nX`` lines, in order, without repeats."""
    return list(dict.fromkeys(_SRUN_NODE_FAILURE.findall(text or "")))


def is_failed(state: str) -> bool:
    """A ``sinfo %T`` state meaning the node is lost: down, fail(ing), not responding (``*``)."""
    s = (state or "").strip().lower()
    if not s:
        return False
    base = s.rstrip("*~#!%$@^-").split("+")[0]
    return s.endswith("*") or base in ("down", "fail", "failing")


def parse_sinfo(text: str) -> dict[str, str]:
    """``sinfo -h -N -o "%N %T"`` output -> ``{node: state}``."""
    states: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) >= 2:
            states[parts[0]] = parts[1].lower()
    return states


def node_states(
    nodes: Iterable[str] | None = None,
    *,
    timeout: float = slurm.QUERY_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """``{node: state}`` from sinfo, for ``nodes`` (all nodes if None)."""
    argv = [slurm.command_path("sinfo", SINFO_ENV, environ), "-h", "-N", "-o", "%N %T"]
    wanted = list(nodes) if nodes is not None else None
    if wanted:
        argv += ["-n", ",".join(wanted)]
    states = parse_sinfo(slurm.run_command(argv, timeout=timeout))
    return states if wanted is None else {n: s for n, s in states.items() if n in wanted}


def down_since(
    nodes: Iterable[str],
    *,
    timeout: float = slurm.QUERY_TIMEOUT,
    environ: Mapping[str, str] | None = None,
) -> dict[str, tuple[str, float | None]]:
    """``sinfo -R``: ``{node: (reason, when it was set as Unix time or None)}`` for ``nodes``."""
    wanted = list(nodes)
    if not wanted:
        return {}
    argv = [
        slurm.command_path("sinfo", SINFO_ENV, environ),
        "-h",
        "-R",
        "-N",
        "-n",
        ",".join(wanted),
        "-o",
        "%N|%H|%E",
    ]
    out: dict[str, tuple[str, float | None]] = {}
    for line in slurm.run_command(argv, timeout=timeout).splitlines():
        parts = line.split("|", 2)
        if len(parts) != 3 or parts[0] not in wanted:
            continue
        try:
            when: float | None = datetime.strptime(parts[1], "%Y-%m-%dT%H:%M:%S").timestamp()
        except ValueError:
            when = None
        out[parts[0]] = (parts[2].strip(), when)
    return out


@dataclass(frozen=True)
class JobNodes:
    """The job's nodes as ``scontrol show job`` sees them now."""

    nodes: list[str]  # NodeList now (Slurm removes a failed node from a --no-kill job)
    state: str
    restarts: int
    requeue: bool  # Requeue=1: Slurm requeues it by itself after a node failure


def job_nodes(
    job: str, *, timeout: float = slurm.QUERY_TIMEOUT, environ: Mapping[str, str] | None = None
) -> JobNodes:
    info = slurm.show_job(job, timeout=timeout, environ=environ)
    try:
        restarts = int(info.get("Restarts", "0") or 0)
    except ValueError:
        restarts = 0
    return JobNodes(
        nodes=expand_hostlist(info.get("NodeList", "")),
        state=info.get("JobState", ""),
        restarts=restarts,
        requeue=info.get("Requeue", "0") == "1",
    )


def allocation(environ: Mapping[str, str]) -> list[str]:
    """The nodes the job was given at its start (``SLURM_JOB_NODELIST``)."""
    return expand_hostlist(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", ""))
