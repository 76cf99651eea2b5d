# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardline-installed

export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export MLFLOW_DISABLE_TELEMETRY ?= true
export DO_NOT_TRACK ?= 1

.PHONY: install install-test demo lint test test-fast test-system bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

TEST_STAMP := $(VENV)/.shardline-test-installed

# What the demo needs: the package and its dependencies.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $(STAMP)

# What the tests need on top: the test extras and npm's Azurite (the Azure Blob API server).
$(TEST_STAMP): $(STAMP) pyproject.toml tests/services/package.json
	$(BIN)/python -m pip install -q -e '.[test]'
	npm install --prefix tests/services --no-audit --no-fund --loglevel=error
	touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

# Brings the stack up (kept if already up), runs the demo through it, ends with the URLs, a curl and how to stop.
demo: install
	$(BIN)/shardline up --config configs/demo.toml
	$(BIN)/shardline run --config configs/demo.toml
	@$(BIN)/shardline status || true

# The stack tests start a throwaway PostgreSQL (initdb/pg_ctl) and drive Debian's chromium; install them when
# missing. No cluster is created or started by the package (createcluster.d), the tests make their own.
# `shardline up` runs Debian's prometheus (its own config and port, not the package's service on 9090).
test-system:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { \
	  mkdir -p /etc/postgresql-common/createcluster.d && \
	  echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.d/shardline.conf && \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y postgresql; }
	@test -x /usr/bin/chromium || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }
	@command -v prometheus >/dev/null 2>&1 || { apt-get update && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus; }

# Lint, format, types and the floors (pyproject.toml: [tool.ruff], [tool.mypy], [tool.importlinter]).
lint: install-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: install-test test-system
	$(BIN)/python -m pytest tests

# The unit tier alone (pure logic: no server, no Ray, no subprocess), in a few minutes.
test-fast: install-test
	$(BIN)/python -m pytest -m unit -q

bench: install
	$(BIN)/python bench/run_all.py

clean:
	rm -rf .shardline
