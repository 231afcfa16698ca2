#!/bin/bash
# Issue #28's training runs, as `make agent` and `make ppo-agent` train (the models, options and folders are the
# Makefile's): the PPO baseline when its results are not there yet (it fills the cost table), then world-model seeds
# one at a time (SEEDS_AT_ONCE=2: two side by side), each agent shipped to a scratch folder and benched beside greedy
# on the six held-out BERT exports, one bench at a time; then the tables (seeds.md, heldout.md) and the
# sample-efficiency plot.  One at a time because a process that measures a cost-table entry while another trains
# beside it writes 1-4x what the group costs alone (docs/results/archive/agent-deploy/README.md, sixth part);
# PPO_DIR gives a variant trained against another table (RLFLOW_CACHE) a PPO baseline of its own, as the sixth part
# did:
#     RLFLOW_CACHE=$PWD/build/quiet-table/cache VARIANT=quiet-table PPO_DIR=docs/results/agent-deploy/quiet-table/ppo \
#         benchmarks/agent-deploy/run.sh
# Usage: benchmarks/agent-deploy/run.sh [SEED...]   (from the repository root after `make install`; default seeds
# 0 1 2 3; about 9 minutes for PPO from an empty table, 11-13 for each seed alone and 3-5 for each bench on a 2-core
# machine; the sixth part, `quiet-table/`, took 80 minutes in all)
# A variant writes its own folder beside the shipped configuration's, against the same PPO baseline (TRAIN_OPTIONS
# come after the Makefile's and override them); the fourth and third parts (docs/results/archive/agent-deploy/README.md;
# their runs are archived beside it), which compared with small-hidden/ppo/ instead, were
#     VARIANT=no-cap TRAIN_OPTIONS="--random-steps 500" benchmarks/agent-deploy/run.sh
#     VARIANT=small-hidden TRAIN_OPTIONS="--random-steps 500 --cap-returns" benchmarks/agent-deploy/run.sh 0 1
# The second part (six training models, capped, five iterations) ran at commits 018a56a and e08ca76; each seed's
# command is in its seedN/worldmodel.json.
set -euo pipefail
bin=.venv/bin
makefile() {  # a variable of the Makefile, expanded: `make agent` and these runs train alike
    make -s --no-print-directory --eval "print-$1: ; @echo \$($1)" "print-$1"
}
results=$(makefile AGENT_RESULTS)
ppo=${PPO_DIR:-$(makefile PPO_RESULTS)}
at_once=${SEEDS_AT_ONCE:-1}
variant=${VARIANT:-$(basename "$results")}
here=docs/results/agent-deploy/$variant
held=($(makefile AGENT_HOLDOUT | tr , '\n' | sed 's|.*|models/&.onnx|'))
mkdir -p "build/$variant"

if [ ! -f "$ppo/ppo.json" ]; then
    $bin/rlflow train --algo ppo $(makefile PPO_OPTIONS) --out "$ppo" --run-dir "build/$variant/ppo"
fi
set -- ${*:-0 1 2 3}
while [ $# -gt 0 ]; do  # $at_once seeds side by side (one core each); the benches one at a time
    batch=("${@:1:$at_once}")
    for seed in "${batch[@]}"; do
        $bin/rlflow train --algo worldmodel $(makefile WORLDMODEL_OPTIONS) --seed "$seed" ${TRAIN_OPTIONS:-} \
            --out "$here/seed$seed" --run-dir "build/$variant/wm$seed" --ppo-results "$ppo/ppo.json" \
            > "build/$variant/wm$seed.log" 2>&1 &
    done
    wait
    for seed in "${batch[@]}"; do
        $bin/rlflow ship --checkpoint "build/$variant/wm$seed/worldmodel.pt" \
            --results "$here/seed$seed/worldmodel.json" --out "build/$variant/seed$seed-agent"
        $bin/rlflow bench "${held[@]}" --methods agent,greedy --agent "build/$variant/seed$seed-agent/default.pt" \
            --threads 1 --rounds 12 --out "$here/heldout-$seed"
    done
    shift ${#batch[@]}
done
$bin/python benchmarks/agent-deploy/summarize.py "$variant"
