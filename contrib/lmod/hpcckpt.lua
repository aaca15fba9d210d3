-- Lmod module file for hpcckpt (an example: copy it and change the lines marked CHANGE).
--
-- Where to put it: in a directory on your site's MODULEPATH, named by the version,
--     /opt/apps/modulefiles/hpcckpt/0.1.0.lua       (site-wide; any directory on MODULEPATH)
--     ~/modulefiles/hpcckpt/0.1.0.lua               (for yourself: `module use ~/modulefiles`)
-- Users then run `module load openmpi hpcckpt`. How a site builds the venv it points at:
-- docs/site-install.md.
--
-- It only prepends the venv's bin to PATH: `hpcckpt` and that venv's `python` (with hpcckpt,
-- mpi4py, h5py, numpy) come first. It sets no other variable, no PYTHONPATH, no LD paths.

help([[
hpcckpt: coordinated checkpoint/restart for MPI jobs on Slurm.
Puts `hpcckpt` and a Python with hpcckpt, mpi4py and h5py first on PATH.
Load the MPI that mpi4py was installed with first (e.g. `module load openmpi`).
  hpcckpt --help          the commands (srun, run, submit, ls, verify, report, ...)
  hpcckpt submit --help   render and submit a requeueing batch script
]])

whatis("Name: hpcckpt")
whatis("Description: coordinated checkpoint/restart for MPI jobs on Slurm")

-- CHANGE: the venv hpcckpt was installed into (python -m venv ROOT; ROOT/bin/pip install ...).
local root = "/opt/apps/hpcckpt/0.1.0"

-- CHANGE (optional): the MPI module mpi4py was installed with, loaded along with this one.
-- depends_on("openmpi")

prepend_path("PATH", pathJoin(root, "bin"))
