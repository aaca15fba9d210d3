"""hpcckpt.slurm.jobid: the unambiguous name of this job or array task."""

from hpcckpt.slurm import jobid


def test_plain_job():
    ident = jobid.identity({"SLURM_JOB_ID": "42"})
    assert ident.target == "42" and not ident.is_array_task
    assert ident.describe() == "job 42"


def test_array_task_is_named_with_its_index():
    # the first task's SLURM_JOB_ID equals the array's id: "12" alone names the whole array
    env = {"SLURM_JOB_ID": "12", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "0"}
    assert jobid.target(env) == "12_0"
    env = {"SLURM_JOB_ID": "14", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "2"}
    assert jobid.identity(env).describe() == "job 14 (array task 12_2)"


def test_outside_slurm_and_garbage():
    assert jobid.target({}) is None
    env = {"SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "x", "SLURM_ARRAY_TASK_ID": "1"}
    assert jobid.target(env) == "7"
