"""``hpcckpt ls | inspect | verify | prune | export``: look after a checkpoint directory.

These commands run in one process, without mpirun: they read checkpoints with plain
h5py and make no MPI calls. Heavy imports happen inside the commands so that
``hpcckpt`` itself starts fast.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import click

from hpcckpt.cli.mirror import MIRROR_OPTION, open_mirror, tiers_text
from hpcckpt.report.format import size

_DIR = click.argument(
    "directory", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="DIR"
)
_JSON = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def _when(t: float | None) -> str:
    """A Unix time as ISO 8601 in UTC: 2026-11-26T02:55:05Z (the raw number is in --json)."""
    if t is None:
        return "-"
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@click.command("ls")
@_DIR
@MIRROR_OPTION
@_JSON
def ls_command(directory: Path, mirror_url: str | None, as_json: bool) -> None:
    """List the checkpoints in DIR, oldest first.

    \b
    Columns: STEP, TIME written (ISO 8601, UTC), FILE SIZE (the file on disk: the
    data, the ranks' state trees, checksums, block hashes and HDF5 metadata), RANKS
    that wrote it, KIND ("full", or "incremental": only the blocks changed since the
    previous checkpoint), BASE (the step of the full checkpoint an incremental one
    is built on), DIRTY (the fraction of the state's blocks the save wrote), ARRAYS
    WRITTEN (the bytes of array data the save wrote, all ranks: the whole state, or
    the changed blocks; 'hpcckpt report' counts the state trees too), and STATUS:
      good     committed, not marked bad, structure sound (ls does not read the
               data: run 'hpcckpt verify' to check every checksum)
      bad      marked bad by a restore that found it corrupt (a DIR/ckpt-*.h5.bad
               sidecar says why), or structurally broken, or incremental with a
               file of its chain missing or bad; restore skips it
      partial  an interrupted save (*.partial); restore ignores it and the next
               save deletes it

    \b
    With a mirror (--mirror, or $HPCCKPT_MIRROR), a TIERS column says where each
    checkpoint is: "dir" (this directory), "mirror" (verified on the mirror),
    or the tier's status where it is not good there ("mirror:bad",
    "mirror:incomplete"...); checkpoints only the mirror holds are listed too,
    with STATUS "absent" ('hpcckpt mirror pull' fetches one). --json gives each
    row's "tiers": {"directory": status, "mirror": status or null}.

    \b
    Examples:
      hpcckpt ls $SCRATCH/run1/ckpt
      hpcckpt ls $SCRATCH/run1/ckpt --mirror s3://ckpts/run1
    """
    from hpcckpt.store import catalog

    rows = catalog.list_directory(directory)
    backend = open_mirror(mirror_url) if mirror_url else None
    unreachable = catalog.with_tiers(directory, rows, backend)
    if unreachable:
        click.echo(f"the mirror could not be listed: {unreachable}", err=True)
    if as_json:
        _emit(rows)
        return
    if not rows:
        click.echo(f"no checkpoints in {directory}")
        return
    click.echo(
        f"{'STEP':>10}  {'TIME (UTC)':20}  {'FILE SIZE':>10}  {'RANKS':>5}  {'KIND':11}  "
        f"{'BASE':>10}  {'DIRTY':>6}  {'ARRAYS WRITTEN':>14}  STATUS"
        + (f"    {'TIERS':18}" if backend else "")
    )
    for row in rows:
        step = "-" if row["step"] is None else str(row["step"])
        ranks = "-" if row["ranks"] is None else str(row["ranks"])
        base = "-" if row["base"] is None else str(row["base"])
        dirty = "-" if row["dirty"] is None else f"{100 * row['dirty']:.1f}%"
        line = (
            f"{step:>10}  {_when(row['time']):20}  {size(row['size']):>10}  {ranks:>5}  "
            f"{row['kind'] or '-':11}  {base:>10}  {dirty:>6}  {size(row['written']):>14}  "
            f"{row['status']}"
        )
        if backend:
            line = f"{line:<{len(line) - len(row['status']) + 10}}{tiers_text(row['tiers']):18}"
        if row["status"] in ("bad", "rejected", "absent") and row["reason"]:
            line += f"  ({row['reason'][:80]})"
        click.echo(line)


@click.command("inspect")
@_DIR
@click.argument("step", type=int, required=False)
@MIRROR_OPTION
@_JSON
def inspect_command(
    directory: Path, step: int | None, mirror_url: str | None, as_json: bool
) -> None:
    """Show what the checkpoint of STEP in DIR holds (default: the newest).

    \b
    Arrays: path, dtype, global shape, layout ("rows": the ranks' arrays stacked
    along axis 0, so a domain-decomposed field is the global field; "flat": the
    ranks' elements concatenated), whether it was declared distributed (restorable
    on another rank count), and each rank's extent [lo, hi) along axis 0.
    Scalars: the values of rank 0, or one value per rank where ranks differ.
    Meta: the attributes of /meta (format version, step, time in ISO 8601 UTC,
    reason...; --json gives the time as Unix seconds). Reads structure and scalars
    only; 'hpcckpt verify' checks the data. Tiers: where the checkpoint is, the
    directory and, with --mirror (or $HPCCKPT_MIRROR), its copy on the mirror:
    status there, when it was mirrored, its checksum. A STEP only the mirror holds
    is described from the mirror's manifest (file, time, size, chain, status); its
    arrays are in the data, not fetched ('hpcckpt mirror pull' fetches it).

    \b
    Example:
      hpcckpt inspect ckpt 1200 --json | jq '.arrays[].shape'
    """
    from hpcckpt.store import CheckpointError, catalog

    try:
        path = catalog.find(directory, step)
        info = catalog.describe(path)
    except FileNotFoundError as exc:
        if step is None or not mirror_url:
            raise click.ClickException(str(exc)) from None
        _inspect_mirrored(directory, step, mirror_url, str(exc), as_json)
        return
    except CheckpointError as exc:
        raise click.ClickException(str(exc)) from None
    info["tiers"] = {"directory": str(path)}
    if mirror_url:
        info["tiers"]["mirror"] = catalog.mirror_tier(path, open_mirror(mirror_url))
    if as_json:
        _emit(info)
        return
    click.echo(
        f"{info['file']}: step {info['step']}, written {_when(info['time'])} by "
        f"{info['nranks']} ranks, format version {info['format_version']}"
    )
    if info["chain"]:
        click.echo(f"incremental: built on {', '.join(info['chain'])}")
    click.echo("tiers:")
    click.echo(f"  directory: {info['tiers']['directory']}")
    if "mirror" in info["tiers"]:
        m = info["tiers"]["mirror"]
        state = m["status"] or "not mirrored"
        detail = f", mirrored {_when(m['mirrored_at'])}" if m.get("mirrored_at") else ""
        why = f" ({m['reason']})" if m["status"] != "good" and m.get("reason") else ""
        click.echo(f"  mirror: {m['url']}: {state}{detail}{why}")
    click.echo("arrays:")
    for a in info["arrays"]:
        dist = ", distributed" if a["distributed"] else ""
        dist += ", replicated: rank 0's copy" if a.get("replicated") else ""
        dtype = f"torch.{a['torch_dtype']}" if a.get("torch_dtype") else a["dtype"]
        click.echo(f"  {a['name']}: {dtype}{a['shape']} ({a['layout']}{dist}, {a['bytes']} B)")
        offs = a["rank_offsets"]
        extents = ", ".join(
            f"{k}:[{offs[k]},{offs[k + 1]})" if a["layout"] == "rows" else f"{k}:{s}"
            for k, s in enumerate(a["rank_shapes"])
        )
        click.echo(f"    ranks {extents}")
    click.echo("scalars:")
    for key, value in info["scalars"].items():
        click.echo(f"  {key} = {json.dumps(value, default=str)}")
    click.echo("meta:")
    for key, value in info["meta"].items():
        if key == "time" and isinstance(value, (int, float)):
            value = _when(value)  # a date to read; --json keeps the number
        click.echo(f"  {key} = {value}")


def _inspect_mirrored(
    directory: Path, step: int, mirror_url: str, missing: str, as_json: bool
) -> None:
    """``inspect`` of a step only the mirror holds: what its manifest says."""
    from hpcckpt.store import MirrorUnavailable, catalog

    backend = open_mirror(mirror_url)
    try:
        info = catalog.describe_mirrored(backend, step)
    except MirrorUnavailable as exc:
        raise click.ClickException(f"{missing}; the mirror could not be listed: {exc}") from None
    if info is None:
        raise click.ClickException(f"{missing}, nor on the mirror {backend.url}")
    if as_json:
        _emit(info)
        return
    m = info["tiers"]["mirror"]
    click.echo(
        f"{info['file']}: step {info['step']}, written {_when(info['time'])}, "
        f"{size(info['size'])}, only on the mirror"
    )
    if info["chain"]:
        click.echo(f"incremental: built on {', '.join(info['chain'])}")
    click.echo("tiers:")
    click.echo(f"  directory: not in {directory}")
    why = f" ({m['reason']})" if m["status"] != "good" and m.get("reason") else ""
    click.echo(
        f"  mirror: {m['url']}: {m['status']}, mirrored {_when(m['mirrored_at'])}, "
        f"checksum {m['checksum']}{why}"
    )
    click.echo(
        f"arrays, scalars, meta: in the data, not fetched; 'hpcckpt mirror pull {m['url']} "
        f"{step} --to DIR' fetches it, then 'hpcckpt inspect DIR {step}'"
    )


@click.command("verify")
@_DIR
@click.argument("step", type=int, required=False)
@click.option("--all", "check_all", is_flag=True, help="Verify every committed checkpoint.")
@click.option(
    "--clear-mark",
    is_flag=True,
    help="Remove the bad mark of a checkpoint that now checks good in every byte.",
)
@_JSON
def verify_command(
    directory: Path, step: int | None, check_all: bool, clear_mark: bool, as_json: bool
) -> None:
    """Check every byte of a checkpoint in DIR against its checksums.

    \b
    Verifies the checkpoint of STEP, the newest one by default, or all of them with
    --all: the file's structure, then every rank's state tree and every rank's part
    of every array against the xxh3-64 checksums written with it. Reads one rank's
    slice at a time. A checkpoint with a .bad marker counts as bad. An incremental
    checkpoint is checked with every block it depends on: its base and deltas must
    be present, unmarked, and every block read from them must match its hash.
    Exit status 0 only when everything checked is good, 1 otherwise.

    A restore that finds a checkpoint corrupt marks it bad (DIR/ckpt-*.h5.bad) and
    never reads it again. If that was a false alarm (hpcckpt 0.1.0 took some sound
    files of many arrays for damaged: see the CHANGELOG), --clear-mark removes the mark of
    every checkpoint checked whose only problem is the mark: every byte matched its
    checksum. A damaged checkpoint keeps its mark. With --all, checkpoints are
    checked oldest first, so the base of an incremental chain is cleared before
    the deltas built on it.

    \b
    Examples:
      hpcckpt verify ckpt            # the one a restart would use first
      hpcckpt verify ckpt --all --json
      hpcckpt verify ckpt --all --clear-mark
    """
    from hpcckpt.cli.progress import progress
    from hpcckpt.store import catalog, committed_checkpoints

    if check_all and step is not None:
        raise click.UsageError("give a STEP or --all, not both")
    if check_all:
        paths = [e.path for e in reversed(committed_checkpoints(directory))]
    else:
        try:
            paths = [catalog.find(directory, step)]
        except FileNotFoundError as exc:
            raise click.ClickException(str(exc)) from None
    reports = [
        catalog.verify(p, clear_mark=clear_mark)
        for p in progress(paths, "verifying", length=len(paths))
    ]
    ok = bool(reports) and all(r["good"] for r in reports)
    if as_json:
        _emit({"good": ok, "checkpoints": reports})
    else:
        if not reports:
            click.echo(f"no checkpoints in {directory}")
        for r in reports:
            built = f" (incremental on {', '.join(r['chain'])})" if r["chain"] else ""
            click.echo(f"step {r['step']}: {'good' if r['good'] else 'BAD'}{built}")
            if r["cleared_mark"] is not None:
                click.echo(f"  bad mark removed: every byte checks (it said: {r['cleared_mark']})")
            for problem in r["problems"]:
                click.echo(f"  {problem}")
    sys.exit(0 if ok else 1)


@click.command("prune")
@_DIR
@click.option("--keep-last", type=click.IntRange(min=1), help="Keep the N newest good ones.")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep one per K steps.")
@click.option(
    "--keep-every-seconds", type=click.FloatRange(min=0, min_open=True), help="Keep one per T s."
)
@click.option("--delete-bad", is_flag=True, help="Also delete checkpoints marked bad.")
@click.option("--dry-run", is_flag=True, help="Only show what would be deleted.")
@_JSON
def prune_command(
    directory: Path,
    keep_last: int | None,
    keep_every: int | None,
    keep_every_seconds: float | None,
    delete_bad: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Delete old checkpoints in DIR, keeping what the rules ask for.

    \b
    A checkpoint stays when any rule keeps it:
      --keep-last N           the N newest good checkpoints
      --keep-every K          one per window of K steps (the oldest in each)
      --keep-every-seconds T  one per window of T seconds of checkpoint time
    The newest good checkpoint is never deleted. Checkpoints marked bad stay for
    inspection unless --delete-bad. The base and deltas a kept incremental
    checkpoint is built on are always kept with it. Partial files are left to the next save.
    Do not prune a directory while its job is saving into it; the Checkpointer
    prunes by itself (keep_last=3 unless told otherwise).

    \b
    Example:
      hpcckpt prune ckpt --keep-last 2 --keep-every 10000 --dry-run
    """
    from hpcckpt.store import retention

    if keep_last is None and keep_every is None and keep_every_seconds is None:
        raise click.UsageError(
            "give at least one of --keep-last, --keep-every, --keep-every-seconds"
        )
    doomed = retention.prune_directory(
        directory, keep_last, keep_every, keep_every_seconds, delete_bad, dry_run
    )
    if as_json:
        _emit({"dry_run": dry_run, "deleted": [p.name for p in doomed]})
        return
    verb = "would delete" if dry_run else "deleted"
    for p in doomed:
        click.echo(f"{verb} {p.name}")
    click.echo(f"{verb} {len(doomed)} checkpoint(s)")


@click.command("export")
@_DIR
@click.argument("step", type=int)
@click.argument("out", type=click.Path(path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["hdf5", "safetensors"]),
    default="hdf5",
    show_default=True,
    help="hdf5: the whole state as one flat file OUT; safetensors: the model's "
    "weights for inference, into directory OUT.",
)
@click.option(
    "--key",
    default=None,
    metavar="KEY",
    help="safetensors: the key of the saved state holding the model, e.g. 'model' or "
    "'nets/generator' [default: 'model', or the one model-like value of the state].",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    help="safetensors: the most tensor bytes per file (5GB decimal, 2GiB binary, or "
    "bytes); past it the weights are split into numbered files and an index.",
)
@_JSON
def export_command(
    directory: Path,
    step: int,
    out: Path,
    fmt: str,
    key: str | None,
    max_shard_size: str,
    as_json: bool,
) -> None:
    """Write the checkpoint of STEP in DIR as one flat HDF5 file OUT, or (with
    --format safetensors) its model's weights as safetensors files in directory OUT.

    \b
    HDF5 (the default): OUT holds the global state, readable without hpcckpt and
    independent of the rank count:
      /arrays/<path>             "rows" arrays (e.g. distributed fields) as the
                                 global array; attribute rank_offsets
      /arrays/<path>/rank<r>     any other array, one dataset per writing rank
      /scalars                   attributes <key path> = value (same on all ranks)
      /scalars/rank<r>           attributes of values that differ between ranks
      /trees                     each rank's exact state tree (JSON strings)
    Every array is checked against its checksums on the way. An incremental
    checkpoint is materialized from its chain (base plus deltas) into the same flat
    file a full checkpoint would give. See docs/format.md.

    \b
    safetensors: the tensors under one key of the saved state (the model, saved as
    the object or its state_dict(); --key names it, by default 'model' or the one
    top-level value with tensors that is not an optimizer), consolidated from every
    rank's piece (replicated or distributed, any rank count), named as in the
    model's state_dict() and with their torch dtypes (bfloat16 is BF16):
      OUT/model.safetensors                   when the weights fit --max-shard-size
      OUT/model-00001-of-0000N.safetensors    otherwise, with
      OUT/model.safetensors.index.json        metadata.total_size and weight_map
    Load with safetensors.torch.load_file and model.load_state_dict, or with
    Hugging Face tools. Written tensor by tensor: memory is bounded by the largest
    tensor, not the model. A previous export in OUT is replaced.

    \b
    Examples:
      hpcckpt export ckpt 1200 state-1200.h5 && h5ls -r state-1200.h5
      hpcckpt export --format safetensors ckpt 1200 model-1200/
      hpcckpt export --format safetensors --key model --max-shard-size 2GB ckpt 1200 out/
    """
    from hpcckpt.store import CheckpointError, catalog

    if fmt == "safetensors":
        from hpcckpt.store import export_safetensors, parse_shard_size

        try:
            cap = parse_shard_size(max_shard_size)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    try:
        source = catalog.find(directory, step)
        if fmt == "safetensors":
            done = export_safetensors(source, out, key=key, max_shard_size=cap)
        else:
            from hpcckpt.store import export_checkpoint

            if out.is_dir():
                raise click.BadParameter(
                    f"{out} is a directory; the HDF5 export writes one file "
                    "(or use --format safetensors for a directory of weights)",
                    param_hint="OUT",
                )
            path = export_checkpoint(source, out)
    except (FileNotFoundError, CheckpointError) as exc:
        raise click.ClickException(str(exc)) from None
    if fmt == "safetensors":
        if as_json:
            _emit({"step": step, "format": "safetensors", **done.as_dict()})
        else:
            files = ", ".join(p.name for p in done.files)
            click.echo(
                f"exported step {step}: {done.tensors} tensors of {done.key!r} "
                f"({size(done.total_size)}) to {out}/ ({files})"
            )
    elif as_json:
        _emit({"step": step, "out": str(path), "bytes": path.stat().st_size})
    else:
        click.echo(f"exported step {step} to {path}")


COMMANDS: list[click.Command] = [
    ls_command,
    inspect_command,
    verify_command,
    prune_command,
    export_command,
]
