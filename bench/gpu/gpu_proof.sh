#!/usr/bin/env bash
# On an offline GPU host, after the staged wheels of the lock files were copied over (see
# bench/gpu/lock_parity.py and bench/gpu/gpu_env.sh): the environments of images/locks/, then the proof
# that the GPU stack on them is right and as fast as before. One part per call (a host's time
# limit per command), each leaving its files in $OUT/<part>.tgz (a host returns few files):
#   PART=env      inventory.json.gz (the machine's packages, every file hashed: the parity table),
#                 env.log (installation, what each environment imports), the random 0.5B model,
#                 and SGLang's answers to every call tandem's client makes (sglang_recorded.json)
#   PART=correct  mixed-adapter batches against solo outputs and rollout/trainer logprob agreement
#                 for each LoRA backend (bench/gpu/gpu_mixed.py: mixed/), then tandem's own client on the
#                 same engine (bench/gpu/gpu_seam.py: seam/), on GPU 0; with two GPUs gpu_check runs on
#                 GPU 1 meanwhile, in shared mode (CHECK=0 leaves it out)
#   PART=engines  the gpu-marked batch-invariance and agreement test (tests/integration/
#                 test_engine_batches.py) on GPU 0 for each engine in ENGINES (default "sglang vllm"),
#                 its output in engines.log (ENGINE_SETTINGS, a JSON object of engine settings, checks a
#                 lever's configuration: '{"prefill_graphs_from_one_token": false}'); with two GPUs gpu_check --engine $ENGINE --mode shared runs
#                 on GPU 1 meanwhile, then bench/gpu/record_engine.py records that engine's answers
#   PART=check    bench/gpu/gpu_check.py --engine $ENGINE --steps $STEPS (gpu_check.json/.md)
#   PART=suite    bench/suite.py --engine $ENGINE --only $ONLY (default sync,swaps; suite.json/.md, plots),
#                 SHAPE (default 0.5b; 8b: the suite builds the model), MEM (--mem-fraction) and, in
#                 shared mode, RELEASE (--release-tags: '[]' frees nothing at the hand-over), SERVE=1
#                 (--serve-while-training, with RELEASE='[]': no hand-over at all), and
#                 ENGINE_ARGS (--engine-args: a JSON list of engine flags, a lever) to choose; ONLY=density
#                 runs the density scenario (1, 8 and 32 runs on one base; DENSITY=1,8 sets the counts; SLOTS=8, the
#                 shipped engine.max_loaded_adapters, instead of the suite's 128; LORAS=64 --loras-per-batch; KEEP=2
#                 --keep-versions, so that 32 runs of 8 steps do not fill the disk); each call starts from an
#                 empty state folder
#   PART=first    bench/gpu/gpu_first_forward.py --profile: the first response after a load, taken apart
#   PART=compare  SGLang and vLLM side by side: bench/suite.py --only $ONLY (default
#                 sync,swaps,agreement,throughput; ONLY=memory,hotload is a second call: all six
#                 take longer than a host's 10 minutes) on the 0.5B model of initializer_range
#                 0.02 (PART=env builds it), with SGLang on GPU 0 and vLLM on
#                 GPU 1 at once (one GPU: one after the other, LIMIT each; ENGINES=vllm runs one), each with its trainer on the
#                 same GPU (shared mode), then bench/report/compare_engines.py (engines.md);
#                 suite-<engine>.json of separate calls (ONLY=throughput,memory; ONLY=hotload) merge
#                 there: compare_engines.py a.json,b.json c.json,d.json. AGREE=peft,unsloth recomputes
#                 the agreement scenario's tokens with both trainer backends; SLOTS (adapters held,
#                 default 128) and ENGINE_ARGS (a JSON list: '["--kv-cache-memory-bytes", "8G"]') are
#                 levers; an engine's own variables pass through (VLLM_BATCH_INVARIANT=1 ...); LANE_GPU
#                 puts a one-engine call (ENGINES=vllm) on that GPU, so that two runs of one engine, with
#                 TAGs of their own, share a call on two GPUs
# MODE=split (default with two GPUs: the engine on GPU 0, the trainer on GPU 1; TRAINER_GPUS='[1,2,3]': a
# data-parallel trainer of one rank a GPU there) or shared (one GPU); PART=check's KILL_RANK=1 (KILL_AT=step)
# sends SIGKILL to that trainer rank mid-job (bench/gpu/gpu_rank_kill.py); SHAPE (PART=check, suite) 0.5b or 8b;
# GPU (default 0) for the one-GPU parts, so that two parts share a call on two GPUs:
#   KILL=0 PART=engines ENGINES=vllm CHECK=0 bash bench/gpu/gpu_proof.sh & GPU=1 KILL=0 PART=first bash bench/gpu/gpu_proof.sh; wait
# (KILL=0 on both: neither may end the other's engines; the parts before them end their own).
# A part whose check fails exits non-zero (its files still come back). Each step has a time limit
# (TEST_LIMIT per engine test, CHECK_LIMIT for gpu_check beside them) so that the part ends, and
# leaves its files, inside a host's limit per command.
# PATCHES=off takes tandem's SGLang patches (images/patches/) back for this call, so that an unpatched
# engine is a lever's "before" (bench/gpu/gpu_env.sh applies them; each later call without PATCHES=off
# applies them again); EAGER=0 (suite) switches engine.eager_adapter_slot off (on by default) and
# SMALL_PREFILL=0 (suite) engine.prefill_graphs_from_one_token off (on by default); both need them.
# GATHER=0 (suite) switches backend.gather_adapter_copy off (on by default: the trainer's copy in one transfer).
# BLANK=0 (suite) switches backend.blank_adapter_file off (on by default: each version's weights written over
# a file of zeros the trainer wrote before, off the path).
# INLINE=0 (suite) checks a new version's files in a thread (controller.check_inline off; as shipped they are
# checked on the controller's event loop where the store is on a local filesystem).
# KERNELS=bench (check, suite) pins SGLang's triton attention and PyTorch sampling instead of the shipped
# kernels (a lever to measure beside them).
# ENGINE=sglang (default) or vllm; ENVS, as bench/gpu/gpu_env.sh reads it, adds vLLM's environment;
# RECORD (PART=env) names the engines whose answers to record (default sglang; "" for none).
#   PART=env bash bench/gpu/gpu_proof.sh          # from the repo root; STEPS (default 30)
set -uo pipefail
: "${OUT:?set OUT}"
steps=${STEPS:-30}
part=${PART:?PART=env, correct, engines, check, suite, first or compare}
engine=${ENGINE:-sglang}
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
mode=${MODE:-$([ "$gpus" -ge 2 ] && echo split || echo shared)}
export PYTHONUNBUFFERED=1
model=/tmp/gc/model-0.5b
model_cmp=/tmp/gc/model-0.5b-0.02
# engines an earlier run left behind; KILL=0 when another part runs beside this one (GPU=1 below)
[ "${KILL:-1}" = 1 ] && nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill 2>/dev/null
if [ "$part" != env ] && [ -d /tmp/lk-sglang ] && command -v patch >/dev/null 2>&1; then
  # one call at a time: two parts of one call (PART=engines & PART=first) share the environment
  flock /tmp/lk-sglang.lock images/patches/apply.sh $([ "${PATCHES:-on}" = off ] && echo --reverse) sglang /tmp/lk-sglang || exit 1
fi
gpu=${GPU:-0}  # the GPU of the one-GPU parts (engines' tests, correct, first)
case $mode in
  split) placement=(--inference-gpus '[0]' --trainer-gpus "${TRAINER_GPUS:-[1]}" --mem-fraction 0.7) ;;
  *) placement=(--inference-gpus '[0]' --trainer-gpus '[0]' --mem-fraction 0.6) ;;
esac
engines=(--sglang-python /tmp/sgpython --vllm-python /tmp/vlpython)
pythons=(--tandem-python /tmp/tdpython "${engines[@]}" --trainer-python /tmp/trpython)
common=(--engine "$engine" "${pythons[@]}" "${placement[@]}" ${KERNELS:+--kernels "$KERNELS"})
second=$([ "$gpus" -ge 2 ] && echo 1 || echo 0)
out=/tmp/proof-$part${TAG:+-$TAG}  # TAG: two runs of one part in one call keep apart
shared_check() {  # gpu_check of engine $1 in shared mode on GPU 1 (learning, not speed), into /tmp/gc/$1-shared-0.5b
  timeout "${CHECK_LIMIT:-420}" /tmp/tdpython bench/gpu/gpu_check.py --mode shared --shape 0.5b --steps "$steps" --engine "$1" "${pythons[@]}" \
    --inference-gpus '[1]' --trainer-gpus '[1]' --mem-fraction 0.6 --out "/tmp/gc/$1-shared-0.5b" >/tmp/gpu_check.log 2>&1
}
keep_check() {  # the gpu_check run whose --out was $1: its results, report and log's end, and the
  # controller's timeline of hand-overs and loads (does a load wait for the engine's wake-up?)
  cp "$1/results.json" "$out/gpu_check.json" 2>/dev/null
  cp "$1/report.md" "$out/gpu_check.md" 2>/dev/null
  tail -c 60000 /tmp/gpu_check.log >"$out/gpu_check.log"
  grep -E "gpu lent|gpu back|adapter_load (start|end)" "$1/stack/logs/inference.log" 2>/dev/null | tail -c 200000 \
    >"$out/gpu_check-timeline.log"
}
rm -rf "$out" && mkdir -p "$out"
trap 'tar czf "$OUT/$part${TAG:+-$TAG}.tgz" -C "$out" . && ls -la "$out"' EXIT
case $part in
env)
  python3 bench/gpu/lock_parity.py inventory --out "$out/inventory.json.gz"
  bash bench/gpu/gpu_env.sh >"$out/env.log" 2>&1 || { tail -30 "$out/env.log"; exit 1; }
  # The host sets PYTHONDONTWRITEBYTECODE: without this every process compiles every module again.
  (unset PYTHONDONTWRITEBYTECODE; for d in /tmp/lk-*; do python3 -m compileall -q -j 0 "$d" >/dev/null 2>&1; done)
  tail -8 "$out/env.log"
  # the learning checks' model (initializer_range 0.1, so LoRA can move it) and the engine comparison's
  # (0.02, a real model's: bfloat16 logprobs of the sharper one are too noisy to compare engines by)
  /tmp/trpython -c 'import sys; sys.path.insert(0, "."); from bench.benchlib import SHAPES; from tandem_trainer.tiny_model import build_tiny_model; build_tiny_model(sys.argv[1], **SHAPES["0.5b"]); build_tiny_model(sys.argv[2], **{**SHAPES["0.5b"], "initializer_range": 0.02})' "$model" "$model_cmp"
  rm -rf /tmp/rec
  for e in ${RECORD-sglang}; do
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$second /tmp/tdpython bench/gpu/record_engine.py --engine "$e" "${engines[@]}" --out /tmp/rec \
      >"/tmp/rec-$e.log" 2>&1
    echo "record_engine $e: exit $? after $((SECONDS - t0)) s"; tail -5 "/tmp/rec-$e.log"
  done
  cp /tmp/rec/*.json "$out/" 2>/dev/null
  ;;
engines)
  t0=$SECONDS
  if [ "$second" = 1 ] && [ "${CHECK:-1}" = 1 ]; then  # CHECK=0 leaves GPU 1's lane out
    (
      shared_check "$engine"
      echo "gpu_check $engine shared: exit $? after $((SECONDS - t0)) s" >>/tmp/gpu_check.log
      rm -f "/tmp/rec/${engine}_recorded.json"
      CUDA_VISIBLE_DEVICES=1 timeout 150 /tmp/tdpython bench/gpu/record_engine.py --engine "$engine" "${engines[@]}" \
        --out /tmp/rec >"/tmp/rec-$engine.log" 2>&1
      echo "record_engine $engine: exit $? after $((SECONDS - t0)) s" >>"/tmp/rec-$engine.log"
    ) &
    lane=$!
  fi
  for e in ${ENGINES:-sglang vllm}; do
    var=TANDEM_TEST_${e^^}_PYTHON
    env "$var=/tmp/${e:0:2}python" TANDEM_TEST_ENGINE_SETTINGS="${ENGINE_SETTINGS:-}" CUDA_VISIBLE_DEVICES="$gpu" timeout "${TEST_LIMIT:-280}" /tmp/trpython -m pytest -p no:cacheprovider \
      -W ignore::pytest.PytestConfigWarning -rA -v --basetemp "/tmp/bt-$e" tests/integration/test_engine_batches.py \
      -k "$e" >>"$out/engines.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] || status=1
    echo "test_engine_batches $e: exit $rc after $((SECONDS - t0)) s" | tee -a "$out/engines.log"
  done
  tail -40 "$out/engines.log"
  if [ -n "${lane:-}" ]; then
    wait "$lane"; tail -25 /tmp/gpu_check.log; tail -5 "/tmp/rec-$engine.log"
    keep_check "/tmp/gc/$engine-shared-0.5b"
    cp "/tmp/rec/${engine}_recorded.json" "$out/" 2>/dev/null; tail -c 20000 "/tmp/rec-$engine.log" >"$out/record.log"
  fi
  ;;
correct)
  # With two GPUs, gpu_check runs on GPU 1 in shared mode meanwhile (it checks learning, not speed).
  if [ "$second" = 1 ] && [ "${CHECK:-1}" = 1 ]; then
    shared_check sglang &
    check=$!
  fi
  t0=$SECONDS
  CUDA_VISIBLE_DEVICES="$gpu" /tmp/trpython bench/gpu/gpu_mixed.py --out /tmp/mixed --sglang-python /tmp/sgpython \
    --lora-backends "${BACKENDS:-csgmv,triton}" >/tmp/mixed.log 2>&1
  echo "gpu_mixed: exit $? after $((SECONDS - t0)) s"
  CUDA_VISIBLE_DEVICES="$gpu" /tmp/trpython bench/gpu/gpu_seam.py --out /tmp/seam --sglang-python /tmp/sgpython \
    --shape 0.5b --rounds 4 >/tmp/seam.log 2>&1
  echo "gpu_seam: exit $? after $((SECONDS - t0)) s"
  tail -30 /tmp/mixed.log; tail -20 /tmp/seam.log
  mkdir -p "$out/mixed" "$out/seam"
  cp /tmp/mixed/*.md /tmp/mixed/*.json "$out/mixed/" 2>/dev/null
  cp /tmp/seam/*.json /tmp/seam/*.md "$out/seam/" 2>/dev/null
  tail -c 40000 /tmp/mixed.log >"$out/mixed/run.log"; tail -c 40000 /tmp/seam.log >"$out/seam/run.log"
  if [ -n "${check:-}" ]; then
    wait "$check"; echo "gpu_check: exit $? after $((SECONDS - t0)) s"; tail -25 /tmp/gpu_check.log
    keep_check /tmp/gc/sglang-shared-0.5b
  fi
  ;;
check)
  t0=$SECONDS
  /tmp/tdpython bench/gpu/gpu_check.py --mode "$mode" --shape "${SHAPE:-0.5b}" --steps "$steps" "${common[@]}" \
    ${KILL_RANK:+--kill-rank "$KILL_RANK"} ${KILL_AT:+--kill-at-step "$KILL_AT"} \
    --out "/tmp/gc/$engine-$mode-0.5b" >/tmp/gpu_check.log 2>&1
  echo "gpu_check $engine $mode: exit $? after $((SECONDS - t0)) s"
  tail -40 /tmp/gpu_check.log
  keep_check "/tmp/gc/$engine-$mode-0.5b"
  ;;
suite)
  t0=$SECONDS
  shape=${SHAPE:-0.5b}
  built=(--model "$model")  # the 0.5B model of PART=env; another shape the suite builds itself
  [ "$shape" = 0.5b ] || built=()
  rm -rf /tmp/suite /tmp/suite-state  # an earlier call's runs and versions (a cut call deletes none)
  timeout "${LIMIT:-560}" /tmp/tdpython bench/suite.py --mode "$mode" --shape "$shape" --only "${ONLY:-sync,swaps}" \
    "${built[@]}" "${common[@]}" ${MEM:+--mem-fraction "$MEM"} ${RELEASE:+--release-tags "$RELEASE"} \
    ${SERVE:+--serve-while-training} ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} ${DENSITY:+--density-runs "$DENSITY"} \
    ${SLOTS:+--engine-slots "$SLOTS"} ${LORAS:+--loras-per-batch "$LORAS"} ${KEEP:+--keep-versions "$KEEP"} \
    $([ "${EAGER:-1}" = 0 ] && echo --eager-adapter-slot off) \
    $([ "${SMALL_PREFILL:-1}" = 0 ] && echo --prefill-graphs-from-one-token off) \
    $([ "${GATHER:-1}" = 0 ] && echo --gather-adapter-copy off) \
    $([ "${BLANK:-1}" = 0 ] && echo --blank-adapter-file off) $([ "${INLINE:-1}" = 0 ] && echo --check-inline off) \
    --out /tmp/suite --state /tmp/suite-state \
    >/tmp/suite.log 2>&1
  echo "suite: exit $? after $((SECONDS - t0)) s"
  tail -50 /tmp/suite.log
  cp /tmp/suite/results.json "$out/suite.json" 2>/dev/null
  cp /tmp/suite/report.md "$out/suite.md" 2>/dev/null
  cp /tmp/suite/*.png "$out/" 2>/dev/null
  tail -c 40000 /tmp/suite-state/logs/inference.log >"$out/inference.log" 2>/dev/null
  ;;
compare)
  t0=$SECONDS
  tag=${TAG:+-$TAG}  # two calls of one engine at once keep their folders apart
  lanes=()
  for e in ${ENGINES:-sglang vllm}; do
    g=${LANE_GPU:-$([ "$e" = sglang ] && echo 0 || echo "$second")}
    timeout "${LIMIT:-560}" /tmp/tdpython bench/suite.py --engine "$e" --mode shared --shape 0.5b \
      --only "${ONLY:-sync,swaps,agreement,throughput}" --model "$model_cmp" "${pythons[@]}" --inference-gpus "[$g]" \
      --trainer-gpus "[$g]" --mem-fraction 0.6 ${RELEASE:+--release-tags "$RELEASE"} --out "/tmp/cmp-$e$tag" \
      ${AGREE:+--agreement-backends "$AGREE"} ${SLOTS:+--engine-slots "$SLOTS"} \
      ${ENGINE_ARGS:+--engine-args "$ENGINE_ARGS"} --state "/tmp/cmp-state-$e$tag" >"/tmp/cmp-$e$tag.log" 2>&1 &
    lanes+=($!)
    if [ "$second" = 0 ]; then  # one GPU: one engine after the other
      wait "${lanes[-1]}" || status=1
    else
      sleep 15  # the second stack picks its ports once the first holds its own
    fi
  done
  [ "$second" = 1 ] && for lane in "${lanes[@]}"; do wait "$lane" || status=1; done
  echo "suites: exit ${status:-0} after $((SECONDS - t0)) s"
  for e in ${ENGINES:-sglang vllm}; do
    tail -15 "/tmp/cmp-$e$tag.log"
    cp "/tmp/cmp-$e$tag/results.json" "$out/suite-$e.json" 2>/dev/null
    tail -c 30000 "/tmp/cmp-$e$tag.log" >"$out/suite-$e.log"
    tail -c 30000 "/tmp/cmp-state-$e$tag/logs/inference.log" >"$out/inference-$e.log" 2>/dev/null
    # the engine's own timing of each hand-over (vLLM: "It took X seconds to wake up tags ...")
    grep -iE "wake up|fall asleep|sleep mode|memory_occupation" "/tmp/cmp-state-$e$tag/logs/$e.log" 2>/dev/null |
      tail -c 30000 >"$out/engine-memory-$e.log"
    mkdir -p "$out/plots-$e" && cp /tmp/cmp-$e$tag/*.png "$out/plots-$e/" 2>/dev/null
  done
  [ -f "$out/suite-sglang.json" ] && [ -f "$out/suite-vllm.json" ] &&
    /tmp/tdpython bench/report/compare_engines.py "$out/suite-sglang.json" "$out/suite-vllm.json" --out "$out/engines.md" &&
    head -60 "$out/engines.md"
  ;;
first)
  t0=$SECONDS
  CUDA_VISIBLE_DEVICES="$gpu" /tmp/tdpython bench/gpu/gpu_first_forward.py --out /tmp/first --sglang-python /tmp/sgpython \
    --shape "${SHAPE:-0.5b}" --profile ${KERNELS:+--kernels "$KERNELS"} >/tmp/first.log 2>&1
  echo "gpu_first_forward: exit $? after $((SECONDS - t0)) s"
  tail -40 /tmp/first.log
  cp /tmp/first/results.json /tmp/first/report.md "$out/" 2>/dev/null
  ;;
esac
exit "${status:-0}"
