# The two commands of the README: `make demo` and `make test`.  Everything else is set up on the way.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_DIR := build/demo

.PHONY: install demo test fuzz bench agent ppo-agent clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch first, pinned, so that nothing later pulls a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[cpu,dev,peers,deploy,ray]'
	touch $@

demo: $(STAMP)
	$(BIN)/rlflow zoo build demo-block --out $(DEMO_DIR)
	$(BIN)/rlflow optimize $(DEMO_DIR)/demo-block.onnx -o $(DEMO_DIR)/demo-block.rlflow.onnx --method greedy \
		--json $(DEMO_DIR)/report.json

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow and not gpu" tests

fuzz: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

# The whole zoo on this machine's CPU, every method and peer, 1 thread; results under docs/results/.  Each method
# searches for its own default time (DEFAULT_TIME_LIMITS: agent 10 s, searches 60 s) so that the agent's time is
# compared with search's as users get them; 12 interleaved rounds per measurement (about an hour on 2 cores).
# Then `rlflow optimize` with every default, a fresh process per model, wall clock (about 4 minutes).
BENCH_ROUNDS ?= 12
# RAY=local (a Ray instance started here) or RAY=<address> runs each model as a task on a Ray cluster (README)
RAY ?=
bench: $(STAMP)
	$(BIN)/rlflow zoo build --out models
	$(BIN)/rlflow bench models --methods agent,greedy,taso,random --peers --threads 1 \
		--rounds $(BENCH_ROUNDS) $(if $(RAY),$(if $(filter local,$(RAY)),--ray,--ray $(RAY))) --out docs/results
	$(BIN)/python -m rlflow.bench_wallclock models --out docs/results

# The shipped agent (rlflow/agents/default.pt): the world-model agent (VAE + MDN-RNN, controller trained in the dream)
# on seven -tiny zoo models, five architectures never seen (default.json lists them); about 10 minutes on 2 cores.
# Its training report (sample efficiency against the PPO policy's run on the same models) goes to docs/results/agent/.
AGENT_MODELS := squeezenet-1.1-tiny,resnet-18-tiny,resnet-50-tiny,resnext-50-32x4d-tiny,mobilenet-v2-tiny,bert-base-tiny,gpt2-small-tiny
AGENT_HOLDOUT := inception-v3-tiny,densenet-121-tiny,vit-b-16-tiny,nasrnn-tiny,demo-block
agent: $(STAMP)
	$(BIN)/rlflow train --algo worldmodel --models $(AGENT_MODELS) --out docs/results/agent --run-dir build/agent/run \
		--ppo-results docs/results/ppo.json
	$(BIN)/python -m rlflow.controller.ship --checkpoint build/agent/run/worldmodel.pt \
		--results docs/results/agent/worldmodel.json

# The model-free baseline (rlflow/agents/ppo.pt, `--agent rlflow/agents/ppo.pt`): masked PPO on the same seven models,
# then its evaluation against random walk into docs/results/ppo.json (about 5 + 15 minutes).
AGENT_STEPS ?= 16000
ppo-agent: $(STAMP)
	$(BIN)/rlflow train --algo ppo --models $(AGENT_MODELS) --holdout $(AGENT_HOLDOUT) \
		--total-steps $(AGENT_STEPS) --no-evaluate --out build/ppo-agent --run-dir build/ppo-agent/run
	$(BIN)/python -m rlflow.controller.ship --checkpoint build/ppo-agent/run/ppo.pt --results build/ppo-agent/ppo.json
	$(BIN)/python -m rlflow.controller.evaluate --checkpoint rlflow/agents/ppo.pt \
		--results build/ppo-agent/ppo.json --out docs/results

clean:
	rm -rf $(VENV) build *.egg-info
