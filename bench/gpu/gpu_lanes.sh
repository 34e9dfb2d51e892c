#!/usr/bin/env bash
# Several runs of bench/gpu/gpu_proof.sh in one host command: one lane a GPU, the lanes at once,
# each lane's parts one after the other. A part is a list of gpu_proof.sh's variables; parts are
# separated by '|'; every part runs with KILL=0 and LANE_GPU / GPU set to its lane's GPU, and the
# engines a part left on its GPU (a part its LIMIT cut short) are ended before the lane's next part.
#
#   LANE0='TAG=e ENGINES=sglang ONLY=hotload LIMIT=465' \
#   LANE1='TAG=f ENGINES=vllm ONLY=throughput LIMIT=230 | TAG=g ENGINES=vllm ONLY=throughput LIMIT=330 VLLM_BATCH_INVARIANT=1' \
#   PART=compare bash bench/gpu/gpu_lanes.sh
#
# Size each LIMIT from what the parts took on 2 x H200 (2026-11-30), the lanes sharing the host's
# CPUs: SGLang's hot-load study ~300 s (its two merges start a trainer process each, 27-39 s);
# vLLM's throughput grid 195-235 s when it finished (its stack up in 58-176 s, the longest in
# batch-invariant mode; 16 training jobs; 90 s of cells). A part its LIMIT cuts leaves its log but
# no results.
#
# PART (default compare) applies to every part that names none. Each part's output is in
# $OUT/lane<gpu>-<n>.log and its files in $OUT/<part>-<TAG>.tgz (gpu_proof.sh's own), so give
# each part a TAG of its own. Exits non-zero when any part did.
set -uo pipefail
: "${OUT:?set OUT}"
cd "$(dirname "$0")/../.."

end_engines() {  # what a part left on GPU $1: its engine and trainer processes
  nvidia-smi -i "$1" --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null
  sleep 3
}

lane() {
  local gpu=$1 spec=$2 n=0 status=0 part
  IFS='|' read -ra parts <<<"$spec"
  for part in "${parts[@]}"; do
    n=$((n + 1))
    echo "lane $gpu part $n: $part" >&2
    eval "KILL=0 LANE_GPU=$gpu GPU=$gpu PART=${PART:-compare} $part bash bench/gpu/gpu_proof.sh" \
      >"$OUT/lane$gpu-$n.log" 2>&1 || status=1
    tail -4 "$OUT/lane$gpu-$n.log" >&2
    end_engines "$gpu"
  done
  return "$status"
}

pids=()
for gpu in 0 1 2 3; do
  var=LANE$gpu
  [ -n "${!var:-}" ] || continue
  lane "$gpu" "${!var}" &
  pids+=($!)
  sleep 10  # the next lane's stack picks its ports once this one holds its own
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
exit "$status"
