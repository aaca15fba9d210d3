"""A tiny run of the benchmark harness (a few MiB) so that it cannot rot unnoticed.

Numbers are not checked (a 2 MiB run says nothing about speed): only that every
script runs under mpirun end to end and writes the JSON the docs are built from.
The page cache is left alone (--no-drop-caches): other tests run at the same time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpi_helpers import ROOT, mpi_env, mpirun

BENCH = ROOT / "benchmarks"
pytestmark = pytest.mark.mpi


def _run(argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *argv], env=mpi_env(), capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_run_py_writes_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = _run(
        [
            str(BENCH / "run.py"),
            "--sizes",
            "2M",
            "--reps",
            "1",
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "scratch"),
            "--no-torch",
            "--no-drop-caches",
        ]
    )
    assert "x limit" in proc.stdout and "Goals:" in proc.stdout
    doc = json.loads(out.read_text())
    rows = {(r["io"], r["method"]): r for r in doc["summary"]["rows"]}
    for method in ("limit_write", "limit_read", "dd", "hpcckpt_save", "hpcckpt_restore"):
        assert rows[("ompio", method)]["seconds_median"] > 0, method
    for method in ("gather_npsave", "fpr_npsave", "h5py_collective"):
        assert "hpcckpt_speedup" in rows[("ompio", method)], method
    for method in ("hpcckpt_save", "h5py_collective"):
        assert rows[("romio321", method)]["seconds_median"] > 0, method
    torch_row = rows[("ompio", "torch_dcp")]
    assert "seconds_median" in torch_row or torch_row["notes"], torch_row
    assert {c["method"] for c in doc["summary"]["io_comparison"]} >= {"hpcckpt_save"}
    assert doc["machine"]["cores"] >= 1
    assert not (tmp_path / "scratch").exists(), "the scratch directory is left behind"


def test_bench_due_reports_microseconds(tmp_path: Path) -> None:
    out = tmp_path / "due.json"
    proc = mpirun(2, [str(BENCH / "bench_due.py"), "--calls", "300", "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["results"]) >= {"bare Iallreduce+Wait", "every_steps=10**9"}
    for name, r in doc["results"].items():
        assert r["median_us"] > 0, name
        assert not r.get("fired"), f"due() fired in {name}"


def test_bench_backends_measures_due_save_and_restore_over_mpi_and_gloo(tmp_path: Path) -> None:
    out = tmp_path / "backends.json"
    argv = [str(BENCH / "bench_backends.py"), "--size", "2M", "--reps", "1", "--rounds", "1",
            "--calls", "200", "--no-drop-caches", "--dir", str(tmp_path / "scratch"),
            "--json", str(out)]  # fmt: skip
    proc = _run(argv)
    assert "torch / mpi (medians)" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["summary"]
    assert rows["mpi"]["floor"] == "bare Iallreduce+Wait"
    assert rows["torch"]["floor"] == "bare all_reduce(async)+wait"
    for row in rows.values():
        assert row["due_us"]["median"] > 0 and row["save_s"]["median"] > 0, row
        assert row["restore_s"]["median"] > 0 and row["bytes_per_rank"] == 2 << 20, row


def test_bench_phases_times_every_step_of_a_save_and_a_restore(tmp_path: Path) -> None:
    out = tmp_path / "phases.json"
    argv = [str(BENCH / "bench_phases.py"), "--size", "8M", "--reps", "2", "--no-drop-caches"]
    proc = mpirun(2, [*argv, "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "save x best raw" in proc.stdout and "restore x cold read" in proc.stdout
    ranks = json.loads(out.read_text())["ranks"]
    assert len(ranks) == 2
    for rank, phases in enumerate(ranks):
        for op, step in (("save", "write + fsync (3b)"), ("restore", "read + hash the data")):
            for rep in phases[op]:
                assert rep["ms"][step] > 0 and rep["ms"]["total"] >= rep["ms"][step], (rank, op)
        assert all(r["limit_write"] > 0 and r["limit_read"] > 0 for r in phases["raw"])
    assert ranks[0]["save"][0]["n"]["create the file (rank 0)"] == 1
    assert "create the file (rank 0)" not in ranks[1]["save"][0]["n"]


def test_writer_experiments_run(tmp_path: Path) -> None:
    out = tmp_path / "exp.json"
    _run(
        [
            str(BENCH / "experiments" / "run_experiments.py"),
            "--sizes",
            "1M",
            "--reps",
            "1",
            "--io",
            "ompio",
            "--variants",
            "hpcckpt (base)|collective|align 1M",
            "--no-drop-caches",
            "--dir",
            str(tmp_path / "scratch"),
            "--json",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())["rows"]
    names = {r["variant"] for r in rows}
    assert names == {"limit", "raw shared", "hpcckpt (base)", "collective", "align 1M"}
    assert all(r["ratio_to_limit"]["median"] > 0 for r in rows)


def test_bench_async_reports_blocked_time(tmp_path: Path) -> None:
    out = tmp_path / "async.json"
    proc = _run(
        [
            str(BENCH / "bench_async.py"),
            "--sizes",
            "4M",
            "--reps",
            "1",
            "--kernel-mib",
            "4",
            "--kernel-seconds",
            "0.05",
            "--no-drop-caches",
            "--dir",
            str(tmp_path / "scratch"),
            "--cache-root",
            str(tmp_path / "cache"),
            "--json",
            str(out),
        ]
    )
    assert "x memcpy" in proc.stdout and "slowdown" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["nranks"] == 2 and doc["reps"] == 1
    (row,) = doc["rows"]
    assert row["bytes_per_rank"] == 4 << 20
    for key in (
        "memcpy",
        "hash",
        "sync_blocked",
        "async_blocked",
        "async_durable",
        "cache_blocked",
        "cache_durable",
        "async_kernel_alone",
        "async_kernel",
        "cache_kernel_alone",
        "cache_kernel",
        "async_part_stage",
        "cache_part_stage",
    ):
        assert row["seconds"][key] > 0, key
    for key in (
        "sync_x_memcpy",
        "async_blocked_x_memcpy",
        "async_blocked_x_sync",
        "cache_blocked_x_memcpy",
        "cache_blocked_x_sync",
    ):
        assert row["ratios"][key] > 0, key
    assert set(row["slowdown"]) == {"async", "cache"}
    assert all(-1 < x < 100 for x in row["slowdown"].values()), row["slowdown"]
    memory = row["memory_per_rank"]
    assert memory["async_host_buffers"] == 4 << 20
    assert memory["cache_copy"] == 4 << 20
    assert memory["cache_host_buffers"] == 4 << 20, "a cache save goes through host memory"
    assert memory["async_staging_peak"] == 4 << 20  # one copy of the state, never more
    assert memory["staging_budget"] >= 4 << 20  # the budget the saves planned with
    assert memory["saves_measured"] >= 1 and memory["saves_over_budget"] == 0
    # the process grew by about the staging and the writer's bounce buffers, no more
    assert 0 <= memory["async_staging_rss_peak"] < (4 << 20) + (96 << 20), memory
    assert not (tmp_path / "scratch").exists(), "the scratch directory is left behind"
    assert not any((tmp_path / "cache").iterdir()), "the node-local copies are left behind"


def test_bench_mirror_measures_every_goal_of_the_second_tier(tmp_path: Path) -> None:
    out = tmp_path / "mirror.json"
    proc = _run(
        [
            str(BENCH / "bench_mirror.py"),
            "--size",
            "2M",
            "--reps",
            "1",
            "--saves",
            "2",
            "--gap",
            "0.1",
            "--etag-hash",
            "",
            "--skip",
            "slowdown,compression,index",
            "--methods",
            "boto3,mirror,copy,dir_mirror",
            "--dir",
            str(tmp_path / "work"),
            "--s3-dir",
            str(tmp_path / "store"),
            "--json",
            str(out),
        ]
    )
    assert "goals" in proc.stdout
    goals = json.loads(out.read_text())["goals"]
    assert len(goals) == 4 and all(g["value"] and g["value"] > 0 for g in goals), goals
    assert not list((tmp_path / "store").iterdir()), "the server's objects are removed"


def test_bench_torch_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "torch.json"
    argv = [
        str(BENCH / "bench_torch.py"),
        "--size",
        "1M",
        "--repeat",
        "1",
        "--root",
        str(tmp_path / "scratch"),
        "--no-drop-caches",
        "--json",
        str(out),
    ]
    proc = mpirun(2, argv, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {
        "hpcckpt_replicated",
        "hpcckpt_per_rank",
        "torch_save",
        "torch_dcp",
    }
    assert doc["summary"]["torch_save"]["save_vs_torch_save"] == 1.0


def test_bench_ranks_prints_the_curve(tmp_path: Path) -> None:
    out = tmp_path / "ranks.json"
    argv = [str(BENCH / "bench_ranks.py"), "--ranks", "2,3", "--kib", "64", "--reps", "1"]
    proc = _run([*argv, "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert "| 2 | ompio |" in proc.stdout and "| 3 | ompio |" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"2/ompio", "3/ompio"}
    assert all(r["save"] > 0 and r["restore"] > 0 for recs in results.values() for r in recs)
    assert all(r["floor_save"] > 0 and r["floor_load"] > 0 for rs in results.values() for r in rs)
    assert "| save / floor_save |" in proc.stdout, proc.stdout


def test_bench_hdf5_floor_compares_one_hdf5_file_with_one_npy_file(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    argv = [str(BENCH / "bench_hdf5_floor.py"), "--kib", "16", "--reps", "3"]
    proc = _run([*argv, "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert "| durable write |" in proc.stdout and "| read |" in proc.stdout, proc.stdout
    times = json.loads(out.read_text())["times"]
    assert set(times) == {"npy_save", "h5_save", "npy_load", "h5_load"}
    assert all(len(t) == 3 and min(t) > 0 for t in times.values())


def test_bench_collectives_prints_the_counts(tmp_path: Path) -> None:
    out = tmp_path / "counts.json"
    argv = [str(BENCH / "bench_collectives.py"), "--ranks", "2,3", "--kib", "64"]
    proc = _run([*argv, "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert "| save2 | 3 |" in proc.stdout and "| restore | 2 |" in proc.stdout, proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"2", "3"}
    for res in results.values():
        assert all(rank["save2"]["collectives"] > 0 for rank in res["mpi"])
        assert res["strace"]["0/save2"]["fsyncs"] >= 1


def test_bench_incremental_compares_kernel_tracking_and_hashing(tmp_path: Path) -> None:
    out = tmp_path / "incr.json"
    args = ["--mib", "4", "--repeat", "2", "--fractions", "0,0.25", "--block-size", "65536"]
    args += ["--detection", "kernel,hashes", "--dir", str(tmp_path / "d"), "--json", str(out)]
    proc = mpirun(2, [str(BENCH / "bench_incremental.py"), *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    dirty = doc["rows"][1]
    assert dirty["kernel"]["kind"] == "incremental" and dirty["kernel"]["pages_written"] > 0
    assert dirty["kernel"]["bytes_hashed"] < dirty["hashes"]["bytes_hashed"] == 4 << 20
    assert set(dirty["kernel"]["phases"]) >= {"hashes", "_write_data"}
    assert dirty["write_floor"] > 0 and doc["rows"][0]["write_floor"] > 0


def test_bench_arrays_prints_both_parts(tmp_path: Path) -> None:
    out = tmp_path / "arrays.json"
    argv = [str(BENCH / "bench_arrays.py"), "--arrays", "4,40", "--reps", "1", "--chain"]
    argv += ["--rank0", "3,50", "--rank0-arrays", "2"]
    proc = _run([*argv, "--dir", str(tmp_path / "scratch"), "--json", str(out)])
    assert "| 40 |" in proc.stdout and "| 50 | 2 |" in proc.stdout, proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc["results"]) == {"4", "40"}
    assert all(r["save"] > 0 and r["npz_load"] > 0 for rs in doc["results"].values() for r in rs)
    # 40 small arrays: every save a delta when told so, full under the default policy.
    (rec,) = doc["results"]["40"]
    assert rec["delta_kinds"] == ["incremental"] * 3 and rec["policy_kinds"] == ["full"] * 3
    assert "saves of 1 % changed" in proc.stdout, proc.stdout
    assert [(r["nranks"], r["narrays"]) for r in doc["rank0"]] == [(3, 2), (50, 2)]
    assert all(t > 0 for r in doc["rank0"] for t in r["seconds"].values())


def test_gpu_check_says_no_cuda_device_and_runs_its_flow_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "gpu_check.py")],
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # nothing checked
    assert json.loads(proc.stdout)["status"] == "no CUDA device: nothing checked"
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--size", "4M", "--repeat", "1", "--root", str(tmp_path / "s")]
    proc = mpirun(1, [str(BENCH / "gpu_check.py"), *argv, "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["status"] == "passed"
    assert set(doc["checks"]) == {"model_restore", "values_at_save", "cuda_rng", "blocked"}
    assert doc["checks"]["model_restore"]["tensors"] == 4 * 2 + 4 * 2 * 3
    assert all(v > 0 for v in doc["checks"]["blocked"]["median_seconds"].values())


def test_bench_fsdp_compares_hpcckpt_with_dcp_and_checks_every_restore(tmp_path: Path) -> None:
    out = tmp_path / "fsdp.json"
    argv = [str(BENCH / "bench_fsdp.py"), "--size", "2M", "--repeat", "1"]
    argv += ["--root", str(tmp_path / "scratch"), "--no-drop-caches", "--json", str(out)]
    _run([*argv, "--phases"], timeout=300)
    doc = json.loads(out.read_text())
    reads = {"main": "read + hash the data", "one": "general read (every rank opens)"}
    for phase in doc["phases"].values():  # each rank's phases of its one hpcckpt restore
        assert len(phase["restore_phases"]) == phase["ranks"] == len(phase["peak_rss_per_rank"])
        read = reads.get(phase["phase"], reads["one"])
        for (timed,) in phase["restore_phases"]:
            assert timed["ms"]["total"] >= timed["ms"]["the store's restore"] > 0
            assert timed["ms"][read] > 0
    assert [r["op"] for r in doc["summary"]] == [
        "save",
        "restore",
        "async_blocked",
        "restore",
        "restore",
    ]
    assert [p["ranks"] for p in doc["phases"].values()] == [2, 1, 2]
    checks = {(ph, k): ok for ph, p in doc["phases"].items() for k, ok in p["checks"].items()}
    assert len(checks) == 6 and all(checks.values()), checks


def test_bench_fsdp_leaves_nothing_behind_when_stopped_or_short_of_disk(tmp_path: Path) -> None:
    """SIGTERM while it runs, or too little disk for --size: the scratch is removed."""
    import os
    import signal
    import time

    scratch = tmp_path / "scratch"
    argv = [sys.executable, str(BENCH / "bench_fsdp.py"), "--root", str(scratch)]
    short = subprocess.run(
        [*argv, "--size", "1T"], env=mpi_env(), capture_output=True, text=True, timeout=60
    )
    assert short.returncode != 0 and "needs about 10240.0 GiB" in short.stderr, short.stderr
    assert not (scratch / "fsdp").exists()
    proc = subprocess.Popen(
        [
            *argv,
            "--size",
            "2M",
            "--repeat",
            "200",
            "--no-drop-caches",
            "--json",
            str(tmp_path / "j"),
        ],
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120

    def started() -> bool:  # its checkpointers' directories: a run under way (a file of
        return any((scratch / "fsdp").glob("hpcckpt*"))  # theirs lives for milliseconds)

    while not started() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    assert started(), "the bench did not start its saves in 120 s"
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "stopped by signal" in err, err[-3000:]
    assert not (scratch / "fsdp").exists() and not (tmp_path / "j").exists()
    left = [p for p in Path("/proc").glob("[0-9]*") if str(scratch).encode() in _cmdline(p)]
    assert not left, "the ranks outlived the bench"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:  # it ended meanwhile
        return b""


def test_gpu_fsdp_check_says_no_cuda_device_and_resumes_exactly_on_the_cpu(
    tmp_path: Path,
) -> None:
    script = str(BENCH / "gpu_fsdp_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout)["status"] == "no CUDA device: nothing checked"
    out = tmp_path / "fsdp.json"
    argv = ["--device", "cpu", "--steps", "12", "--stop", "5", "--root", str(tmp_path / "s")]
    proc = subprocess.run(
        [sys.executable, script, *argv, "--json", str(out)],
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["status"] == "passed" and doc["restored"] == 5
    assert doc["losses_equal"] and doc["params_equal"] and doc["moments_equal"]


def test_gpu_delta_check_says_no_cuda_device_and_runs_its_flow_on_the_cpu(tmp_path: Path) -> None:
    script = str(BENCH / "gpu_delta_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(proc.stdout)["status"] == "no CUDA device: nothing checked"
    out = tmp_path / "delta.json"
    argv = ["--device", "cpu", "--width", "256", "--repeat", "2", "--root", str(tmp_path / "s")]
    proc = subprocess.run(
        [sys.executable, script, *argv, "--json", str(out)],
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["status"] == "passed" and list(doc["phases"]) == ["1%", "100%"]
    for phase in doc["phases"].values():
        assert phase["restored_bit_identical"] == {"device": True, "hashes": True}
        assert phase["dirty_blocks_agree"]
    one, full = doc["phases"]["1%"]["summary"], doc["phases"]["100%"]["summary"]
    assert one["device"]["copied_fraction"] < 0.5 and one["hashes"]["copied_fraction"] == 1.0
    assert full["device"]["copied_fraction"] == 1.0


def test_the_save_against_its_copy_experiment_runs(tmp_path: Path) -> None:
    """benchmarks/experiments/save_vs_copy.py, with wait(), as a loop (--compute), and
    into a node-local cache (whose directory it removes at the end)."""
    script = str(BENCH / "experiments" / "save_vs_copy.py")
    cache = tmp_path / "cache"
    for extra in ([], ["--compute", "0.3", "--keep-last", "1"], ["--cache", str(cache)]):
        argv = [script, "--mib", "1", "--reps", "2", "--dir", str(tmp_path / "d")]
        proc = mpirun(2, [*argv, "--no-drop-caches", *extra], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "1 MiB per rank, 2 ranks, median of 2: save / copy before" in proc.stdout
        assert proc.stdout.count("its copy") == 3, proc.stdout  # 2 repetitions, the median
    assert not cache.exists()
