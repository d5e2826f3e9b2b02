# Two entry points for a fresh machine (see README "Quickstart").
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU wheel of torch; on our machines this installs from a local wheel in seconds.
TORCH ?= torch==2.13.0

.PHONY: setup test demo clean

$(BIN)/dgemma: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" -e ".[test]"
	touch $(BIN)/dgemma

# The playground test drives Debian's headless chromium; root installs it when it is missing.
setup: $(BIN)/dgemma
	@if ! command -v chromium >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		echo "installing chromium (for tests/test_playground.py)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

test: setup
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/dgemma sudoku solve --rounds 8

clean:
	rm -rf $(VENV)
