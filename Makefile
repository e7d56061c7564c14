# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, run the CPU demo (2 ranks, tiny random checkpoint)
#   make test   - create .venv, install (and Chromium for the page test: tools/ensure_chromium; PostgreSQL
#                 for the shared-queue tests: tools/ensure_postgresql), lint, run the test suite
#
# For the edit loop:
#   make lint       - ruff (rules in pyproject.toml), as make test runs it
#   make fmt        - ruff's safe fixes (import order, ...) applied in place
#   make lock       - rewrite requirements.lock after a change to requirements*.txt (tools/lock.py)
#   make test-fast  - lint and the tests not marked slow (no rank groups of the engine, no server, no browser)
#
# PYTHON: the interpreter(s) to build .venv with; the first that runs and fits pyproject.toml's
# requires-python wins (tools/find_python; pyenv installs are found even when not activated).
#   make test PYTHON=python3.10
# A .venv built by another Python version is rebuilt.
PYTHON ?= python3 python3.12 python3.11 python3.10
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(subst /,_,$(subst $(eval) ,_,$(PYTHON)))

.PHONY: demo test test-fast lint fmt install lock clean

$(STAMP): requirements.lock pyproject.toml
	@py="$$(tools/find_python $(PYTHON))" || exit 1; \
	want="$$("$$py" -c 'import sys; print(sys.version.split()[0])')"; \
	have="$$($(BIN)/python -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"; \
	if [ -n "$$have" ] && [ "$$have" != "$$want" ]; then \
		echo "$(VENV) was built by Python $$have; rebuilding it with $$py ($$want)"; rm -rf $(VENV); fi; \
	echo "$(VENV): Python $$want ($$py)"; \
	"$$py" -m venv $(VENV)
	rm -f $(VENV)/.installed*
	@# requirements.lock's packages this machine needs: the files pip picks, hash-checked against the
	@# lock, installed by uv (by pip where uv cannot be had, or WAN_S2V_INSTALLER=pip): tools/venv_install.py
	$(BIN)/python tools/venv_install.py
	$(BIN)/python tools/venv_install.py -e .
	@# every module the engine, the runner and the tests import, loaded in one process (native
	@# libraries above all); a venv that fails is not stamped installed
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m wan_s2v_runner.loading.venv_check --dev
	@# the bytecode of what a run and a server import, written by importing it once (where
	@# $$PYTHONDONTWRITEBYTECODE is set, every process would compile it again): 8 s, against 22 s
	@# for all of the venv's (compileall on 2 cores); the rest is written when first imported
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -c "from wan_s2v_runner.rank.warm_agent import preload; \
		preload(None); import wan_s2v_runner.cli.main, wan_s2v_runner.serve.start"
	touch $(STAMP)

install: $(STAMP)

# requirements.lock rewritten from requirements.txt, requirements-dev.txt, the extras' files
# (requirements-livekit.txt, requirements-pipecat.txt) and requirements-engine.txt (tools/lock.py; pins
# the inputs still allow are kept; ARGS=--upgrade takes the newest of everything)
lock:
	$(if $(wildcard $(BIN)/uv),$(BIN)/python,python3) tools/lock.py $(ARGS)

demo: $(STAMP)
	$(BIN)/wan-s2v demo

lint: $(STAMP)
	$(BIN)/ruff check .

fmt: $(STAMP)
	$(BIN)/ruff check --fix .

test: lint
	tools/ensure_chromium
	tools/ensure_postgresql
	@# the suite writes the bytecode of what it imports (where $$PYTHONDONTWRITEBYTECODE is set,
	@# each of its processes would compile it again)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q

test-fast: lint
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs outputs
