# Quickstart targets. `make run` runs the default federated job (2 clients x 2 rounds, TinyGuess,
# SmolLM2-135M-Instruct, CPU reference trainer) in Flower's simulation; `make test` runs the tests.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of torch. On a GPU node install the CUDA build first (docs/gpu.md, "1. Install") and use
# `make install TORCH_SPEC=`.
TORCH_SPEC ?= torch==2.13.0
FLWR_HOME ?= $(CURDIR)/.flwr
ARGS ?=
# The default job's trainer runs persistent: one reference-trainer process per node serves all of its
# (round, client) jobs, so torch, transformers and the model are loaded once per node instead of once
# per job (~8 CPU-seconds each, 10 jobs in the default run), with bit-identical results
# (tests/e2e/test_simulation_persistent.py; docs/performance.md, "make run's trainer mode").
# `make run RUN_CONFIG=` starts one trainer process per job instead. Flower merges this with a
# --run-config in ARGS (an `overrides=` there replaces this one), but takes a .toml file only alone:
# with ARGS="--run-config FILE.toml" set RUN_CONFIG= too.
RUN_CONFIG ?= overrides='trainer.mode=persistent'
# `make test` runs the suite on this many pytest-xdist worker processes (TEST_WORKERS=0: one process).
# Two on the 2-core CI machine: a simulation test spends much of its time waiting (process and Ray
# start-up, polling), which the other worker's tests fill. Each module runs whole on one worker
# (--dist loadfile), so a module-scoped fixture (a simulation checked by several tests) is built once;
# the modules with the most slow tests go first (tests/conftest.py).
TEST_WORKERS ?= 2
# Extra pytest arguments, e.g. `make test PYTEST_ARGS=tests/checkpoint` for one folder.
PYTEST_ARGS ?=

export FLWR_HOME
# flwr starts flower-superlink, flower-superexec and flwr-simulation by name.
export PATH := $(abspath $(VENV))/bin:$(PATH)
export FLWR_TELEMETRY_ENABLED = 0
export FLWR_DISABLE_UPDATE_CHECK = 1
# Flower would otherwise `uv sync` the app's dependencies (torch included) for every run.
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION = 1
# Our own local SuperLink ports, so an existing Flower setup on the machine is left alone.
export FLWR_LOCAL_SUPERLINK_HTTP_API_PORT ?= 39191
export FLWR_LOCAL_CONTROL_API_PORT ?= 39193

.PHONY: install alfworld-venv run lint test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"; fi
	$(VENV)/bin/python -m pip install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

# The ALFWorld env service's own interpreter (alfworld + textworld + a Fast Downward build), cached
# outside the checkout (~/.cache/fedagent-flwr); compiling takes minutes the first time, then it is reused.
alfworld-venv: install
	$(VENV)/bin/python -m fedagent_flwr.envs.alfworld.service_venv

# `flwr run --stream` exits 0 even when the run failed; fedagent_flwr.outcome passes its log through
# and exits with the run's own status (0 completed, 3 degraded, 1 failed; make itself then exits 2
# and prints it as "Error N"). Then, or on Ctrl-C, it stops the local SuperLink that `flwr run`
# started for this FLWR_HOME, and with it the run: Flower leaves both running otherwise.
run: install
	$(VENV)/bin/python -m fedagent_flwr.outcome run --stop-local "$(FLWR_HOME)" -- $(VENV)/bin/flwr run . --stream \
	  $(if $(RUN_CONFIG),--run-config "$(RUN_CONFIG)") $(ARGS)

# Lint (ruff: pycodestyle, pyflakes, import order, bugbear, pyupgrade) all the repository's Python code
# and type-check (mypy) the package and the arms tools (their numbers go into docs/results.md), with
# the versions pinned in the test extra; settings in pyproject.toml. `make test` runs it beside the suite.
LINT_PATHS = fedagent_flwr tests testkit tools benchmarks examples
TYPED_TOOLS = tools/gpu/arms.py tools/gpu/arms_pool.py tools/gpu/arms_report.py tools/gpu/arms_dynamics.py \
  tools/gpu/arms_steps.py tools/gpu/vllm_repro.py tools/gpu/fingerprints.py

LINT = $(VENV)/bin/ruff check $(LINT_PATHS) && $(VENV)/bin/mypy fedagent_flwr && $(VENV)/bin/mypy $(TYPED_TOOLS)

lint: install
	$(LINT)

# The lint runs in the background beside the suite, its output printed after the tests': a cold mypy
# takes ~55 s of one core, which before the suite left the other core idle and, during it, fills the
# time the simulations spend waiting (process and Ray start-up, polling). Either failing fails the
# target. The lint runs in a session of its own (setsid), so that an interrupted `make test` stops
# it, its processes included, on the way out (the EXIT trap), and leaves no temporary file.
test: install alfworld-venv
	@lint_log=$$(mktemp); \
	setsid -w sh -c '$(LINT)' > "$$lint_log" 2>&1 < /dev/null & lint_pid=$$!; \
	trap 'kill -TERM -$$lint_pid 2>/dev/null; rm -f "$$lint_log"' EXIT; trap 'exit 130' INT; trap 'exit 143' TERM; \
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); tests=$$?; \
	wait $$lint_pid; lint=$$?; \
	echo "--- make lint (ran beside the tests) ---"; cat "$$lint_log"; \
	if [ $$tests -ne 0 ]; then echo "make test: the tests failed (exit status $$tests, above)"; fi; \
	if [ $$lint -ne 0 ]; then echo "make test: the lint failed (above): fix it, or see it alone with make lint"; fi; \
	[ $$tests -eq 0 ] && [ $$lint -eq 0 ]

# Only what lies inside this checkout: FLWR_HOME (or VENV) exported for other work, e.g. ~/.flwr as
# docs/deployment.md sets it, is someone's Flower configuration, not this checkout's to delete.
# Where each one really is comes from POSIX cd -P/pwd -P, not GNU realpath (absent on macOS);
# CDPATH is emptied, or a name like .venv could be looked up in the caller's CDPATH.
clean:
	@for d in "$(VENV)" "$(FLWR_HOME)"; do \
	  [ -e "$$d" ] || [ -L "$$d" ] || continue; \
	  if [ -d "$$d" ]; then at=$$(CDPATH= cd -P -- "$$d" && pwd -P) || exit 1; \
	  else at=$$(CDPATH= cd -P -- "$$(dirname -- "$$d")" && pwd -P) || exit 1; at=$$at/$$(basename -- "$$d"); fi; \
	  case "$$at/" in \
	    "$(CURDIR)"/?*) rm -rf -- "$$d" || exit 1 ;; \
	    *) echo "make clean: left $$d alone: it is outside this checkout (remove it yourself if you mean to)" ;; \
	  esac; \
	done
