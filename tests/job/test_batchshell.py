"""hpcckpt.job.batchshell: is the wrapper the batch shell; the script's --signal."""

import os

from hpcckpt.job import batchshell


def test_script_signal(tmp_path):
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH --time=2\n#SBATCH --signal=B:USR1@90 --requeue\nsrun x\n"
    )
    assert batchshell.script_signal(str(script)) == ("USR1", 90)
    script.write_text("#!/bin/bash\n#SBATCH --signal=USR2\n")
    assert batchshell.script_signal(str(script)) == ("USR2", 60)  # Slurm's default lead
    script.write_text("#!/bin/bash\necho hi\n#SBATCH --signal=B:USR1@90\n")  # after a command
    assert batchshell.script_signal(str(script)) == (None, None)
    assert batchshell.script_signal(str(tmp_path / "missing")) == (None, None)


def test_not_a_batch_step():
    assert batchshell.check({}, os.getpid()) is None
    assert batchshell.check({"SLURM_JOB_ID": "3", "SLURM_STEP_ID": "0"}, os.getpid()) is None
    # inside "a job" but without slurmstepd among the ancestors (salloc, tests): no verdict
    assert batchshell.check({"SLURM_JOB_ID": "3"}, os.getpid()) is None


def test_ancestors_of_this_process():
    chain = batchshell.ancestors(os.getpid())
    assert chain and chain[0][0] == os.getppid()
