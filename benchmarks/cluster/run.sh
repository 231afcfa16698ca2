#!/usr/bin/env bash
# Issue #47's targets on a simulated 3-node Ray cluster (rlflow simulate-cluster: every node with its own cache, the
# driver with its own): the -tiny zoo benched with the model files deleted once submitted and a node removed mid-run,
# then a second run on the same cluster, the same bench without Ray, and the world-model trainer with and without
# --ray.  The nodes share this machine's cores: wall times are reported, not claimed as speedups.
#   bash benchmarks/cluster/run.sh > docs/results/cluster/run.log   (from the repository root, after `make install`;
#   run.log keeps Ray's own lines, among them the retry of the task the removed node was running)
set -euo pipefail
OUT=docs/results/cluster
BIN=${BIN:-.venv/bin}
WORK=$(mktemp -d /tmp/rlflow-cluster-XXXX)
BENCH=(--methods greedy,agent --time-limit 5 --rounds 5 --threads 1)
TRAIN=(--algo worldmodel --iterations 2 --random-steps 120 --collect-steps 60 --seed 0 --ppo-results none)
mkdir -p "$OUT" && rm -f "$OUT/deleted.txt"
export RLFLOW_CACHE=$WORK/driver
"$BIN/rlflow" zoo build $("$BIN/rlflow" zoo list --tiny | awk '/-tiny /{print $1}') --out "$WORK/tiny" >/dev/null

# a bench whose model files are deleted as soon as the driver has submitted them (its results file appears after the
# first model's task, by which time every model is in the object store)
bench_then_delete() {  # ADDRESS OUT-FOLDER
  rm -rf "$WORK/submit" && cp -r "$WORK/tiny" "$WORK/submit"
  "$BIN/rlflow" bench "$WORK/submit" "${BENCH[@]}" --ray "$1" --out "$2" 2>"$2.log" &
  local pid=$!
  until [ -f "$2/results.json" ] || ! kill -0 $pid 2>/dev/null; do sleep 1; done
  rm -rf "$WORK/submit" && echo "$(basename "$2"): model files deleted at $(date -u +%T), $(ls "$2"/results.json)" \
    >>"$OUT/deleted.txt"
  wait $pid
}

"$BIN/rlflow" simulate-cluster --nodes 3 --root "$WORK/nodes" --address-file "$WORK/address" \
  --remove-node-after 90 >"$OUT/cluster.log" 2>&1 &
CLUSTER=$!
trap 'kill $CLUSTER 2>/dev/null || true' EXIT
until [ -s "$WORK/address" ]; do sleep 1; done
ADDRESS=$(cat "$WORK/address")
start=$(date +%s); bench_then_delete "$ADDRESS" "$OUT/first"; echo "first: $(( $(date +%s) - start )) s" >"$OUT/walls.txt"
start=$(date +%s); bench_then_delete "$ADDRESS" "$OUT/second"; echo "second: $(( $(date +%s) - start )) s" >>"$OUT/walls.txt"
"$BIN/rlflow" train "${TRAIN[@]}" --ray "$ADDRESS" --out "$OUT/train-ray" --run-dir "$WORK/train-ray" \
  >"$OUT/train-ray.log" 2>&1
kill $CLUSTER; wait $CLUSTER 2>/dev/null || true

export RLFLOW_CACHE=$WORK/local   # without Ray: a cold cache as the cluster's was
start=$(date +%s); "$BIN/rlflow" bench "$WORK/tiny" "${BENCH[@]}" --out "$OUT/local" 2>"$OUT/local.log"
echo "local: $(( $(date +%s) - start )) s" >>"$OUT/walls.txt"
"$BIN/rlflow" train "${TRAIN[@]}" --out "$OUT/train-local" --run-dir "$WORK/train-local" >"$OUT/train-local.log" 2>&1
"$BIN/python" benchmarks/cluster/summarize.py "$OUT"
