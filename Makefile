# shoal — `make demo` sets everything up and runs the main job; `make test` sets up and runs the tests.
SHELL := /bin/bash
VENV  := .venv
PY    := $(VENV)/bin/python
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: setup agent chunkd guest demo test test-unit test-integration test-trainers lint bench clean

setup:
	@bash scripts/setup.sh

agent:
	@$(MAKE) -s -C agent

# the node's layer reader (FUSE; verified chunks on demand): build/shoal-chunkd
chunkd:
	@$(MAKE) -s -C chunkd

# the microVM kernel + initramfs (otherwise built lazily on the first microVM, cached under $SHOAL_HOME/vm)
guest: agent
	$(VENV)/bin/shoal vm build-guest

demo: setup
	$(VENV)/bin/shoal demo

test: setup
	$(PY) -m pytest tests -q --durations=25

test-unit: setup
	$(PY) -m pytest tests/unit -q

test-integration: setup
	$(PY) -m pytest tests/integration -q

# optional: the full trainer frameworks on CPU torch (.venv-trainers), one tiny run each (issue 17)
test-trainers: setup
	@bash scripts/test-trainers.sh

# ruff, then mypy (strict on the SDK, spec, models and settings; no new errors elsewhere: scripts/mypy_baseline.py)
lint:
	$(VENV)/bin/ruff check src tests benchmarks scripts
	$(PY) scripts/mypy_baseline.py

# after fixing type errors outside the strict modules: shrink the baseline
mypy-baseline:
	$(PY) scripts/mypy_baseline.py --update

bench: setup
	$(VENV)/bin/shoal bench

clean:
	rm -rf build .pytest_cache .ruff_cache .mypy_cache
