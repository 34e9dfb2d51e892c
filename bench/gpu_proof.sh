#!/usr/bin/env bash
# On an offline GPU host, after the staged wheels of the lock files were copied over (see
# bench/lock_parity.py and bench/gpu_env.sh): the environments of images/locks/, then the GPU
# check and the suite's sync and swaps scenarios on them, one GPU, shared mode, 0.5B shape.
# Everything the report needs goes to $OUT (a few small files):
#   inventory.json.gz  the machine's packages with the sha256 of every file (for the parity table)
#   env.log            the installation and what each environment imports
#   gpu_check.json/.md bench/gpu_check.py --mode shared --shape 0.5b --steps $STEPS
#   suite.json/.md     bench/suite.py --only sync,swaps --mode shared --shape 0.5b
#   runs.log           the last lines of both runs' output
#   bash bench/gpu_proof.sh          # from the repo root; STEPS (default 30)
# PART=check runs the installation and gpu_check only, PART=suite only the suite (on the
# environments an earlier PART=check installed on the same host): one call each stays within a
# host's time limit per command.
set -uo pipefail
out=${OUT:?set OUT}
steps=${STEPS:-30}
part=${PART:-all}
export PYTHONUNBUFFERED=1
if [ "$part" != suite ]; then
python3 bench/lock_parity.py inventory --out "$out/inventory.json.gz"
bash bench/gpu_env.sh >"$out/env.log" 2>&1 || { tail -30 "$out/env.log"; exit 1; }
cat "$out/env.log"
fi
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
model=/tmp/gc/model-0.5b
common=(--tandem-python /tmp/tdpython --sglang-python /tmp/sgpython --trainer-python /tmp/trpython
        --inference-gpus '[0]' --trainer-gpus '[0]' --mem-fraction 0.6)
if [ "$part" != suite ]; then
# The random 0.5B-shaped model, built by the trainer's environment (the image's torch).
/tmp/trpython -c 'import sys; sys.path.insert(0, "bench"); from benchlib import SHAPES; from tandem_trainer.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1], **SHAPES["0.5b"])' "$model"
t0=$SECONDS
/tmp/tdpython bench/gpu_check.py --mode shared --shape 0.5b --steps "$steps" "${common[@]}" \
  --out /tmp/gc/shared-0.5b >/tmp/gpu_check.log 2>&1
echo "gpu_check: exit $? after $((SECONDS - t0)) s" | tee -a /tmp/runs.log
tail -40 /tmp/gpu_check.log >>/tmp/runs.log
cp /tmp/gc/shared-0.5b/results.json "$out/gpu_check.json" 2>/dev/null
cp /tmp/gc/shared-0.5b/report.md "$out/gpu_check.md" 2>/dev/null
tail -200 /tmp/gc/shared-0.5b/*.log >"$out/gpu_check_logs.txt" 2>/dev/null
fi
[ "$part" = check ] && { cp /tmp/runs.log "$out/runs.log"; exit 0; }
t0=$SECONDS
/tmp/tdpython bench/suite.py --engine sglang --mode shared --shape 0.5b --only sync,swaps --model "$model" \
  "${common[@]}" --out /tmp/suite --state /tmp/suite-state >/tmp/suite.log 2>&1
echo "suite: exit $? after $((SECONDS - t0)) s" | tee -a /tmp/runs.log
tail -60 /tmp/suite.log >>/tmp/runs.log
cp /tmp/suite/results.json "$out/suite.json" 2>/dev/null
cp /tmp/suite/report.md "$out/suite.md" 2>/dev/null
cp /tmp/runs.log "$out/runs.log"
