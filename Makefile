# The two commands of the README: `make run` and `make test`. Each creates .venv when it
# is missing and installs the project into it, so a fresh machine needs nothing else.
# `make run` installs the server only; `make test` adds the extras: audit (Spark and
# Arrow, ~700 MB) and dev (the test and lint tools).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SERVER_STAMP := $(VENV)/.installed-server
ALL_STAMP := $(VENV)/.installed-all
DATA ?= ./data

export PYSPARK_PYTHON := $(abspath $(BIN)/python)
export SPARK_LOCAL_IP := 127.0.0.1

.PHONY: run test lint format bench clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "delayd needs Python >= 3.11; set PYTHON=python3.11 (or newer)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(SERVER_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	touch $(SERVER_STAMP)

# Everything includes the server: its stamp is refreshed too.
$(ALL_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[audit,dev]'
	touch $(ALL_STAMP) $(SERVER_STAMP)

run: $(SERVER_STAMP)
	$(BIN)/delayd serve --data $(DATA)

# Two workers, whole files each (--dist loadfile): most tests wait on real processes,
# sockets and fsyncs, so two halve the wall time on a 2-core machine, and a module's
# fixtures (one SparkSession per audit module) stay in one worker. The modules are
# handed out in the order tests/conftest.py sorts them (the longest first), not
# xdist's (the most tests first), so that both workers finish together.
test: $(ALL_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder

format: $(ALL_STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(SERVER_STAMP)
	$(BIN)/python tools/bench_storage.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
