# hpcckpt developer and user entry points. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup test test-fast lint demo bench bench-async bench-torch clean cluster-up cluster-down

setup:  ## install Debian packages, the venv with parallel h5py, and hpcckpt (idempotent)
	bash scripts/setup.sh

lint: setup
	$(PY) -m ruff check hpcckpt tests examples benchmarks scripts
	$(PY) -m ruff format --check hpcckpt tests examples benchmarks scripts

# Workers of `make test`: two run the tests that submit no Slurm jobs, in two lanes, each
# in order; the others run the Slurm end-to-end tests side by side, each on local clusters
# of its own (tests/conftest.py). TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 6

test: setup lint  ## the whole suite: unit, MPI (mpirun -n 2/3) and Slurm (local cluster) tests
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

test-fast: setup  ## only the tests that need neither MPI nor Slurm
	$(PY) -m pytest -m "not mpi and not slurm and not slow" $(PYTEST_ARGS)

demo: setup  ## local Slurm cluster + heat2d job: signalled, checkpointed, requeued, resumed
	$(PY) scripts/demo.py

bench: setup
	$(PY) benchmarks/run.py

bench-torch: setup  ## model + AdamW (~0.5 GiB per rank): hpcckpt vs torch.save and DCP (~3 min)
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n 2 --oversubscribe $(PY) benchmarks/bench_torch.py

bench-async: setup  ## blocked time of async_save / cache saves vs a direct save (~3 min)
	$(PY) benchmarks/bench_async.py

cluster-up: setup
	$(VENV)/bin/hpcckpt cluster up

cluster-down:
	$(VENV)/bin/hpcckpt cluster down

clean:
	rm -rf build dist *.egg-info .pytest_cache
