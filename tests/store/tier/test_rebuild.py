"""The plan of a restore from the node-local tier: who moves what, who is rebuilt, or why
not (pure: the gathered inventories in, a plan out)."""

from __future__ import annotations

from hpcckpt.store.tier import rebuild as local_restore


def held(*per_process):
    return [list(p) for p in per_process]


def data(step, owner, uid="u"):
    return ("data", step, uid, owner)


def red(step, owner, members, scheme="xor", uid="u"):
    return ("red", step, uid, owner, scheme, tuple(members))


SET = (0, 1, 2)


def test_every_rank_at_home_needs_nothing():
    inv = held(*[[data(6, r), red(6, r, SET)] for r in range(3)])
    p = local_restore.plan(inv, 6, "u", 3)
    assert (p.data_moves, p.red_moves, p.rebuild) == ([], [], [])


def test_files_on_another_node_are_moved_and_a_lost_rank_rebuilt():
    # process 1 now runs on rank 2's old node; rank 1's node is gone
    inv = held([data(6, 0), red(6, 0, SET)], [data(6, 2), red(6, 2, SET)], [])
    p = local_restore.plan(inv, 6, "u", 3)
    assert p.data_moves == [(2, 1)] and p.red_moves == [(2, 1)]
    assert p.rebuild == [(1, "xor", SET)]


def test_two_lost_of_one_xor_set_is_refused_with_the_reason():
    inv = held([data(6, 0), red(6, 0, SET)], [], [])
    assert "both lost" in local_restore.plan(inv, 6, "u", 3)


def test_a_lost_partner_copy_is_refused_with_the_reason():
    # rank 2's partner copy is kept by rank 0 (the ring's next member); rank 0's redundancy is gone
    inv = held([data(6, 0)], [data(6, 1), red(6, 1, SET, "partner")], [])
    why = local_restore.plan(inv, 6, "u", 3)
    assert why == "rank 2 is lost and its partner copy (kept by rank 0) is too"


def test_without_redundancy_a_lost_rank_cannot_be_restored():
    inv = held([data(6, 0)], [], [data(6, 2)])
    assert (
        local_restore.plan(inv, 6, "u", 3) == "rank 1's node-local copy is gone, without redundancy"
    )


def test_copies_of_another_save_never_mix():
    inv = held(
        [data(6, 0), red(6, 0, SET)], [data(6, 1, uid="other")], [data(6, 2), red(6, 2, SET)]
    )
    p = local_restore.plan(inv, 6, "u", 3)
    assert p.rebuild == [(1, "xor", SET)]
