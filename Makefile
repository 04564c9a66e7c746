# The two README commands. Each one does its own set-up: a .venv, the install, the model.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test test-all bench venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip

# torch first, pinned: the CPU wheel of 2.13.0 is on local disk; anything else is a CUDA download.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(BIN)/shoal demo

# two pytest-xdist workers: most tests wait on processes and sockets part of the time, and
# two share 2 cores well (15 -> 9 minutes); each worker has a Redis database of its own
test: venv
	$(BIN)/python -m pytest -q -n 2 --durations=25

# also the `extended` tests (other modes and layouts of what `make test` covers)
test-all: venv
	$(BIN)/python -m pytest -q -n 2 -m ""

bench: venv
	$(BIN)/shoal bench throughput

clean:
	rm -rf $(VENV) build *.egg-info
