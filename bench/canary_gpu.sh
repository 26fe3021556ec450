#!/bin/bash
# The numerics canary's bf16 golden curve, recorded on one GPU (nvidia-h200), and the canary as
# verify_env runs it there (its time). One device call, ~2 min; .whl/ carried as for pipeline_gpu.sh.
#   bash bench/canary_gpu.sh           # the bf16 golden curve
#   bash bench/canary_gpu.sh fp8       # the FP8 leg's golden curve (bf16 + torchao float8; .whl with torchao)
# Results in $OUT: canary_bf16.json (the golden curve: mean of 3 runs, run-to-run and between-kernel
# spread, tolerance), canary_check.json (verify_env's canary on this node against it), canary_gpu.log.
set -u
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
OUT=${OUT:-/tmp/out}
R=/tmp/canary
mkdir -p "$R" "$OUT"
LOG=$OUT/canary_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
P=${1:-bf16}
use_wheels "$R/pip.log" liger_kernel jsonschema $([ "$P" = fp8 ] && echo torchao) >>"$LOG" || { say "pip install failed"; exit 1; }
say "wheels installed"
python3 -m llmft.env.canary --record --precision "$P" --runs 3 --device cuda --out "$OUT/canary_$P.json" >>"$LOG" 2>&1
say "recorded: $(tail -1 "$LOG" | head -c 600)"
mkdir -p workflow/llmft/env/golden && cp "$OUT/canary_$P.json" workflow/llmft/env/golden/
python3 -m llmft.env.nodefacts --out "$R/facts.json" --imports torch >>"$R/facts.log" 2>&1
T=$(date +%s.%N)
python3 -m llmft.env.canary --facts "$R/facts.json" --out "$OUT/canary_check.json" \
  --config-json "{\"hardware\": {\"gpus_per_node\": 1}, \"sft\": {\"precision\": \"bf16\", \"fp8\": $([ "$P" = fp8 ] && echo true || echo false)}}" >>"$LOG" 2>&1
say "verify_env's canary: $(python3 -c "import json,sys; d=json.load(open('$OUT/canary_check.json')); print(d['ok'], d['message'], d['run']['seconds'])" 2>&1) in $(python3 -c "import time; print(round(time.time()-$T,1))") s with imports"
