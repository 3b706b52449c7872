# Two entry points, both self-contained on a fresh machine and idempotent:
#   make test    create .venv, build dpkernels (C++ always, CUDA whenever nvcc is found), run the suite
#   make bench   same set-up, then `dpkernels bench`
# On a GPU machine without a registry (no .venv there): make gpu-check (wheels from make gpu-wheels).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_SPEC ?= torch==2.14.1
SOURCES := $(shell find csrc -name '*.cpp' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh')
# Build flags, architectures, include folders and the toolkit root live in tools/build_config.py
# (standard library only, so any python3 runs it). The nvcc on PATH may be a wrapper script; the
# toolkit root is where the real driver lives.
CUDA_HOME ?= $(shell python3 tools/build_config.py --print cuda_home)
export CUDA_HOME
BENCH_ARGS ?=
# e.g. CMAKE_ARGS=-DDPK_BUILD_CUDA=ON for `make cmake`
CMAKE_ARGS ?=
# Tests run in up to 4 worker processes (pytest-xdist): the suite is mostly single-threaded
# interpreter work, so a 2-core machine runs it in about half the time.
PYTEST_ARGS ?= -n auto --maxprocesses 4 --durations=25

.PHONY: test bench install lint format static-check cmake clean gpu-check gpu-wheels

$(VENV)/.deps: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q numpy scipy ninja "opacus>=1.5" dp-accounting rich scikit-learn matplotlib mnist1d pytest pytest-xdist pytest-benchmark hypothesis ruff clang-format
	touch $@

$(VENV)/.built: $(VENV)/.deps setup.py $(SOURCES)
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.built

# Then the tests that reach the CPU kernels again on every lower CPU path this machine runs
# (DPKERNELS_CPU_CAPABILITY=avx2, default; the first run used the best one).
LOWER_CPU_PATHS = $(PY) -c 'from dpkernels import _backend; print(*_backend.runnable_cpu_capabilities()[1:])'

test: install
	$(PY) -m pytest $(PYTEST_ARGS)
	for cap in $$($(LOWER_CPU_PATHS)); do \
	  echo "== the CPU suite with DPKERNELS_CPU_CAPABILITY=$$cap"; \
	  DPKERNELS_CPU_CAPABILITY=$$cap $(PY) -m pytest $(PYTEST_ARGS) --cpu-kernels-only || exit 1; \
	done

bench: install
	$(VENV)/bin/dpkernels bench $(BENCH_ARGS)

static-check: install
	$(PY) tools/gpu_static_check.py

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(VENV)/.deps
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .
	$(VENV)/bin/clang-format -i $(SOURCES)

cmake: $(VENV)/.deps
	cmake -S . -B build/cmake -G Ninja -DPython3_EXECUTABLE=$(abspath $(PY)) \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch; print(torch.utils.cmake_prefix_path)')" $(CMAKE_ARGS)
	cmake --build build/cmake

# GPU machine, no registry: build against its python3's torch and run the suite and the bench on
# the GPU (tools/gpu_check.py; output in $OUT or gpu-check-out/). No .venv/.deps machinery.
gpu-check:
	python3 tools/gpu_check.py $(GPU_CHECK_ARGS)

# Here (registry): the Opacus/dp-accounting wheels to carry to the GPU machine (wheels/).
gpu-wheels:
	python3 tools/gpu_check.py download

clean:
	rm -rf build *.egg-info dpkernels/*.so
