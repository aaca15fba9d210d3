"""The mirror's retention (hpcckpt/store/mirror/retention.py), and both tiers' retention
together over random sequences of saves, copies, failures and prunes."""

from __future__ import annotations

import math
import random

import pytest

from hpcckpt.store import retention
from hpcckpt.store.mirror import retention as mirror_retention
from hpcckpt.store.retention import Candidate

H, D, W = 3600.0, 86400.0, 7 * 86400.0


def test_parse_thinning_and_ages():
    tiers = mirror_retention.parse_thinning("6h:all,7d:1d,*:1w")
    assert tiers == (
        mirror_retention.Tier(6 * H, 0.0),
        mirror_retention.Tier(7 * D, D),
        mirror_retention.Tier(math.inf, W),
    )
    assert mirror_retention.parse_age("90s") == 90 and mirror_retention.parse_age("2w") == 2 * W


@pytest.mark.parametrize("text", ["6h", "7d:1d,6h:all", "x:all", "6h:all,6h:1d", "1h:-1d"])
def test_nonsense_thinning_is_refused_with_an_example(text):
    with pytest.raises(ValueError, match="6h|duration"):
        mirror_retention.parse_thinning(text)


def test_thinning_keeps_all_recent_one_a_day_then_one_a_week():
    now = 100 * D
    # one checkpoint an hour for 30 days
    cands = [Candidate(i, now - i * H) for i in range(30 * 24)]
    keep = mirror_retention.steps_to_keep(cands, now, thinning="6h:all,7d:1d,*:1w")
    recent = {c.step for c in cands if now - c.time < 6 * H}
    assert recent <= keep
    week = [c for c in cands if 6 * H <= now - c.time < 7 * D and c.step in keep]
    days = {math.floor(c.time / D) for c in week}
    assert len(week) == len(days)  # one per day window
    older = [c for c in cands if now - c.time >= 7 * D and c.step in keep]
    assert len(older) == len({math.floor(c.time / W) for c in older}) and older
    assert len(keep) < 60


def test_without_a_star_tier_old_checkpoints_go_but_the_newest_stays():
    now = 10 * D
    cands = [Candidate(1, now - 9 * D), Candidate(2, now - 8 * D)]
    assert mirror_retention.steps_to_keep(cands, now, thinning="1d:all") == {2}


def test_last_milestones_and_chains():
    cands = [Candidate(s, float(s), needs=(s - 1,) if s % 2 == 0 else ()) for s in range(1, 11)]
    keep = mirror_retention.steps_to_keep(cands, 100.0, keep_last=1, keep_every=5)
    # 10 is a delta of 9; milestones 1 (window 0), 5, 10 (delta of 9)
    assert keep == {1, 5, 9, 10}
    assert mirror_retention.steps_to_keep(cands, 100.0) == set(range(1, 11))


def test_bad_copies_stay_unless_asked_and_never_count_as_newest():
    cands = [Candidate(1, 1.0), Candidate(2, 2.0, bad=True)]
    assert mirror_retention.steps_to_keep(cands, 10.0, keep_last=1) == {1, 2}
    assert mirror_retention.steps_to_keep(cands, 10.0, keep_last=1, delete_bad=True) == {1}


def sound(tier: dict[int, Candidate]) -> set[int]:
    """Steps restorable from ``tier`` alone: not bad, every file they need there and sound."""
    ok: set[int] = set()
    for step in sorted(tier):
        c = tier[step]
        if not c.bad and all(n in ok for n in c.needs):
            ok.add(step)
    return ok


def newest(steps: set[int]) -> int:
    return max(steps, default=-1)


@pytest.mark.parametrize("seed", range(40))
def test_both_tiers_keep_the_newest_good_copy_at_every_moment(seed):
    """Random saves (full or deltas), copies that succeed or fail, checkpoints that go
    bad, and prunes of either tier under random rules: no prune ever lowers the newest
    checkpoint restorable from the two tiers, the directory always holds the one on its
    way to the mirror with its chain, and each tier keeps its own newest good one."""
    rnd = random.Random(seed)
    directory: dict[int, Candidate] = {}
    mirrored: dict[int, Candidate] = {}
    pending: Candidate | None = None
    chain: list[int] = []
    now = 0.0
    for step in range(1, 80):
        now += rnd.choice([60.0, 600.0, H, 6 * H, D])
        op = rnd.random()
        if op < 0.45 or not directory:  # a save (a delta only of an intact chain)
            intact = all(n in directory and not directory[n].bad for n in chain)
            if chain and intact and rnd.random() < 0.7 and len(chain) < 5:
                needs = tuple(chain)
            else:
                needs, chain = (), []
            c = Candidate(step, now, needs=needs)
            directory[step] = c
            chain = [*chain, step]
            if rnd.random() < 0.5:
                pending = c  # a newer one replaces an older one not yet sent
        elif op < 0.6 and pending is not None:  # the copy succeeds
            assert pending.step in directory and all(n in directory for n in pending.needs)
            for n in (*pending.needs, pending.step):
                if n not in mirrored or mirrored[n].bad:
                    mirrored[n] = directory[n]
            pending = None
        elif op < 0.65:  # the copy fails (store down, cut): nothing changes
            pass
        elif op < 0.72:  # a checkpoint goes bad somewhere (found at a restore)
            tier = rnd.choice([directory, mirrored])
            if tier:
                s = rnd.choice(sorted(tier))
                tier[s] = Candidate(s, tier[s].time, True, tier[s].needs)
                if pending is not None and s in (pending.step, *pending.needs):
                    if tier is directory:
                        pending = None  # the worker gives up on a bad source
        else:  # a prune of one tier
            before = newest(sound(directory) | sound(mirrored))
            own = newest(sound(directory)), newest(sound(mirrored))
            if rnd.random() < 0.5:
                protect = set() if pending is None else {pending.step, *pending.needs}
                keep = retention.steps_to_keep(
                    directory.values(),
                    keep_last=rnd.choice([1, 2, 3]),
                    keep_every=rnd.choice([None, 10]),
                    delete_bad=rnd.random() < 0.5,
                    protect=protect,
                )
                directory = {s: c for s, c in directory.items() if s in keep}
            else:
                keep = mirror_retention.steps_to_keep(
                    mirrored.values(),
                    now,
                    keep_last=rnd.choice([None, 1, 2]),
                    keep_every=rnd.choice([None, 20]),
                    thinning=rnd.choice([None, "6h:all,7d:1d,*:1w", "1h:all,1d:6h"]),
                    delete_bad=rnd.random() < 0.5,
                )
                mirrored = {s: c for s, c in mirrored.items() if s in keep}
            assert newest(sound(directory) | sound(mirrored)) == before
            assert (newest(sound(directory)), newest(sound(mirrored))) == own
        if pending is not None:
            assert pending.step in directory and all(n in directory for n in pending.needs)


def _seen(listing) -> list[tuple]:
    return [(m.step, m.name, m.status, m.reason, m.uid, m.chain) for m in listing]


@pytest.mark.parametrize("seed", range(3))
def test_the_index_lists_what_the_manifests_say_after_every_operation(tmp_path, seed):
    """Random copies (full checkpoints and deltas with their chains), marks, prunes under
    random rules, a lost or damaged index: after each, the mirror's index (what the
    retention decides on) lists exactly what every manifest and mark on the mirror says."""
    import time

    import numpy as np
    from mpi4py import MPI

    from hpcckpt.store.file import layout
    from hpcckpt.store.mirror import copy as mirror
    from hpcckpt.store.mirror import index as mirror_index
    from hpcckpt.store.mirror.backend import DirectoryBackend
    from hpcckpt.store.mirror.worker import prune_mirror
    from hpcckpt.store.options import MirrorOptions
    from hpcckpt.store.store import CheckpointStore

    rnd = random.Random(seed)
    root = tmp_path / "m"
    root.mkdir()
    backend = DirectoryBackend(root)
    store = CheckpointStore(tmp_path / "ck", MPI.COMM_SELF, max_chain=3)
    u = np.random.default_rng(seed).random(1_000_000)
    step = 0
    for _ in range(16):
        op = rnd.random()
        if op < 0.5 or step == 0:
            step += 1
            u[: 1000 * rnd.randint(1, 5)] += 1.0
            mirror_index.upload(backend, store.save(step, {"u": u}).path)
        elif op < 0.65:
            names = [m.name for m in mirror.list_mirrored(backend)]
            mirror.mark_bad(backend, rnd.choice(names), f"found damaged ({seed})")
        elif op < 0.9:
            options = MirrorOptions(
                str(root),
                mirror_keep_last=rnd.choice([None, 1, 2]),
                mirror_keep_every=rnd.choice([None, 3]),
                mirror_thinning=rnd.choice([None, "1h:all"]),
            )
            prune_mirror(backend, options, time.time() + rnd.choice([0, 2 * H]))
        elif op < 0.95:
            (root / mirror_index.INDEX).unlink(missing_ok=True)
        else:
            (root / mirror_index.INDEX).write_bytes(b"\x00garbage")
        assert _seen(mirror_index.load(backend).listing()) == _seen(
            mirror.list_mirrored(backend)
        ), f"after step {step} ({layout.checkpoint_name(step)})"
