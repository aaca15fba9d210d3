import json

import pytest
from click.testing import CliRunner

from hpcckpt.cli.interval import COMMANDS, interval, simulate

YEAR = 365.25 * 86400


def run(command, *args):
    result = CliRunner().invoke(command, list(args))
    return result


def test_commands_are_registered():
    assert [c.name for c in COMMANDS] == ["interval", "simulate"]


def test_interval_text():
    result = run(interval, "--mtbf", "12h", "--cost", "5m")
    assert result.exit_code == 0, result.output
    assert "5091 s" in result.output and "(1.41 h)" in result.output
    assert "4893 s" in result.output and "(1.36 h)" in result.output
    assert "88.67%" in result.output
    assert "job MTBF 12 h (43200 s)" in result.output


def test_interval_format():
    assert run(interval, "--mtbf", "12h", "--cost", "5m", "--format", "seconds").output == "4893\n"
    assert run(interval, "--mtbf", "12h", "--cost", "5m", "--format", "minutes").output == "82\n"
    assert run(interval, "--mtbf", "12h", "--cost", "5m", "--format", "hms").output == "01:21:33\n"
    young = run(
        interval, "--mtbf", "12h", "--cost", "5m", "--method", "young", "--format", "seconds"
    )
    assert young.output == "5091\n"


def test_interval_json():
    result = run(
        interval, "--mtbf", "43200", "--cost", "00:05:00", "--restart-cost", "2m", "--json"
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["mtbf"] == 43200.0 and doc["cost"] == 300.0 and doc["restart_cost"] == 120.0
    assert doc["young"]["interval"] == pytest.approx(5091.17, abs=0.01)
    assert doc["daly"]["interval"] == pytest.approx(4893.13, abs=0.01)
    assert doc["optimum"]["interval"] == pytest.approx(4893.16, abs=0.01)
    # the restart cost multiplies the segment time by exp(R/M)
    assert doc["daly"]["efficiency"] == pytest.approx(0.886732 * 0.997226, abs=1e-5)
    assert doc["daly"]["waste"] == pytest.approx(1 - doc["daly"]["efficiency"])


def test_interval_from_nodes():
    result = run(interval, "--nodes", "128", "--cost", "90s", "--json", "--method", "daly")
    doc = json.loads(result.output)
    assert doc["mtbf"] == pytest.approx(5 * YEAR / 128)
    assert doc["nodes"] == 128 and "young" not in doc
    result = run(interval, "--nodes", "10", "--node-mtbf", "1y", "--cost", "90s")
    assert "= node MTBF 1 y / 10 nodes" in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cost", "5m"], "--mtbf"),
        (["--mtbf", "12h", "--nodes", "4", "--cost", "5m"], "either --mtbf"),
        (["--mtbf", "12x", "--cost", "5m"], "invalid duration '12x'"),
        (["--mtbf", "12h", "--cost", "0"], "--cost"),
        (["--mtbf", "12h", "--cost", "5m", "--json", "--format", "hms"], "alternatives"),
    ],
)
def test_interval_errors(args, message):
    result = run(interval, *args)
    assert result.exit_code == 2
    assert message in result.output


def test_interval_notes_the_clamp():
    result = run(interval, "--nodes", "1", "--cost", "10m")
    assert "a Checkpointer would use 24 h" in result.output


def test_interval_help_teaches():
    text = run(interval, "--help").output
    assert "sqrt(2 x cost x MTBF)" in text and "--format seconds" in text


def test_simulate_text():
    result = run(
        simulate,
        *("--work", "48h", "--mtbf", "12h", "--cost", "5m", "--restart-cost", "2m"),
        *("--runs", "400", "--intervals", "6"),
    )
    assert result.exit_code == 0, result.output
    assert "<- Daly" in result.output and "<- Young" in result.output
    assert "Best simulated interval" in result.output
    assert "4893 s" in result.output


def test_simulate_json():
    result = run(
        simulate,
        *("--work", "48h", "--mtbf", "12h", "--cost", "5m", "--runs", "300"),
        *("--intervals", "5", "--min", "10m", "--max", "6h", "--seed", "3", "--json"),
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    intervals = [row["interval"] for row in doc["rows"]]
    assert intervals[0] == 600.0 and intervals[-1] == pytest.approx(21600.0)
    assert len(intervals) == 7  # five log-spaced plus Young's and Daly's
    assert doc["daly"]["interval"] == pytest.approx(4893.13, abs=0.01)
    best = max(doc["rows"], key=lambda row: row["efficiency"])
    assert doc["best"]["interval"] == best["interval"]
    assert 0.8 < doc["daly"]["efficiency"] < 0.95
    again = json.loads(run(simulate, *result_args(doc)).output)
    assert again["rows"] == doc["rows"]  # same seed, same numbers


def result_args(doc):
    return [
        *("--work", "48h", "--mtbf", "12h", "--cost", "5m", "--runs", "300"),
        *("--intervals", "5", "--min", "10m", "--max", "6h", "--seed", str(doc["seed"]), "--json"),
    ]


def test_simulate_bad_range():
    result = run(
        simulate, "--work", "1d", "--mtbf", "12h", "--cost", "5m", "--min", "6h", "--max", "1h"
    )
    assert result.exit_code == 2
    assert "min interval" in result.output


def test_simulate_plot(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "eff.png"
    result = run(
        simulate,
        *("--work", "24h", "--mtbf", "12h", "--cost", "5m", "--runs", "200", "--intervals", "5"),
        *("--plot", str(out)),
    )
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Plot written to {out}" in result.output


def test_simulate_two_levels_beats_a_single_level_on_the_same_failures():
    args = ["--work", "48h", "--mtbf", "6h", "--cost", "5m", "--local-cost", "20s"]
    result = run(simulate, *args, "--runs", "500", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    two, one = doc["strategies"]
    assert two["name"] == "two levels" and two["drain_every"] > 1
    assert one["drain_every"] == 1 and one["efficiency"] < two["efficiency"]
    text = run(simulate, *args, "--runs", "200").output
    assert "two levels" in text and "sooner than a single level" in text
