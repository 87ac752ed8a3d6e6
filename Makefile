# Two entry points, both safe to run twice on a fresh machine:
#   make demo   the main job: a live failover demonstration
#   make test   set-up plus the whole suite: lint, types, tests
# Everything else here is a step of those two, but for two slower checks of the tests
# themselves, never part of make test (docs/testing.md):
#   make test-deep  the property tests of core, driver and aio with ten times the examples
#   make mutate     mutation testing of the pure core against tests/core

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMPS := .stamps

.PHONY: demo test lint typecheck pytest venv bench clean test-deep mutate

demo: $(STAMPS)/venv
	$(VENV)/bin/hafailover demo

test: $(STAMPS)/venv lint typecheck pytest

venv: $(STAMPS)/venv

# Re-installs only when pyproject.toml changes; the editable install keeps
# src/ and reference_broker/ live.
$(STAMPS)/venv: pyproject.toml
	@mkdir -p $(STAMPS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Two package roots (src/ and reference_broker/) make setuptools warn about editable
	# installs on every install; the layout is deliberate, so that one warning is silenced.
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install --quiet -e '.[dev,spark,otel]'
	@touch $@

lint: $(STAMPS)/venv
	$(VENV)/bin/ruff check src reference_broker tests benchmarks examples
	$(VENV)/bin/ruff format --check src reference_broker tests benchmarks examples

typecheck: $(STAMPS)/venv
	$(VENV)/bin/mypy

pytest: $(STAMPS)/venv
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The same tests under the "deep" Hypothesis profile of tests/conftest.py.
test-deep: $(STAMPS)/venv
	HAFAILOVER_HYPOTHESIS_PROFILE=deep $(PY) -m pytest -q tests/core tests/driver tests/aio $(PYTEST_ARGS)

# mutmut reads [tool.mutmut] in pyproject.toml and keeps its work in mutants/, so a second
# run only retests what changed. MUTANTS narrows it, e.g. MUTANTS='hafailover.core.window.*'.
# Prints each module's killed / total, then every mutant not killed.
mutate: $(STAMPS)/venv
	nice $(VENV)/bin/mutmut run $(MUTANTS)
	@$(VENV)/bin/mutmut results --all true | awk '{ m = $$1; sub(/\.x[^.]*$$/, "", m); total[m]++; \
		if ($$2 == "killed") killed[m]++ } \
		END { for (m in total) printf "%-30s %4d / %4d killed\n", m, killed[m], total[m] }' | sort
	$(VENV)/bin/mutmut results

bench: $(STAMPS)/venv
	$(PY) benchmarks/core.py
	$(PY) benchmarks/broker.py
	$(PY) benchmarks/client.py  # and benchmarks/paths.py
	$(PY) benchmarks/aio.py
	$(PY) benchmarks/spark.py
	$(PY) benchmarks/tracing.py

clean:
	rm -rf $(STAMPS) $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis mutants
