# Two commands do all set-up on a fresh machine:
#   make demo   - create .venv, install, run the CPU demo (2 ranks, tiny random checkpoint)
#   make test   - create .venv, install, run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -r requirements.txt -r requirements-dev.txt
	$(BIN)/python -m pip install --no-deps wan22==2.2.11
	$(BIN)/python -m pip install --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/wan-s2v demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) runs outputs
