# Two commands for a newcomer: `make run` and `make test`. Everything installs into .venv and .tools.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
BUF := .tools/node_modules/.bin/buf
STAMP := $(VENV)/.installed

.PHONY: setup run test lint mutate protos protos-check buf-lint clean

setup: $(STAMP) $(BUF)

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0

run: $(STAMP)
	$(VENV)/bin/continuum up

protos: $(STAMP)
	$(PY) scripts/protos.py

protos-check: $(STAMP)
	$(PY) scripts/protos.py --check

buf-lint: $(BUF)
	$(BUF) lint

lint: $(STAMP) protos-check buf-lint
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	# One mypy run per suite: every suite has its own conftest.py.
	for tree in runtime services/transcript services/compaction clients gateway "cli tests" "bench scripts conftest.py"; do $(VENV)/bin/mypy $$tree || exit 1; done

test: setup lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Mutation testing of the invariant modules (not part of CI; minutes per module): prints the survivors.
# `make mutate GROUPS="compaction gateway"` runs some groups only (see scripts/mutate.py).
mutate: $(STAMP)
	$(PY) scripts/mutate.py $(GROUPS)

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache .mutate
