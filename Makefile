# The README's two commands: `make test` and `make bench`. Each creates or reuses .venv,
# installs the pinned dependencies, builds the native modules fastckpt._C and fastckpt._reentrant
# in place (ninja: only changed files recompile), then runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
export CUDA_HOME ?= $(if $(wildcard /usr/local/cuda/bin/nvcc),/usr/local/cuda,)
# Without a GPU to run them, the CUDA kernels are not compiled here (minutes on 2 cores); CI sets
# FASTCKPT_CUDA=1 so that a CUDA compile error still fails it. Set FASTCKPT_CUDA yourself to choose.
export FASTCKPT_CUDA ?= $(if $(shell nvidia-smi -L 2>/dev/null),,0)

.PHONY: test bench build info lint clean

$(VENV)/.deps: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade-strategy only-if-needed -r requirements.txt
	touch $@

build: $(VENV)/.deps
	$(PY) setup.py --quiet build_ext --inplace

# Tests in TEST_WORKERS processes (pytest-xdist): most tests are small models whose time is Python's, which a
# second process overlaps on a 2-core machine (tests/conftest.py gives each worker its share of the cores as torch
# threads); TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

test: build
	$(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

bench: build
	$(PY) -m benchmarks

info: build
	$(PY) -m fastckpt.info

lint: $(VENV)/.deps
	$(VENV)/bin/ruff check .

clean:
	rm -rf build fastckpt/*.so *.egg-info
