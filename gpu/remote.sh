#!/usr/bin/env bash
# Runs on the GPU machine, in the repository copy a device call starts in (see gpu/kit.py and .gpukit/COMMANDS.md).
#   receive PART      keep one carried part of the kit outside the repository (the copy is replaced every call)
#   install           reassemble the parts, check their SHA-256, unpack, check that CUDAExecutionProvider runs
#   measure [--wait S]  start gpu/measure.sh detached (it outlives the call), then collect
#   collect [--wait S]  wait up to S seconds for the measurement to finish; bundle what it has into $OUT
set -euo pipefail
KIT=${RLFLOW_KIT:-/tmp/rlflow-kit}
RESULTS=$KIT/results
PY=${PYTHON:-python3}

kit_env() {
  export PYTHONPATH=$KIT/site:$KIT/src PYTHONUNBUFFERED=1 RLFLOW_CACHE=$KIT/cache
  # the CUDA 13 libraries of the image's nvidia-* pip packages, for the CUDA provider's loader
  local dirs libs
  dirs=$("$PY" -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null || true)
  libs=$(for d in $dirs; do find "$d" -name 'lib*.so*' -printf '%h\n'; done | sort -u | paste -sd: -)
  export LD_LIBRARY_PATH=$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

wait_arg() { if [[ "${1:-}" == --wait ]]; then echo "${2:-0}"; else echo 0; fi; }

case "${1:-}" in
  receive)
    mkdir -p "$KIT/parts"
    cp "$2" "$KIT/parts/"
    echo "parts on the machine:"; ls -l "$KIT/parts"
    ;;
  install)
    want=$(cut -d' ' -f1 .gpukit/SHA256)
    got=$(cat "$KIT"/parts/part-* | sha256sum | cut -d' ' -f1)
    if [[ "$want" != "$got" ]]; then
      echo "kit: reassembled archive does not match its SHA-256 (parts missing?)" >&2; exit 1
    fi
    cat "$KIT"/parts/part-* | tar -xJ -C "$KIT"
    rm -rf "$KIT/src"; mkdir -p "$KIT/src"; cp -r rlflow gpu models "$KIT/src/"
    kit_env
    "$PY" gpu/check_cuda.py
    ;;
  measure)
    # a warm machine keeps an earlier run's results (and its DONE, which would end `collect` at once): set them aside
    if [[ -d "$RESULTS" ]]; then mv "$RESULTS" "$RESULTS-$(date -u +%H%M%S)"; fi
    mkdir -p "$RESULTS"
    kit_env
    setsid nohup bash "$KIT/src/gpu/measure.sh" > "$RESULTS/log.txt" 2>&1 < /dev/null &
    echo "measurement started (pid $!), log in $RESULTS/log.txt"
    exec bash "$0" collect --wait "$(wait_arg "${2:-}" "${3:-}")"
    ;;
  collect)
    wait_s=$(wait_arg "${2:-}" "${3:-}")
    end=$((SECONDS + wait_s))
    bundle() {  # refreshed every minute: a call cut short at its limit still returns what $OUT holds
      # the cost tables only: the rest of the cache (the builder's graphs, peers' files) is models, too large to return
      mkdir -p "$KIT/cache/costmodel"
      tar -czf "$OUT/results.tmp.tar.gz" -C "$KIT" results cache/costmodel \
        && mv "$OUT/results.tmp.tar.gz" "$OUT/results.tar.gz"
      cp "$RESULTS/log.txt" "$OUT/log.txt" 2>/dev/null || true
    }
    next=0
    while [[ ! -e "$RESULTS/DONE" && $SECONDS -lt $end ]]; do
      if [[ $SECONDS -ge $next ]]; then bundle; next=$((SECONDS + 60)); fi
      sleep 5
    done
    bundle
    tail -n 40 "$RESULTS/log.txt" 2>/dev/null || true
    if [[ -e "$RESULTS/DONE" ]]; then echo "measurement finished"; else echo "measurement still running"; fi
    ;;
  *)
    echo "usage: bash gpu/remote.sh receive PART | install | measure [--wait S] | collect [--wait S]" >&2; exit 2
    ;;
esac
