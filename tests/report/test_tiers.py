"""Where each restore came from, in the report (no Slurm: events in, rows and lines out)."""

from __future__ import annotations

from hpcckpt.report import analyze, format_report
from hpcckpt.report import tiers as report_tiers


def ev(t, kind, **fields):
    return {"time": t, "event": kind, "source": "checkpointer", **fields}


EVENTS = [
    ev(100.0, "start"),
    ev(101.0, "restore", step=None),
    ev(110.0, "checkpoint", step=9, seconds=0.1, bytes=10, tier="cache"),
    ev(120.0, "start"),
    ev(121.0, "restore", step=9, tier="cache", rebuilt=[1], rebuilt_from="xor", moved=[2]),
    ev(130.0, "start"),
    ev(
        131.0,
        "local_skipped",
        step=19,
        reason="ranks 1 and 2 of one XOR set ([0, 1, 2]) are both lost",
    ),
    ev(
        131.5,
        "local_set_aside",
        step=19,
        node="n3",
        file="ckpt-0000000019.rank2.red.json",
        reason="rank 2: parity file ckpt-0000000019.rank2.xor does not match its checksum",
    ),
    ev(132.0, "restore", step=9, tier="directory"),
]


def test_each_restore_of_a_checkpoint_with_its_tier_and_the_skipped_ones():
    rows = report_tiers.analyze_restores(EVENTS, 100.0)
    assert [(r["time"], r["step"], r["tier"], r["rebuilt"]) for r in rows] == [
        (21.0, 9, "cache (rebuilt from xor)", [1]),
        (32.0, 9, "directory", []),
    ]
    assert rows[1]["local_skipped"] == [
        {"step": 19, "reason": "ranks 1 and 2 of one XOR set ([0, 1, 2]) are both lost"}
    ]


def test_the_report_lists_them():
    report = analyze(EVENTS)
    assert [r["tier"] for r in report["restores"]] == ["cache (rebuilt from xor)", "directory"]
    assert "local_skipped" not in report["unknown_events"]
    text = format_report(report)
    assert "step 9 from the cache (rebuilt from xor), rank(s) 1 rebuilt" in text
    assert "node-local step 19 not used: ranks 1 and 2 of one XOR set" in text
    assert "local_set_aside" not in report["unknown_events"]
    assert "set aside ckpt-0000000019.rank2.red.json on n3: rank 2: parity file" in text


def test_a_plain_node_local_restore_is_the_cache():
    assert report_tiers.tier_label({"tier": "cache", "rebuilt": []}) == "cache"
    assert report_tiers.tier_label({}) == "directory"
