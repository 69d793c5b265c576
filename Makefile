# Two commands set everything up on a fresh machine:
#   make train   create .venv, install litscale, train GPT-nano on the default config
#   make test    install the dev extras and run the test suite (all but the `full` set)
#   make test-full  the `full` set: parity at 4 and 8 ranks (long on 2 cores; CI runs it too)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train test test-full install install-dev lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Stamps keep re-runs fast: pip runs again only when pyproject.toml changes.
# --only-binary=regex: the index can list a new regex (needed by transformers) before its
# wheels arrive, and its sdist does not build here; pip then takes the newest with a wheel.
PIP_INSTALL := $(BIN)/pip install --quiet --only-binary=regex

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

train: install
	$(BIN)/python train.py $(ARGS)

test: install-dev
	$(BIN)/python -m pytest -m "not full" $(PYTEST_ARGS)

test-full: install-dev
	$(BIN)/python -m pytest -m full $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check src tests train.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
