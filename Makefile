# The two commands: `make demo` and `make test`. Each creates .venv when it is
# missing, installs the project into it (again whenever pyproject.toml changes)
# and then runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
PYTEST_ARGS ?=

.PHONY: demo test venv lint clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "mlx-kvstore needs Python >= 3.10; $(PYTHON) is " + sys.version.split()[0] + ". Name another: make PYTHON=python3.12 $(MAKECMDGOALS)")'
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvstore demo

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kvstore tests tools
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
