#!/bin/bash
# The two-profile run of issue #30: a rewrite that wins at one shape and loses at another is not kept.
# Usage: benchmarks/profiles/run.sh (from the repository root; writes to docs/results/profiles/)
set -euo pipefail
here=docs/results/profiles
model=$(mktemp -d)/linear_attention.onnx
python benchmarks/profiles/linear_attention.py "$model"
s16="q=16,64;k=16,64;v=16,64"
s128="q=128,64;k=128,64;v=128,64"
run() {  # name, then rlflow optimize's profile options
    local name=$1; shift
    echo "\$ rlflow optimize linear_attention.onnx --method greedy $*" > "$here/$name.txt"
    rlflow optimize "$model" --method greedy "$@" -o "${model%.onnx}.$name.onnx" --json "$here/$name.json" \
        2>/dev/null >> "$here/$name.txt"
}
run s16-only --profile "$s16"
run s16-heavy --profile "$s16@9" --profile "$s128"
run equal --profile "$s16" --profile "$s128"
