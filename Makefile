# Two commands set everything up on a fresh machine:
#   make train   create .venv, install litscale, train GPT-nano on the default config
#   make test    install the dev extras and run the test suite (all but the `full` set): the
#                in-process tests, the 2-rank parity table, the combination sample, the refusals
#   make test-full  the `full` set: the end-to-end runs, parity at 4 and 8 ranks (CI runs it too)
#   make test-soak  the `soak` set: the longest end-to-end runs (CI runs a fifth; run it whole before a release)
#   make test-soak-slice  one fifth of it, by time (the commit count's slice, as .ci/run runs it)
#   make image      the Docker image cluster jobs run (make image-cuda: its CUDA variant)
#   make durations  the slowest tests and the seconds per file of the last make test / test-full
#   make mutants    plant each defect of tests/mutants/catalog.py and run the tests that must catch it
#                   (the table in tests/README.md; ARGS="--only <name>" for some)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: train test test-full test-soak test-soak-slice soak-seconds durations mutants install install-dev lint clean image image-cuda

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs the pinned set in about 10 s where pip took 75 (2 cores, wheels cached; a fresh
# clone, as CI's, pays it every time). uv reads no pip.conf, so the PIP_* variables a machine
# sets for pip are handed on; INSTALLER=pip installs with pip instead.
INSTALLER ?= uv
$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install --quiet -c constraints.txt uv
ifdef PIP_FIND_LINKS
export UV_FIND_LINKS ?= $(PIP_FIND_LINKS)
endif
ifdef PIP_INDEX_URL
export UV_INDEX_URL ?= $(PIP_INDEX_URL)
endif
ifdef PIP_EXTRA_INDEX_URL
export UV_EXTRA_INDEX_URL ?= $(PIP_EXTRA_INDEX_URL)
endif

# Stamps keep re-runs fast: the installer runs again only when pyproject.toml or constraints.txt
# changes. constraints.txt: the versions of a working install, so nothing is resolved anew on a
# fresh machine (an index listing a release before its wheels broke set-up once: regex's sdist).
ifeq ($(INSTALLER),pip)
INSTALLER_BIN := $(BIN)/python
PIP_INSTALL := $(BIN)/pip install --quiet -c constraints.txt
else
INSTALLER_BIN := $(BIN)/uv
PIP_INSTALL := $(BIN)/uv pip install --python $(BIN)/python --quiet -c constraints.txt
endif

$(VENV)/.installed: pyproject.toml constraints.txt | $(INSTALLER_BIN)
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml constraints.txt | $(INSTALLER_BIN)
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

train: install
	$(BIN)/python train.py $(ARGS)

# Each writes its JUnit XML (every test's seconds) under outputs/tests/ for `make durations`.
TIMES := outputs/tests

test: install-dev
	$(BIN)/python -m pytest -m "not full and not soak" --junitxml=$(TIMES)/make-test.xml $(PYTEST_ARGS)

test-full: install-dev
	$(BIN)/python -m pytest -m "full and not soak" --junitxml=$(TIMES)/make-test-full.xml $(PYTEST_ARGS)

test-soak: install-dev
	$(BIN)/python -m pytest -m soak --junitxml=$(TIMES)/make-test-soak.xml $(PYTEST_ARGS)

# One fifth of the soak set, by time (tests/helpers/soak_slices.py): the commit count's slice, as
# .ci/run runs it, so that any 5 consecutive commits run every soak test; SOAK_SLICE=k for another.
SOAK_SLICE ?= $(shell $(PYTHON) tests/helpers/soak_slices.py)
test-soak-slice: install-dev
	$(BIN)/python -m pytest -m soak --soak-slice=$(SOAK_SLICE)/5 --junitxml=$(TIMES)/make-test-soak-slice.xml $(PYTEST_ARGS)

# The seconds the slices are cut by, from the last whole `make test-soak`.
soak-seconds:
	$(BIN)/python tests/durations.py $(TIMES)/make-test-soak.xml --soak-seconds tests/soak_seconds.json --top 10

durations:
	$(BIN)/python tests/durations.py $(wildcard $(TIMES)/*.xml) $(ARGS)

mutants: install-dev
	$(BIN)/python tests/mutants/run.py $(ARGS)

# The image the Kubernetes manifests run by default (docker/Dockerfile; hydra/launcher=k8s names
# litscale:<version>-cpu for trainer.accelerator=cpu, else -cuda).
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
TORCH_WHEELS := https://download.pytorch.org/whl

image:
	docker build -f docker/Dockerfile --build-arg TORCH_INDEX=$(TORCH_WHEELS)/cpu -t litscale:$(VERSION)-cpu .

image-cuda:
	docker build -f docker/Dockerfile --build-arg TORCH_INDEX=$(TORCH_WHEELS)/cu128 -t litscale:$(VERSION)-cuda .

lint: install-dev
	$(BIN)/ruff check src tests train.py

clean:
	rm -rf $(VENV) outputs .pytest_cache
