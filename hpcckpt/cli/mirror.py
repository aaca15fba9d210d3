"""``hpcckpt mirror ls | verify | pull``: what the mirror (the second tier) holds, whether
every byte of it still checks, and fetching a checkpoint back into a directory.

One process, no MPI: from a login node, against a directory on another file system or
an S3 bucket (boto3, ``pip install 'hpcckpt[s3]'``). Heavy imports happen inside the
commands so that ``hpcckpt`` itself starts fast.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import click

from hpcckpt.report.format import size
from hpcckpt.rundir.env import MIRROR_ENV

_URL = click.argument("url", metavar="MIRROR")
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")

#: ``--mirror`` of ``hpcckpt ls`` and ``inspect``: the mirror whose copies they show.
MIRROR_OPTION = click.option(
    "--mirror",
    "mirror_url",
    envvar=MIRROR_ENV,
    metavar="MIRROR",
    default=None,
    help=f"Also show the copies on this mirror (a directory or s3://bucket/prefix) "
    f"[default: ${MIRROR_ENV}].",
)


def tiers_text(tiers: dict[str, str | None]) -> str:
    """``{"directory": "good", "mirror": "bad"}`` -> "dir mirror:bad" (absent tiers left out)."""
    words = []
    for tier, short in (("directory", "dir"), ("mirror", "mirror")):
        status = tiers.get(tier)
        if status is not None:
            words.append(short if status == "good" else f"{short}:{status.replace(' ', '-')}")
    return " ".join(words) or "-"


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _when(t: float | None) -> str:
    if not t:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def open_mirror(url: str) -> Any:
    """The backend of ``url``, or a usage error saying what is wrong with it."""
    from hpcckpt.store import MirrorUnavailable, open_backend

    try:
        return open_backend(url)
    except (ValueError, MirrorUnavailable) as exc:
        raise click.ClickException(str(exc)) from None


def _listing(backend: Any) -> list[Any]:
    from hpcckpt.store import MirrorUnavailable, list_mirrored

    try:
        return list_mirrored(backend)
    except MirrorUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.group("mirror")
def mirror_group() -> None:
    """List, verify and fetch the checkpoints of a mirror (the second tier).

    \b
    MIRROR is what the job's mirror= (or $HPCCKPT_MIRROR, or 'hpcckpt srun
    --mirror') named: a directory on another file system (/project/run1/ckpt)
    or an S3 URL (s3://bucket/prefix). For S3 the endpoint and credentials come
    the standard way: AWS_ENDPOINT_URL (or endpoint_url in a profile),
    AWS_PROFILE, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.

    \b
    A job with a mirror (Checkpointer(mirror=...), $HPCCKPT_MIRROR or
    'hpcckpt srun --mirror ...') copies its checkpoints there in the
    background. A copy counts only once every byte was read back and matched,
    and its manifest was written last; a restore takes the newest good
    checkpoint of the directory or the mirror, whichever is newer.

    \b
    Examples:
      hpcckpt mirror ls s3://ckpts/run1
      hpcckpt mirror verify s3://ckpts/run1 --all --json
      hpcckpt mirror pull /project/me/run1 --to $SCRATCH/run1/ckpt
    """


@mirror_group.command("ls")
@_URL
@_JSON
def mirror_ls(url: str, as_json: bool) -> None:
    """List the checkpoints on MIRROR, oldest first (as 'hpcckpt ls').

    \b
    Columns: STEP, TIME the checkpoint was written (UTC), SIZE of its file,
    KIND ("full", or "incremental": built on the files listed under BUILT ON,
    which the mirror holds too), MIRRORED (when its copy was verified), STATUS:
      good          every byte was read back and matched when it was mirrored
                    (run 'hpcckpt mirror verify' to read it again now)
      bad           a verify or a restore found its bytes damaged; skipped
      incomplete    its data is missing or of another size than the manifest
      broken chain  a file it is built on is not good on the mirror
    An upload still running, or cut, has no manifest yet and is not listed.
    MIRROR: see 'hpcckpt mirror --help'.

    \b
    Example:
      hpcckpt mirror ls s3://ckpts/run1 --json | jq '.[] | select(.status=="good") | .step'
    """
    backend = open_mirror(url)
    listing = _listing(backend)[::-1]  # oldest first, as the directory's ls
    if as_json:
        _emit([m.to_dict() for m in listing])
        return
    if not listing:
        click.echo(f"no mirrored checkpoints on {backend.url}")
        return
    click.echo(
        f"{'STEP':>10}  {'TIME (UTC)':20}  {'SIZE':>10}  {'KIND':11}  {'MIRRORED (UTC)':20}  "
        f"STATUS  BUILT ON"
    )
    for m in listing:
        kind = "incremental" if m.chain else "full"
        line = (
            f"{m.step:>10}  {_when(m.time):20}  {size(m.size):>10}  {kind:11}  "
            f"{_when(m.mirrored_at):20}  {m.status}"
        )
        if m.chain:
            line += "  " + ", ".join(name for name, _, _ in m.chain)
        if not m.good and m.reason:
            line += f"  ({m.reason[:100]})"
        click.echo(line)


@mirror_group.command("verify")
@_URL
@click.argument("step", type=int, required=False)
@click.option("--all", "check_all", is_flag=True, help="Verify every mirrored checkpoint.")
@click.option(
    "--no-mark", is_flag=True, help="Only report; do not mark a damaged copy bad on the mirror."
)
@_JSON
def mirror_verify(
    url: str, step: int | None, check_all: bool, no_mark: bool, as_json: bool
) -> None:
    """Read a checkpoint back from MIRROR and check every byte.

    \b
    Verifies the checkpoint of STEP, by default the newest good one (the one a
    restore would take from the mirror), or all of them with --all. Every byte
    of its file, and of each file an incremental checkpoint is built on, is read
    back from the mirror and its xxh3-64 compared with the manifest written when
    it was mirrored (that checksum was taken from the file the job wrote, itself
    checked against the checkpoint's own checksums). A copy that fails is marked
    bad on the mirror (unless --no-mark), so restores skip it. Reads everything:
    on S3 that is the whole size in downloads. Exit status 0 only when every
    checkpoint checked is good. MIRROR: see 'hpcckpt mirror --help'.

    \b
    Examples:
      hpcckpt mirror verify s3://ckpts/run1          # the newest good one
      hpcckpt mirror verify s3://ckpts/run1 1200 --no-mark
      hpcckpt mirror verify /project/me/run1 --all --json
    """
    from hpcckpt.store import MirrorUnavailable, verify_mirrored

    if check_all and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    backend = open_mirror(url)
    listing = _listing(backend)
    if check_all:
        names = [m.name for m in reversed(listing)]  # oldest first: bases before deltas
    elif step is not None:
        names = [f"{step}"]
    else:
        newest = next((m for m in listing if m.good), None)
        names = [newest.name] if newest is not None else []
    reports = []
    try:
        for name in names:
            reports.append(verify_mirrored(backend, name, mark=not no_mark))
    except MirrorUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    ok = bool(reports) and all(r.good for r in reports)
    if as_json:
        _emit({"mirror": backend.url, "good": ok, "checkpoints": [r.to_dict() for r in reports]})
    else:
        if not reports:
            click.echo(f"no good mirrored checkpoint on {backend.url}")
        for r in reports:
            click.echo(f"step {r.step}: {'good' if r.good else 'BAD'}")
            for problem in r.problems:
                click.echo(f"  {problem}")
            if r.marked:
                click.echo("  marked bad on the mirror: restores skip it")
    sys.exit(0 if ok else 1)


@mirror_group.command("pull")
@_URL
@click.argument("step", type=int, required=False)
@click.option(
    "--to",
    "directory",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="The checkpoint directory to fetch into (created if needed).",
)
@_JSON
def mirror_pull(url: str, step: int | None, directory: Path, as_json: bool) -> None:
    """Fetch a checkpoint from MIRROR into a checkpoint directory.

    \b
    Fetches the checkpoint of STEP, by default the newest good one, with the
    files of its chain the directory lacks. Each file is downloaded under a
    temporary name, its xxh3-64 compared with the manifest, and only then
    renamed into place (fsynced): a cut or damaged download never looks like a
    checkpoint. A copy that fails the check is marked bad on the mirror; without
    STEP the next older good one is fetched instead. Another file of that step
    in the directory is never replaced. A job restores from the mirror by itself
    when its directory holds nothing newer: pull is for moving a run by hand
    (another cluster, a fresh scratch directory) or for inspecting a copy.
    MIRROR: see 'hpcckpt mirror --help'.

    \b
    Examples:
      hpcckpt mirror pull s3://ckpts/run1 --to $SCRATCH/run1/ckpt
      hpcckpt mirror pull /project/me/run1 1200 --to /tmp/look --json
    """
    from hpcckpt.store import (
        CheckpointError,
        MirrorCopyBad,
        MirrorUnavailable,
        pull_mirrored,
        step_of,
    )

    backend = open_mirror(url)
    listing = _listing(backend)
    names = [f"{step}"] if step is not None else [m.name for m in listing if m.good]
    if not names:
        raise click.ClickException(f"no good mirrored checkpoint on {backend.url}")
    skipped: list[str] = []
    for name in names:
        try:
            path = pull_mirrored(backend, name, directory)
            break
        except MirrorCopyBad as exc:
            if step is not None:
                raise click.ClickException(str(exc)) from None
            skipped.append(str(exc))
            if not as_json:
                click.echo(f"skipped: {exc}", err=True)
        except (CheckpointError, FileExistsError, MirrorUnavailable) as exc:
            raise click.ClickException(str(exc)) from None
    else:
        raise click.ClickException(f"no mirrored checkpoint of {backend.url} checked good")
    pulled = {
        "step": step_of(path.name),
        "path": str(path),
        "bytes": path.stat().st_size,
        "skipped": skipped,
    }
    if as_json:
        _emit(pulled)
    else:
        click.echo(f"pulled step {pulled['step']} into {path} ({size(pulled['bytes'])}, verified)")


COMMANDS: list[click.Command] = [mirror_group]
