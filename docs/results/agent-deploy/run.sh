#!/bin/bash
# Issue #28's training runs on the deployment section: the PPO baseline (when docs/results/agent-deploy/ppo/ is not
# there yet), then world-model seeds two side by side, all on this machine's one cost table; then the summary.
# Usage: docs/results/agent-deploy/run.sh [SEED...]   (from the repository root after `make install`; default seeds
# 0 1 2 3; about 17 minutes for PPO and 50-80 for each pair of seeds on a 2-core machine)
set -euo pipefail
here=docs/results/agent-deploy
bin=.venv/bin
makefile() {  # a variable of the Makefile, expanded: `make agent` and these runs train alike
    make -s --no-print-directory --eval "print-$1: ; @echo \$($1)" "print-$1"
}
mkdir -p build/agent-deploy

if [ ! -f "$here/ppo/ppo.json" ]; then  # the baseline every seed compares with (it fills the cost table)
    $bin/rlflow train --algo ppo $(makefile PPO_OPTIONS) --out "$here/ppo" --run-dir build/agent-deploy/ppo
fi
set -- ${*:-0 1 2 3}
while [ $# -gt 0 ]; do  # two seeds side by side, one core each
    for seed in $1 ${2:-}; do
        $bin/rlflow train --algo worldmodel $(makefile WORLDMODEL_OPTIONS) --seed "$seed" --out "$here/seed$seed" \
            --run-dir "build/agent-deploy/wm$seed" --ppo-results "$here/ppo/ppo.json" \
            > "build/agent-deploy/wm$seed.log" 2>&1 &
    done
    wait
    shift $(($# >= 2 ? 2 : 1))
done
$bin/python "$here/summarize.py"
