# Two commands for a newcomer: `make run` and `make test`. Everything installs into .venv and .tools.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
BUF := .tools/node_modules/.bin/buf
CHROMIUM := /usr/bin/chromium
# What `make run` needs: the runtime dependencies and the project (the `continuum` command).
RUNTIME := $(VENV)/.installed-runtime
# What `make test` and `make lint` need on top: linters, type checker, test runner, code generators.
DEV := $(VENV)/.installed-dev
# Options for `continuum up`, e.g. make run ARGS="--gateway-port 9090".
ARGS ?=

.PHONY: setup run test lint mutate protos protos-check buf-lint buf-breaking release-protos clean

setup: $(DEV) $(BUF) $(CHROMIUM)

# The browser the console's tests drive: Debian's own build (nothing downloaded by Playwright itself).
$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "install Chromium as $(CHROMIUM) for the browser tests"; exit 1; }
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null

# The project builds with the setuptools pinned in pyproject.toml's build-system, in an isolated build env.
$(RUNTIME): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -r requirements.txt
	$(PIP) --no-deps -e .
	touch $@

$(DEV): $(RUNTIME) requirements-dev.txt
	$(PIP) -r requirements-dev.txt
	touch $@

$(BUF):
	npm install --silent --no-save --no-audit --no-fund --prefix .tools @bufbuild/buf@1.75.0

run: $(RUNTIME)
	$(VENV)/bin/continuum up $(ARGS)

protos: $(DEV)
	$(PY) scripts/protos.py

protos-check: $(DEV)
	$(PY) scripts/protos.py --check

buf-lint: $(BUF)
	$(BUF) lint

# The contracts as released: a change that would break a client built against them (a field renumbered,
# renamed or removed, a type changed) fails lint. `make release-protos` records the current contracts when a
# release is cut; merge's contract is left out until its service ships, so it can still change freely.
# Both sides are single images (the workspace has two modules: ours and the vendored google/api).
RELEASE_EXCLUDE := --exclude-path protos/continuum/merge --exclude-path protos/continuum/handoff_read

buf-breaking: $(BUF)
	$(BUF) build protos -o .tools/current.binpb
	$(BUF) breaking .tools/current.binpb --against protos/released.binpb

release-protos: $(BUF)
	$(BUF) build protos --exclude-source-info $(RELEASE_EXCLUDE) -o protos/released.binpb

# lint-imports checks the layering contracts in pyproject.toml (which package may import which); without a
# cache it takes under a second and leaves no cache directory in the checkout.
lint: $(DEV) protos-check buf-lint buf-breaking
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	# One mypy run per suite: every suite has its own conftest.py.
	for tree in runtime services/transcript services/compaction services/merge services/handoff-read agent clients gateway "cli tests" "bench scripts conftest.py"; do $(VENV)/bin/mypy $$tree || exit 1; done
	$(VENV)/bin/lint-imports --no-cache --no-logo

test: setup lint
	$(VENV)/bin/pytest $(PYTEST_ARGS)

# Mutation testing of the invariant modules (not part of CI; minutes per module): prints the survivors.
# `make mutate GROUPS="compaction gateway"` runs some groups only (see scripts/mutate.py).
mutate: $(DEV)
	$(PY) scripts/mutate.py $(GROUPS)

clean:
	rm -rf $(VENV) .tools .mypy_cache .ruff_cache .pytest_cache .mutate
