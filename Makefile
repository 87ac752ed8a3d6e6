# Two entry points, both safe to run twice on a fresh machine:
#   make demo   the main job: a live failover demonstration
#   make test   set-up plus the whole suite: lint, types, tests
# Everything else here is a step of those two, but for two slower checks of the tests
# themselves, never part of make test (docs/testing.md):
#   make test-deep  the property tests of core, driver and aio with ten times the examples
#   make mutate     mutation testing of the pure core against tests/core
# and one longer run of the randomized fault schedule (docs/reliability.md):
#   make chaos      tests/faults/test_nemesis.py for 10 minutes per protocol

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMPS := .stamps

.PHONY: demo test lint typecheck pytest venv bench clean test-deep mutate fault-tools chaos

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

# Two workers (pytest-xdist); tests/conftest.py keeps the RabbitMQ and Spark tests each on
# one worker. PYTEST_WORKERS=0 runs everything in this process, in collection order.
PYTEST_WORKERS ?= 2
pytest: $(STAMPS)/venv fault-tools
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadgroup --durations=25 $(PYTEST_ARGS)

# The network-fault tests (tests/faults) need iproute2 (ip, nsenter is util-linux) and
# iptables; as root they are installed from Debian when missing (non-interactive, safe to
# run twice, as scripts/rabbitmq.sh installs rabbitmq-server). Without root the tests skip
# with the reason, except in CI, where they fail.
FAULT_APT := DEBIAN_FRONTEND=noninteractive timeout 900 apt-get -y -q \
	-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
fault-tools:
	@if ! command -v ip >/dev/null || ! command -v iptables >/dev/null; then \
		if [ "$$(id -u)" != 0 ]; then \
			echo "fault-tools: iproute2/iptables missing and not root: tests/faults will not run"; \
		else \
			$(FAULT_APT) install iproute2 iptables </dev/null || \
			{ $(FAULT_APT) update </dev/null && $(FAULT_APT) install iproute2 iptables </dev/null; }; \
		fi; \
	fi

# A fresh seed each run; HAFAILOVER_CHAOS_SEED=N replays a schedule (make test runs seed 18
# for 60 s); HAFAILOVER_CHAOS_DURATION sets the length.
# The nodes' logs of the last run stay in .data/chaos.
chaos: $(STAMPS)/venv fault-tools
	HAFAILOVER_CHAOS_DURATION=$${HAFAILOVER_CHAOS_DURATION:-600} \
		HAFAILOVER_CHAOS_SEED=$${HAFAILOVER_CHAOS_SEED:-random} \
		$(PY) -m pytest -q -s -p no:cacheprovider --basetemp=.data/chaos \
		tests/faults/test_nemesis.py $(PYTEST_ARGS)

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
