# datacache: `make test` and `make demo` work on a fresh machine with Python >= 3.10 and make.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
URL ?=

.PHONY: test test-fast lint demo venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c tests/constraints.txt -e ".[dev,bench]"
	# MosaicML Streaming and LitData, which tests/test_foreign.py compares datacache's reading of their
	# datasets against, without their dependencies (torchvision would not import beside this torch; the
	# bench extra holds what they import): see tools/bench_systems.py
	$(PY) -m pip install -q --no-deps mosaicml-streaming==0.13.0 litdata==0.2.76
	touch $@

venv: $(VENV)/.installed

# 3 processes on 2 cores: most tests wait on the S3 server, the emulated link or real subprocesses, not on a
# core (quiet: 5.5 min with 3, 7 min with 2)
PYTEST_JOBS ?= 3

# The whole suite, lint first (CI runs this). --durations: the slowest tests, to keep the suite near 6 minutes.
test: venv lint
	$(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile --durations=15 $(PYTEST_ARGS)

# The fast tier for the edit-run loop: no S3 server, no process of a test's own (tests/helpers/tiers.py).
test-fast: venv
	DATACACHE_FAST_TIER=1 $(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile -m "not server and not subprocess" \
		--durations=10 $(PYTEST_ARGS)

lint: venv
	$(PY) -m ruff check .

demo: venv
	$(PY) tools/demo.py $(if $(URL),--url $(URL),)

clean:
	rm -rf $(VENV) build *.egg-info
