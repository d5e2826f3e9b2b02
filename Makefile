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

setup: $(BIN)/dgemma

test: setup
	$(BIN)/python -m pytest -q

demo: setup
	$(BIN)/dgemma sudoku solve

clean:
	rm -rf $(VENV)
