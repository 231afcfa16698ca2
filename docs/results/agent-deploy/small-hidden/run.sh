#!/bin/bash
# Issue #28, the small-hidden training set (docs/results/agent-deploy/README.md, "A small-hidden model in the training
# set"): the Makefile's six training exports plus DeiT-tiny from both exporters.  PPO alone first (it fills the cost
# table for DeiT-tiny), then world-model seeds two side by side for three iterations, then each agent shipped to a
# scratch folder and benched beside greedy on the six held-out BERT exports; then the tables.
# Usage: docs/results/agent-deploy/small-hidden/run.sh [SEED...]   (default 0 1; from the repository root, models built
# into models/ by `rlflow zoo build --family deploy --out models`; about 25 minutes for PPO, 60 for a pair of seeds and
# 5 for each bench on a 2-core machine)
set -euo pipefail
here=docs/results/agent-deploy/small-hidden
bin=.venv/bin
paths() { for m in "$@"; do printf "models/%s.onnx," "$m"; done | sed 's/,$//'; }
models=$(paths distilbert-base-s16-ts distilbert-base-s16-dynamo whisper-tiny-encoder-b1-ts \
    whisper-tiny-encoder-b1-dynamo deit-small-b1-dynamo deit-small-b1-ts deit-tiny-b1-ts deit-tiny-b1-dynamo)
held=(models/{bert-l2-h128,bert-l4-h256,minilm-l12-h384}-s16-{ts,dynamo}.onnx)
options="--models $models --scope rule --max-episode-steps 10 --zoo-dir models"
mkdir -p build/small-hidden
if [ ! -f "$here/ppo/ppo.json" ]; then
    $bin/rlflow train --algo ppo $options --holdout "$(IFS=,; echo "${held[*]}")" --total-steps 4096 --no-evaluate \
        --out "$here/ppo" --run-dir build/small-hidden/ppo
    $bin/python -m rlflow.controller.ship --checkpoint build/small-hidden/ppo/ppo.pt --results "$here/ppo/ppo.json" \
        --out build/small-hidden/ppo-agent
    $bin/rlflow bench "${held[@]}" --methods agent,greedy --agent build/small-hidden/ppo-agent/ppo.pt --threads 1 \
        --rounds 12 --out "$here/heldout-ppo"
fi
set -- ${*:-0 1}
while [ $# -gt 0 ]; do  # two seeds side by side, one core each
    for seed in $1 ${2:-}; do
        $bin/rlflow train --algo worldmodel $options --iterations 3 --seed "$seed" --out "$here/seed$seed" \
            --run-dir "build/small-hidden/wm$seed" --ppo-results "$here/ppo/ppo.json" \
            > "build/small-hidden/wm$seed.log" 2>&1 &
    done
    wait
    for seed in $1 ${2:-}; do
        $bin/python -m rlflow.controller.ship --checkpoint "build/small-hidden/wm$seed/worldmodel.pt" \
            --results "$here/seed$seed/worldmodel.json" --out "build/small-hidden/seed$seed-agent"
        $bin/rlflow bench "${held[@]}" --methods agent,greedy --agent "build/small-hidden/seed$seed-agent/default.pt" \
            --threads 1 --rounds 12 --out "$here/heldout-$seed"
    done
    shift $(($# >= 2 ? 2 : 1))
done
$bin/python docs/results/agent-deploy/summarize.py small-hidden
