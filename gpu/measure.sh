#!/usr/bin/env bash
# The GPU measurement, started detached by `gpu/remote.sh measure`; each step writes its results as it goes, and
# `gpu/remote.sh collect` bundles whatever is there.  Order: what the acceptance needs first.
# Settings (environment): GPU_STEPS (which steps, in order: bench cuda-graph costcheck [default], optimize, precision),
# GPU_PROVIDER (cuda; with another, e.g. cpu, the CUDA graph steps are skipped, so that the script can be rehearsed
# without a GPU), GPU_ZOO (the models, zoo names), GPU_METHODS, GPU_TIME_LIMIT (seconds, or `default`: each method's
# own default, as a user runs it), GPU_ROUNDS, GPU_SEQUENCES, GPU_BENCH_ARGS (more bench options, e.g. "--fix-dim batch=1"),
# GPU_OPTIMIZE_ARGS (more optimize options, e.g. "--padding attention_mask=right"), GPU_PRECISION (the precision
# step's --precision: fp16, int4, ...).  The lease plan, in order: gpu/plan.py.
# The optimize step runs `rlflow optimize --method greedy` on each model in turn and times its output beside the input,
# plain and with CUDA graph capture (gpu/cuda_graph_peer.py --rewritten), one model at a time so that a run cut short
# has whole rows.  The bench's peers include, for the zoo's decoders, onnxruntime-genai's model builder's graph (-p fp16
# for the -fp16 entries, -e cuda), the builder run from the kit's copy of its source (RLFLOW_GENAI_BUILDER).
# GPU_COSTCHECK_ZOO names other models for the costcheck step (built when it starts), so that one lease can time a few
# models and fill the CUDA cost table on others.
# GPU_CUDA_GRAPH=1 makes it `rlflow optimize --cuda-graph` (the search and its verdict measured with
# CUDA graph capture), written as STEM.rlflow-cg.onnx and optimize/STEM-cg.json, and the bench `--cuda-graph`
# (into bench-cg/).  Rehearsal on a machine without a GPU (see docs/results/gpu/rehearsal.md):
#   mkdir -p /tmp/k/site /tmp/k/src      # what `remote.sh install` copies: the files a device call carries
#   git ls-files -z --cached --others --exclude-standard rlflow gpu models | xargs -0 cp --parents -t /tmp/k/src
#   RLFLOW_KIT=/tmp/k PYTHON=$PWD/.venv/bin/python GPU_PROVIDER=cpu GPU_ZOO="squeezenet-1.1-tiny resnet-18-tiny" \
#     GPU_TIME_LIMIT=3 bash gpu/measure.sh
set -uo pipefail
KIT=${RLFLOW_KIT:-/tmp/rlflow-kit}
R=$KIT/results
PY=${PYTHON:-python3}
PROVIDER=${GPU_PROVIDER:-cuda}
# what `gpu/remote.sh measure` sets already; the defaults let the script run on its own, as in a rehearsal
export PYTHONPATH=${PYTHONPATH:-$KIT/site:$KIT/src} RLFLOW_CACHE=${RLFLOW_CACHE:-$KIT/cache} PYTHONUNBUFFERED=1
export RLFLOW_GENAI_BUILDER=${RLFLOW_GENAI_BUILDER:-$KIT/site/onnxruntime_genai/models}
mkdir -p "$R"
cd "$KIT/src"
step() { echo "== $(date -u +%FT%TZ) $*"; }
# a command that fails is named in $R/FAILED and the script goes on (the next step may still measure); it exits 1
fail() { echo "$*" >> "$R/FAILED"; echo "== $(date -u +%FT%TZ) FAILED: $*"; }
# smallest models first, so that a run cut short still covers most of the zoo
ZOO=${GPU_ZOO:-"squeezenet-1.1 mobilenet-v2 resnet-18 nasrnn resnet-50 resnext-50-32x4d inception-v3 densenet-121 nasnet-a-mobile gpt2-small vit-b-16 bert-base"}
MODELS=$(for m in $ZOO; do echo "$KIT/models/$m.onnx"; done)

step environment
"$PY" gpu/environment.py > "$R/environment.json"; cat "$R/environment.json"

step "zoo build with the machine's own torch"
"$PY" -m rlflow.cli zoo build $ZOO --out "$KIT/models" 2>&1 | tee "$R/zoo-build.txt" || fail "zoo build"

if [[ $PROVIDER == cuda ]]; then binding=", CUDA with IOBinding"; else binding=", provider $PROVIDER"; fi
LIMIT=${GPU_TIME_LIMIT:-10}; limit=(--time-limit "$LIMIT")
if [[ $LIMIT == default ]]; then limit=(); fi
capture=(); cg=""  # GPU_CUDA_GRAPH: the bench and optimize steps measure with CUDA graph capture
if [[ -n ${GPU_CUDA_GRAPH:-} && $PROVIDER == cuda ]]; then capture=(--cuda-graph); cg="-cg"; fi
for STEP in ${GPU_STEPS:-bench cuda-graph costcheck}; do
  case $STEP in
    bench)
      step "bench: ${GPU_METHODS:-greedy,taso}, time limit $LIMIT, and the peers$binding"
      "$PY" -m rlflow.cli bench $MODELS --methods ${GPU_METHODS:-greedy,taso} --peers --provider "$PROVIDER" \
        --threads 1 "${limit[@]}" --rounds ${GPU_ROUNDS:-10} "${capture[@]}" \
        ${GPU_BENCH_ARGS:-} --out "$R/bench$cg" || fail "bench" ;;
    cuda-graph)
      if [[ $PROVIDER == cuda ]]; then
        step "CUDA graph capture as a peer configuration"
        "$PY" gpu/cuda_graph_peer.py $MODELS --out "$R/cuda-graph.json" || fail "cuda-graph"
      else
        step "CUDA graph capture skipped (provider $PROVIDER)"
      fi ;;
    costcheck)
      COSTZOO=${GPU_COSTCHECK_ZOO:-$ZOO}
      if [[ -n ${GPU_COSTCHECK_ZOO:-} ]]; then
        "$PY" -m rlflow.cli zoo build $COSTZOO --out "$KIT/models" 2>&1 | tee -a "$R/zoo-build.txt" || fail "zoo build"
      fi
      step "cost table: random rewrite sequences, estimates against end-to-end measurement"
      "$PY" -m rlflow.cli costmodel check $(for m in $COSTZOO; do echo "$KIT/models/$m.onnx"; done) --provider "$PROVIDER" --sequences ${GPU_SEQUENCES:-6} \
        --length 4 --rounds 10 --repeats 2 --out "$R/costmodel-check.json" || fail "costcheck" ;;
    optimize)
      mkdir -p "$R/optimize"
      for m in $ZOO; do
        step "optimize $m: greedy, time limit $LIMIT$binding ${capture[*]}"
        "$PY" -m rlflow.cli optimize "$KIT/models/$m.onnx" --method greedy --provider "$PROVIDER" --threads 1 \
          "${limit[@]}" "${capture[@]}" ${GPU_OPTIMIZE_ARGS:-} -o "$KIT/models/$m.rlflow$cg.onnx" \
          --json "$R/optimize/$m$cg.json" || fail "optimize $m"
        # a padding contract's output is timed by its gate (masks of ones); the peer script's random masks break it
        if [[ $PROVIDER == cuda && ${GPU_OPTIMIZE_ARGS:-} != *--padding* ]]; then
          step "$m and its rewrite, plain and captured"
          "$PY" gpu/cuda_graph_peer.py "$KIT/models/$m.onnx" --rewritten ".rlflow$cg.onnx" \
            --out "$R/optimize/$m$cg.captured.json" || fail "optimize $m, captured comparison"
        fi
      done ;;
    precision)
      P=${GPU_PRECISION:-fp16}
      step "bench-precision $P: rlflow --precision $P beside the quantizers and converters$binding"
      "$PY" -m rlflow.cli bench-precision $MODELS --precision "$P" --provider "$PROVIDER" --threads 1 \
        --rounds ${GPU_ROUNDS:-10} --out "$R/precision-$P" || fail "precision $P" ;;
    *) fail "unknown step $STEP (steps: bench cuda-graph costcheck optimize precision)" ;;
  esac
done

step done
touch "$R/DONE"
[[ ! -s $R/FAILED ]]
