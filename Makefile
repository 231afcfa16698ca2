# The two commands of the README: `make demo` and `make test`.  Everything else is set up on the way.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR := build/demo

.PHONY: install demo test fuzz bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, pinned, so that nothing later pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev,peers]'
	touch $@

demo: $(STAMP)
	$(BIN)/rlflow zoo build demo-block --out $(DEMO_DIR)
	$(BIN)/rlflow optimize $(DEMO_DIR)/demo-block.onnx -o $(DEMO_DIR)/demo-block.rlflow.onnx \
		--json $(DEMO_DIR)/report.json --time-limit 60

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

fuzz: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

# The whole zoo on this machine's CPU, every method and peer, 1 thread; results under docs/results/ (33 minutes on
# 2 cores with these limits: 15 s of search per model and method, 12 interleaved rounds; both recorded in results.json).
BENCH_TIME_LIMIT ?= 15
BENCH_ROUNDS ?= 12
bench: $(STAMP)
	$(BIN)/rlflow zoo build --out models
	$(BIN)/rlflow bench models --methods greedy,taso,random --peers --threads 1 \
		--time-limit $(BENCH_TIME_LIMIT) --rounds $(BENCH_ROUNDS) --out docs/results

clean:
	rm -rf $(VENV) build *.egg-info
