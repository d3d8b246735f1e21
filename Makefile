# The two commands of the README: `make demo` and `make test`. Both set the machine up first,
# into a virtual environment (VENV, .venv by default) that every target here runs in: its python,
# and its bin/ first on PATH (bcstack, pytest, lint-imports). BASE_PYTHON makes it (3.11 or newer).
VENV ?= .venv
BASE_PYTHON ?= python3
PYTHON := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)
export VIRTUAL_ENV := $(abspath $(VENV))
PYTEST_ARGS ?=
# PYTEST_WORKERS: pytest-xdist workers, a whole module each, slowest modules first
# (tests/conftest.py); 2 by default, for the 2-core machine CI runs on (docs/development.md: the
# measured times); 0 runs one process, in pytest's order.
PYTEST_WORKERS ?= 2
SPEEDRUN_ARGS ?=
IMAGES_ARGS ?=
INSTALL_INPUTS := pyproject.toml constraints.txt scripts/install.sh

.PHONY: help install install-test demo speedrun test lint proto dashboards images docs clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

# The stamps live in the environment, so a removed .venv installs again; each re-runs when the
# dependency list, the constraints or the install script change.
$(VENV)/.installed-demo: $(INSTALL_INPUTS)
	BASE_PYTHON=$(BASE_PYTHON) VENV=$(VENV) bash scripts/install.sh demo
	@touch $@

$(VENV)/.installed-test: $(INSTALL_INPUTS)
	BASE_PYTHON=$(BASE_PYTHON) VENV=$(VENV) bash scripts/install.sh test
	@touch $@ $(VENV)/.installed-demo

install: $(VENV)/.installed-demo  ## .venv with CPU torch, the package and its dev tools (idempotent)

install-test: $(VENV)/.installed-test  ## install, plus the Debian packages and tools the tests run

demo: install  ## the main job on embedded defaults
	$(PYTHON) -m bcstack.demo

# bench/speedrun.py runs bcstack.speedrun --final (the test split: the recipe is fixed on dev) with
# $(SPEEDRUN_ARGS), e.g. "--world-seed 1 --train-seed 2", and files its report in
# bench/results/speedrun-w{world}-t{training}-test.{md,json,png} and speedrun-summary.md; from a
# checkout with uncommitted changes it refuses unless SPEEDRUN_ARGS has --dirty-ok.
speedrun: install  ## the CPU learning proof: untrained -> SFT -> RL on held-out questions (~1 hour)
	$(PYTHON) bench/speedrun.py --final $(SPEEDRUN_ARGS)

# Bytecode for the checkout's packages first, once: where PYTHONDONTWRITEBYTECODE is set (as on the
# CI machines) every process of the suite would compile the modules it imports again.
test: install-test  ## the whole test suite
	$(PYTHON) -m compileall -qq -j 0 bcstack core services trainer devkit
	$(PYTHON) -m pytest $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS)

lint: install  ## ruff, and the layer contracts (import-linter, pyproject.toml)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	lint-imports

proto: install  ## regenerate the gRPC stubs in core/v1 from proto/
	$(PYTHON) -m bcstack.protogen

dashboards: install  ## regenerate the chart's Grafana dashboards in charts/bcstack/dashboards
	$(PYTHON) -m bcstack.dashboards

docs: install  ## the docs site (MkDocs, Material theme) into site/, strictly: a broken link fails
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

images: install  ## build every image with docker, podman or buildah, in order; IMAGES_ARGS=--dry-run shows the plan
	$(PYTHON) -m devkit.images $(IMAGES_ARGS)

clean:  ## remove build outputs and the install stamps (the environment stays: rm -rf .venv)
	rm -rf .make build *.egg-info .pytest_cache .ruff_cache .hypothesis $(VENV)/.installed-*
