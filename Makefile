# turnstore — `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.DEFAULT_GOAL := help
.PHONY: help install run test lint bench clean

help: ## show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-8s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install turnstore with its dev tools

run: $(STAMP) ## serve on http://127.0.0.1:8000 (fake provider, embedded PostgreSQL in .turnstore/)
	$(BIN)/turnstore serve --host 127.0.0.1 --port 8000

test: $(STAMP) ## run the whole test suite against real PostgreSQL
	$(BIN)/python -m pytest

lint: $(STAMP) ## ruff check, ruff format --check, mypy --strict service
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict service

clean: ## remove .venv and the embedded database
	rm -rf $(VENV) .turnstore
