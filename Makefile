# datacache: `make test` and `make demo` work on a fresh machine with Python >= 3.10 and make.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
URL ?=

.PHONY: test demo venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

PYTEST_JOBS ?= 2

test: venv
	$(PY) -m pytest -n $(PYTEST_JOBS) --dist loadfile $(PYTEST_ARGS)

demo: venv
	$(PY) tools/demo.py $(if $(URL),--url $(URL),)

clean:
	rm -rf $(VENV) build *.egg-info
