# turnstore — `make help` lists the targets.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.DEFAULT_GOAL := help
.PHONY: help install system-deps citus-deps js-deps browser-deps run test test-fast coverage-unit lint bench clean

help: ## show the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install turnstore with its dev tools

run: $(STAMP) ## serve on http://127.0.0.1:8000 (fake provider, embedded PostgreSQL in .turnstore/)
	$(BIN)/turnstore serve --host 127.0.0.1 --port 8000

# The multi-process tests (tests/system/test_cluster.py) put nginx and PgBouncer in front of real
# replicas; the browser tests (tests/system/test_console.py) drive Debian's Chromium. Installed from
# Debian when missing and possible (root); else those tests skip.
system-deps: ## install nginx-light, pgbouncer and chromium with apt-get when missing
	@export PATH="$$PATH:/usr/sbin:/sbin"; pkgs=""; \
	command -v nginx >/dev/null || pkgs="$$pkgs nginx-light"; \
	command -v pgbouncer >/dev/null || pkgs="$$pkgs pgbouncer"; \
	test -x /usr/bin/chromium || pkgs="$$pkgs chromium"; \
	if [ -z "$$pkgs" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "apt-get install$$pkgs"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null; \
	else \
		echo "note:$$pkgs not installed (needs root and apt-get): the tests using them skip"; \
	fi

# The Citus tests (tests/support/citus.py) start a coordinator and two workers of the system
# PostgreSQL 15 with Citus, built from source by CITUS_BUILD when missing and possible
# (root, apt-get; 2-4 minutes once). Otherwise those tests skip; this never fails `make test`.
# The script lives beside the checkout (../shared/citus/build.sh), wherever that is.
CITUS_BUILD ?= $(abspath $(dir $(lastword $(MAKEFILE_LIST)))/../shared/citus/build.sh)
citus-deps: ## build and install Citus into PostgreSQL 15 when missing (needs root and apt-get)
	@if [ ! -x "$(CITUS_BUILD)" ]; then \
		echo "note: no Citus build script at $(CITUS_BUILD) (set CITUS_BUILD): the Citus tests skip"; \
	elif "$(CITUS_BUILD)" --check; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "note: Citus is not installed (building it needs root and apt-get): the Citus tests skip"; \
	else \
		"$(CITUS_BUILD)" || echo "note: building Citus failed (above): the Citus tests skip"; \
	fi

# The official openai npm package, for tests/system/test_openai_js.py (skipped without Node.js).
JS_STAMP := tests/js/node_modules/.installed
$(JS_STAMP): tests/js/package.json tests/js/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix tests/js --no-audit --no-fund --silent && touch $(JS_STAMP); \
	else \
		echo "note: npm not found: the JavaScript SDK test skips"; \
	fi

js-deps: $(JS_STAMP) ## install the openai npm package for the JavaScript SDK test (needs npm)

# playwright-core drives Debian's Chromium in tests/system/test_console.py (it downloads no browser).
BROWSER_STAMP := tests/browser/node_modules/.installed
$(BROWSER_STAMP): tests/browser/package.json tests/browser/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix tests/browser --no-audit --no-fund --silent && touch $(BROWSER_STAMP); \
	else \
		echo "note: npm not found: the browser tests skip"; \
	fi

browser-deps: $(BROWSER_STAMP) ## install playwright-core for the browser tests (needs npm)

test: $(STAMP) system-deps citus-deps js-deps browser-deps ## run the whole test suite against real PostgreSQL
	$(BIN)/python -m pytest

# Plugins of installed packages the unit layer does not use (Faker's, schemathesis', LangSmith's,
# Hypothesis', anyio's, platformdirs'): loading them takes seconds of the inner loop.
UNIT_PLUGINS_OFF := -p no:faker -p no:schemathesis -p no:langsmith_plugin -p no:hypothesispytest \
	-p no:anyio -p no:platformdirs
test-fast: $(STAMP) ## the inner loop: tests/unit, the rules over the in-memory fake (no database, seconds)
	$(BIN)/python -m pytest tests/unit -q -n auto $(UNIT_PLUGINS_OFF)

coverage-unit: $(STAMP) ## tests/unit alone: its coverage of service/usecases/ (fails under 75%)
	COVERAGE_FILE=$(VENV)/.coverage-unit $(BIN)/python -m pytest tests/unit -q $(UNIT_PLUGINS_OFF) \
		--cov=service/usecases --cov-report=term --cov-fail-under=75

lint: $(STAMP) ## ruff check, ruff format --check, mypy --strict service
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy --strict service

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/pip install --quiet -e '.[bench]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) citus-deps ## turnstore vs a plain-asyncpg baseline and three peers; HTTP; 1,000 streams; Citus (~4 min)
	$(BIN)/python -m bench

clean: ## remove .venv and the embedded database
	rm -rf $(VENV) .turnstore
