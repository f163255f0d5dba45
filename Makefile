# Every target does its own set-up: a fresh clone needs only python3 (>= 3.11).
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
export PATH := $(abspath $(VENV))/bin:$(PATH)
NP     ?= 4

.PHONY: venv venv-demo tools test test-unit test-mpi test-integration test-netns test-slurm lint demo bench bench-model clean

# The demo needs MPI and the model's fits; the tests also torch and the frameworks'
# drills (gigabytes on a cold cache: README.md has the times), added to the same venv.
$(DEMO_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpi,model]'
	touch $@

$(STAMP): $(DEMO_STAMP)
	$(PY) -m pip install -q -e '.[mpi,model,test,torch,frameworks]'
	touch $@

venv-demo: $(DEMO_STAMP)

venv: $(STAMP)

lint: venv
	$(PY) -m ruff check cachex_agent tests examples benchmarks

# shellcheck for tests/sites (Debian's package): installed as root when missing.
tools:
	@if ! command -v shellcheck >/dev/null && [ "$$(id -u)" = 0 ]; then \
		echo "installing shellcheck"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck </dev/null >/dev/null 2>&1 \
		|| { apt-get update -q </dev/null >/dev/null && \
		     DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck </dev/null >/dev/null; }; \
	fi

# tests/sites: the job templates under a fake site of each kind, and shellcheck.
test-unit: venv tools
	$(PY) -m pytest -q tests/unit tests/sites

# One pytest per rank; pytest-timeout bounds each test, timeout(1) bounds the whole run.
test-mpi: venv
	timeout 600 mpiexec -n $(NP) $(PY) -m pytest -q -p no:cacheprovider --with-mpi tests/mpi
	MPIR_CVAR_NOLOCAL=1 timeout 600 mpiexec -n $(NP) $(PY) -m pytest -q -p no:cacheprovider --with-mpi tests/mpi

test-integration: venv
	$(PY) -m pytest -q tests/integration

# Virtual nodes in namespaces of their own (root: CI); not root, one line says it is skipped.
test-netns: venv
	@if [ "$$(id -u)" = 0 ]; then \
		$(PY) -m pytest -q tests/netns; \
	else \
		echo "make test-netns: skipped: namespaces, veths and mounts need root; run 'sudo make test-netns'"; \
	fi

# The job templates through real sbatch/srun. As root, a one-host Slurm is set up first
# (scripts/ci/setup-slurm.sh: Debian's slurm-wlm and munge; at once when it is up).
# Not root and no Slurm: the tier is skipped with one line saying how to enable it.
test-slurm: venv
	@if [ "$$(id -u)" = 0 ]; then bash scripts/ci/setup-slurm.sh </dev/null; fi
	@if [ "$$(id -u)" = 0 ] || command -v sbatch >/dev/null; then \
		$(PY) -m pytest -q tests/slurm; \
	else \
		echo "make test-slurm: skipped: no Slurm on this machine and not root; run 'sudo bash scripts/ci/setup-slurm.sh' (a one-host Slurm) or 'sudo make test-slurm'"; \
	fi

test: lint test-unit test-mpi test-integration test-netns test-slurm

demo: venv-demo
	$(VENV)/bin/cachex demo --workdir demo-run

bench: venv
	$(PY) benchmarks/flush.py

# The durability model's figures (docs/model.md), JSON into $(BENCH_OUT): prediction MAPE
# and calibration idle and with $(LOAD) CPU-burning processes beside it, and the CoV of
# the trainer's checkpoint writes under the mild and the heavy-tail contention scenarios,
# and `model plan`'s lost work against failures replayed on real runs per write path.
# Needs root: the PFS is a loop-device ext4 with a cgroup v1 blkio write throttle
# (benchmarks/contention.py). BENCH_FLAGS=--quick makes cov.py a few-minute run.
BENCH_OUT ?= bench-model
LOAD ?= 2
PREDICT_FLAGS ?= --sizes 16MiB,48MiB --nodes 2,4 --count 8 --scenarios quiet
EXTRAPOLATE_FLAGS ?= --sizes 16MiB,48MiB,96MiB --nodes 2,4,8,16 --count 10 --scenarios quiet --pfs-size 8GiB
LOSTWORK_FLAGS ?= --blocks 3
bench-model: venv
	@if [ "$$(id -u)" != 0 ]; then echo "make bench-model: needs root (loop device, mount, cgroup blkio)"; exit 2; fi
	mkdir -p $(BENCH_OUT)
	$(PY) benchmarks/predict.py $(PREDICT_FLAGS) --json $(BENCH_OUT)/predict-idle.json
	$(PY) benchmarks/predict.py $(PREDICT_FLAGS) --load $(LOAD) --json $(BENCH_OUT)/predict-loaded.json
	$(PY) benchmarks/cov.py --scenarios mild,heavy $(BENCH_FLAGS) --json $(BENCH_OUT)/cov.json
	$(PY) benchmarks/predict.py $(EXTRAPOLATE_FLAGS) --fit-nodes 2,4 --keep $(BENCH_OUT)/events --json $(BENCH_OUT)/predict-nodes.json
	$(PY) benchmarks/predict.py --from-events $(BENCH_OUT)/events --fit-sizes 16MiB,48MiB --json $(BENCH_OUT)/predict-sizes.json
	$(PY) benchmarks/lostwork.py $(LOSTWORK_FLAGS) --json $(BENCH_OUT)/lostwork.json

clean:
	rm -rf $(VENV) demo-run bench-model
