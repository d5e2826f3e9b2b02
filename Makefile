# Two entry points for a fresh machine (see README "Quickstart"): `make demo` installs the core package
# alone (no test tools, no browser); `make test` adds the [test] extra and chromium, lints, and runs pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel of torch; on our machines this installs from a local wheel in seconds.
TORCH ?= torch==2.13.0

.PHONY: setup lint test demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# stamps: what each target installed, redone when pyproject.toml changes
$(VENV)/.core: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)" -e .
	touch $@

$(VENV)/.test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH)" -e ".[test]"
	touch $@ $(VENV)/.core

# The playground test drives Debian's headless chromium; root installs it when it is missing.
setup: $(VENV)/.test
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium (for tests/test_playground.py)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

lint: $(VENV)/.test
	$(BIN)/ruff check .

# Two pytest workers of one torch thread each (tests/conftest.py): on CI's two cores a compile or a test's
# server leaves one core idle, so the suite takes ~23 minutes instead of ~31 serially. WORKERS=0 runs serially.
WORKERS ?= 2
test: setup lint
	$(BIN)/python -m pytest -q -n $(WORKERS) --dist worksteal --durations=25

demo: $(VENV)/.core
	$(BIN)/dgemma sudoku solve --rounds 8

clean:
	rm -rf $(VENV)
