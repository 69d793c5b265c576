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
# --prefer-binary: a package index can list a new release before its wheels arrive;
# building such an sdist (regex, for one) fails on a machine without its build headers,
# so take the newest version that has a wheel.
PIP_INSTALL := $(BIN)/pip install --quiet --prefer-binary

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
