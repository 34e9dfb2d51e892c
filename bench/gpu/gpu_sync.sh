#!/usr/bin/env bash
# On an offline GPU host: the suite's sync scenario (policy-sync latency, stage by stage) on one
# GPU in shared mode, for the 0.5B and the 8B shapes, on the environments of images/locks/.
#   PART=env   install the environments (bench/gpu/gpu_env.sh, after the staged wheels were copied
#              over: see bench/gpu/lock_parity.py) and build both random models into /tmp/gc
#   PART=run   SHAPE=0.5b|8b: bench/suite.py --only sync; CODE=<dir> runs the tandem code of
#              another checkout (a `git archive` of an older commit: the "before" of a change)
#              on the same environments. Results go to $OUT/<tag>/ (TAG, default the shape);
#              the suite is stopped after LIMIT seconds (default 560) so that its logs still come back.
# Run from the repo root: bash bench/gpu/gpu_sync.sh
set -uo pipefail
out=${OUT:?set OUT}
part=${PART:?PART=env or PART=run}
export PYTHONUNBUFFERED=1
if [ "$part" = env ]; then
  bash bench/gpu/gpu_env.sh >"$out/env.log" 2>&1 || { tail -30 "$out/env.log"; exit 1; }
  tail -6 "$out/env.log"
  for shape in 0.5b 8b; do
    t0=$SECONDS
    /tmp/trpython -c 'import sys; sys.path.insert(0, "."); from bench.benchlib import SHAPES; from tandem_trainer.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1], **SHAPES[sys.argv[2]])' \
      "/tmp/gc/model-$shape" "$shape" >>"$out/env.log" 2>&1 || { tail -20 "$out/env.log"; exit 1; }
    echo "model $shape: $((SECONDS - t0)) s, $(du -sh "/tmp/gc/model-$shape" | cut -f1)"
  done
  exit 0
fi
shape=${SHAPE:?SHAPE=0.5b or 8b}
code=$(realpath "${CODE:-.}")
tag=${TAG:-$shape}
src="$code/shared/src:$code/trainer/src:$code/inference/src"
for env in tandem trainer; do  # interpreters of the two tandem environments, on this code
  case $env in tandem) path="/tmp/lk-tandem:/tmp/lk-bench:$src" ;; trainer) path="/tmp/lk-trainer:$src" ;; esac
  printf '#!/bin/sh\nexport PYTHONPATH=%s\nexport HF_HUB_OFFLINE=1\nexport TOKENIZERS_PARALLELISM=false\nexec python3 "$@"\n' \
    "$path" >"/tmp/$env-$tag"
  chmod +x "/tmp/$env-$tag"
done
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | awk -F, '{print $1}' | xargs -r kill 2>/dev/null
case $shape in 8b) mem=0.5 ;; *) mem=0.6 ;; esac
mkdir -p "$out/$tag"
t0=$SECONDS
(cd "$code" && timeout "${LIMIT:-560}" /tmp/tandem-"$tag" bench/suite.py --engine sglang --mode shared --shape "$shape" --only sync \
  --model "/tmp/gc/model-$shape" --tandem-python "/tmp/tandem-$tag" --sglang-python /tmp/sgpython \
  --trainer-python "/tmp/trainer-$tag" --inference-gpus '[0]' --trainer-gpus '[0]' --mem-fraction "$mem" \
  --out "/tmp/sync-$tag" --state "/tmp/sync-state-$tag") >"/tmp/sync-$tag.log" 2>&1
echo "sync $tag: exit $? after $((SECONDS - t0)) s"
tail -40 "/tmp/sync-$tag.log"
cp "/tmp/sync-$tag/results.json" "/tmp/sync-$tag/report.md" "/tmp/sync-$tag/sync_latency.png" "$out/$tag/" 2>/dev/null
tail -c 60000 "/tmp/sync-state-$tag/logs/trainer.log" >"$out/$tag/trainer.log" 2>/dev/null
tail -c 60000 "/tmp/sync-state-$tag/logs/inference.log" >"$out/$tag/inference.log" 2>/dev/null
cp "/tmp/sync-$tag.log" "$out/$tag/suite.log"
exit 0
