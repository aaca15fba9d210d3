"""``hpcckpt mirror ls | verify | pull | prune``: what the mirror (the second tier) holds,
whether every byte of it still checks, fetching a checkpoint back into a directory, and
deleting what its rules do not keep.

What the mirror holds comes from its index (``index.json`` beside the manifests), made
true to one listing of the mirror (``ls``, ``prune``, ``verify --all``) or checked
cheaply (``verify``, ``pull``); the checkpoint a command acts on is read from its own
manifest. No command fetches every manifest.

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


def _listing(backend: Any, *, exact: bool = True) -> list[Any]:
    """The mirror's checkpoints, newest first, from its index: made true to one listing
    of the mirror (``exact``), or after the index's cheap check."""
    from hpcckpt.store import MirrorUnavailable, load_mirror_index, reconcile_mirror_index

    try:
        index = reconcile_mirror_index(backend) if exact else load_mirror_index(backend)
        return index.listing()
    except MirrorUnavailable as exc:
        raise click.ClickException(str(exc)) from None


def _confirmed(backend: Any, name: str) -> dict[str, Any]:
    """``name`` and its chain as their own objects say now (a command acts on these)."""
    from hpcckpt.store import MirrorUnavailable, confirm_mirrored

    try:
        return confirm_mirrored(backend, [name])
    except MirrorUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.group("mirror")
def mirror_group() -> None:
    """List, verify, fetch and prune the checkpoints of a mirror (the second tier).

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
      hpcckpt mirror prune s3://ckpts/run1 --keep-last 3 --dry-run
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
    from hpcckpt.store import MirrorUnavailable, checkpoint_name, verify_mirrored

    if check_all and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    backend = open_mirror(url)
    if check_all:
        # oldest first: bases before deltas
        names = [m.name for m in reversed(_listing(backend))]
    elif step is not None:
        names = [checkpoint_name(step)]
    else:
        names = []
        for m in _listing(backend, exact=False):
            now = _confirmed(backend, m.name).get(m.name) if m.good else None
            if now is not None and now.good:
                names = [m.name]
                break
    reports = []
    try:
        for name in names:
            known = _confirmed(backend, name)
            reports.append(verify_mirrored(backend, name, mark=not no_mark, known=known))
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
        checkpoint_name,
        pull_mirrored,
        step_of,
    )

    backend = open_mirror(url)
    if step is not None:
        names = [checkpoint_name(step)]
    else:
        names = [m.name for m in _listing(backend, exact=False) if m.good]
    if not names:
        raise click.ClickException(f"no good mirrored checkpoint on {backend.url}")
    skipped: list[str] = []
    for name in names:
        known = _confirmed(backend, name)
        if step is None and not (name in known and known[name].good):
            continue  # the index was behind: no longer good there
        try:
            path = pull_mirrored(backend, name, directory, known=known)
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


@mirror_group.command("prune")
@_URL
@click.option("--keep-last", type=click.IntRange(min=1), help="Keep the N newest good ones.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep one per K steps.")
@click.option("--thinning", metavar="TIERS", help='Tiers by age, e.g. "6h:all,7d:1d,*:1w".')
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted.")
@_JSON
def mirror_prune(
    url: str,
    keep_last: int | None,
    keep_every: int | None,
    thinning: str | None,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete the checkpoints on MIRROR that the rules do not keep.

    \b
    The rules of a job's mirror_keep_last, mirror_keep_every and
    mirror_thinning (docs/tiers.md); a checkpoint stays when any rule keeps it:
      --keep-last N      the N newest good checkpoints
      --keep-every K     one per window of K steps (the oldest good one in each)
      --thinning TIERS   tiers by age: "6h:all,7d:1d,*:1w" keeps every checkpoint
                         of the last 6 hours, one a day for a week, one a week after
    The newest good checkpoint always stays, and whatever a kept checkpoint is
    built on. Bad copies stay for inspection. Each checkpoint's manifest goes
    first, then its data; the mirror's index is updated after. Safe beside a
    job copying to the same mirror: a checkpoint it adds meanwhile is never
    deleted or lost from the index. MIRROR: see 'hpcckpt mirror --help'.

    \b
    Example:
      hpcckpt mirror prune s3://ckpts/run1 --keep-last 3 --keep-every 10000 --dry-run
    """
    import time

    from hpcckpt.store import (
        MirrorOptions,
        MirrorUnavailable,
        prune_mirror,
        reconcile_mirror_index,
    )

    if keep_last is None and keep_every is None and thinning is None:
        raise click.UsageError("give at least one of --keep-last, --keep-every, --thinning")
    try:
        options = MirrorOptions(
            url,
            mirror_keep_last=keep_last,
            mirror_keep_every=keep_every,
            mirror_thinning=thinning,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    backend = open_mirror(url)
    try:
        index = reconcile_mirror_index(backend)
        doomed = prune_mirror(backend, options, time.time(), dry_run, index=index)
    except MirrorUnavailable as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        _emit({"mirror": backend.url, "dry_run": dry_run, "deleted": doomed})
        return
    verb = "would delete" if dry_run else "deleted"
    for name in doomed:
        click.echo(f"{verb} {name}")
    click.echo(f"{verb} {len(doomed)} checkpoint(s) on {backend.url}")


COMMANDS: list[click.Command] = [mirror_group]
