"""Node-failure handling (hpcckpt/job/relaunch.py) without Slurm: spare-node planning,
attempts cut off with their node."""

from __future__ import annotations

from hpcckpt.job import relaunch


def test_spare_planning():
    assert relaunch.step_ranks(3, 3, 2) == 2
    assert relaunch.step_ranks(4, 3, 2) is None
    assert relaunch.choose_nodes(["n1", "n2", "n3"], ["n2"], 2) == ["n1", "n3"]
    assert relaunch.choose_nodes(["n1", "n3"], ["n3"], 2) is None
    cmd = relaunch.srun_command(["srun", "--mpi=pmix", "python", "a.py"], ["n1", "n3"], 2)
    assert cmd == ["srun", "--nodes=2", "--nodelist=n1,n3", "--ntasks=2", "--mpi=pmix",
                   "python", "a.py"]  # fmt: skip
    assert relaunch.placement_args(["-N", "2", "--nodelist=n1", "-wx", "-n", "2", "a.out"]) == [
        "-N 2",
        "--nodelist=n1",
        "-wx",
    ]
    # The program's own options are its own.
    assert relaunch.placement_args(["-n", "2", "a.out", "-N", "4", "-w", "x"]) == []
    assert relaunch.placement_args(["--ntasks", "2", "-N", "1", "a.out", "-x"]) == ["-N 1"]
    assert relaunch.is_srun(["/usr/bin/srun", "x"], {})
    assert not relaunch.is_srun(["mpirun", "x"], {})


def test_cut_off_attempt():
    log = [
        {"event": "wrapper_start", "attempt": "a", "nodes": "n[1-2]", "time": 1.0},
        {"event": "checkpoint", "attempt": "a", "time": 2.0},
        {"event": "wrapper_start", "attempt": "b", "time": 9.0},
    ]
    assert relaunch.cut_off_attempt(log, "b")["attempt"] == "a"
    log.insert(2, {"event": "step_end", "attempt": "a", "time": 3.0})
    assert relaunch.cut_off_attempt(log, "b") is None
