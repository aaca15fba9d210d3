#!/usr/bin/env bash
# Every prepared GPU check in one go, each under its own time limit, on one GPU node.
#
#     bash benchmarks/gpu_session.sh OUTDIR      (from the checkout's root; about 7 minutes)
#
# Writes into OUTDIR: gpu_check_256M.json, gpu_check_2G.json (+ profile_2G.txt, cProfile of
# its async saves), gpu_fsdp.json, gpu_staging.json, gpu_delta.json, env.txt and log.txt.
# A check that fails or runs out of time is named in log.txt; the others still run.
set -u
out=${1:?usage: gpu_session.sh OUTDIR}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
py=${PYTHON:-python3}
scratch=${SCRATCH:-/tmp/hpcckpt-gpu-session}
log="$out/log.txt"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    # the code that ran (a copy of the checkout may carry no .git, or a stale one)
    echo "hpcckpt source sha256 $(find hpcckpt -name '*.py' | sort | xargs cat | sha256sum | cut -c1-16)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "$py" -c 'import torch,h5py,mpi4py,numpy,xxhash;print("torch",torch.__version__,"h5py",h5py.__version__,"mpi",h5py.get_config().mpi,"mpi4py",mpi4py.__version__,"numpy",numpy.__version__,"xxhash",xxhash.VERSION)'
    nproc
    free -g | head -2
} >"$out/env.txt" 2>&1

step() {  # step NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s) $(date -u +%T)" >>"$log"
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    local rc=$?
    echo "== $name rc=$rc after $((SECONDS - t0))s" >>"$log"
    rm -rf "$scratch"
}

step gpu_check_256M 110 "$py" benchmarks/gpu_check.py --size 256M --repeat 5 \
    --root "$scratch" --json "$out/gpu_check_256M.json"
step gpu_check_2G 170 "$py" benchmarks/gpu_check.py --size 2G --repeat 3 \
    --root "$scratch" --json "$out/gpu_check_2G.json" --profile "$out/profile_2G.txt"
step gpu_fsdp 80 "$py" benchmarks/gpu_fsdp_check.py --root "$scratch" --json "$out/gpu_fsdp.json"
step gpu_staging 100 "$py" benchmarks/gpu_staging.py --sizes 256M,2G --repeat 3 \
    --json "$out/gpu_staging.json"
step gpu_delta 90 "$py" benchmarks/gpu_delta_check.py --repeat 3 --root "$scratch" \
    --json "$out/gpu_delta.json"
grep '^== .* rc=' "$log"
