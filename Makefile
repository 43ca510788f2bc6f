# shadowtest: `make demo` runs the whole story, `make test` the linters and the test suite. Both set up from nothing.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup demo test bench lint clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(VENV)/bin/shadowtest demo

# CI (.ci/run) calls `make test`: the linters run first, so a lint error fails CI like a failing test.
test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

bench: setup
	@for b in bench/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy capture replay faults agent_under_test harness wire

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
