#!/usr/bin/env bash
# The GPU measurement, started detached by `gpu/remote.sh measure`; each step writes its results as it goes, and
# `gpu/remote.sh collect` bundles whatever is there.  Order: what the acceptance needs first.
set -uo pipefail
KIT=${RLFLOW_KIT:-/tmp/rlflow-kit}
R=$KIT/results
PY=${PYTHON:-python3}
cd "$KIT/src"
step() { echo "== $(date -u +%FT%TZ) $*"; }
# smallest models first, so that a run cut short still covers most of the zoo
ZOO="squeezenet-1.1 mobilenet-v2 resnet-18 nasrnn resnet-50 resnext-50-32x4d inception-v3 densenet-121 nasnet-a-mobile gpt2-small vit-b-16 bert-base"
MODELS=$(for m in $ZOO; do echo "$KIT/models/$m.onnx"; done)

step environment
"$PY" gpu/environment.py > "$R/environment.json"; cat "$R/environment.json"

step "zoo build with the machine's own torch"
"$PY" -m rlflow.cli zoo build $ZOO --out "$KIT/models" 2>&1 | tee "$R/zoo-build.txt"

step "bench: greedy and TASO-style search, 10 s each, and the peers, CUDA with IOBinding"
"$PY" -m rlflow.cli bench $MODELS --methods ${GPU_METHODS:-greedy,taso} --peers --provider cuda --threads 1 \
  --time-limit ${GPU_TIME_LIMIT:-10} --rounds ${GPU_ROUNDS:-10} --out "$R/bench"

step "CUDA graph capture as a peer configuration"
"$PY" gpu/cuda_graph_peer.py $MODELS --out "$R/cuda-graph.json"

step "cost table: random rewrite sequences, estimates against end-to-end measurement"
"$PY" -m rlflow.measure.costmodel_check $MODELS --provider cuda --sequences ${GPU_SEQUENCES:-6} --length 4 \
  --rounds 10 --repeats 2 --out "$R/costmodel-check.json"

step done
touch "$R/DONE"
