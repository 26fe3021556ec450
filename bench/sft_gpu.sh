#!/bin/bash
# GPU SFT benchmark, one device run (nvidia-h200-x2): recipe vs hand-tuned vs llmft's own choices.
#   bash bench/sft_gpu.sh                      # every variant, most important first, within DEADLINE
#   bash bench/sft_gpu.sh ours_1b:60:14 hand_1b:60  # NAME:ESTIMATED_SECONDS[:MAX_STEPS] ...
# Needs, carried from the checkout: .whl/ (LLaMA-Factory + DeepSpeed + liger-kernel + jsonschema
# wheels for the image's Python 3.12) and bench/work/sft/ (tokenizer, data, token lengths) made by
#   python bench/sft_models.py data bench/work/sft/alpaca_synth.json
#   python -m llmft prepare-data ... --out-dir bench/work/sft/data; python bench/sft_bench.py lengths ...
# Results: $OUT/sft_h200x2.json (+ sft_runs.tar.gz with every run's logs, YAML and curves).
set -u
source "$(dirname "$0")/gpu_common.sh"
export RECORD_VRAM=1
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/out}
R=${BENCH_OUT:-/tmp/sft_bench}
export BENCH_MODELS=${BENCH_MODELS:-/tmp/models} BENCH_RUNS=${BENCH_RUNS:-/tmp/bench_runs}
MODELS=$BENCH_MODELS
mkdir -p "$R" "$OUT" "$MODELS"
say() { echo "[t=$(el)s] $*" | tee -a "$R/driver.log"; }
pack() {
  tar czf "$OUT/sft_runs.tar.gz" -C "$R" . 2>/dev/null
  cp "$R/driver.log" "$OUT/" 2>/dev/null
}

# BENCH_DRY_RUN=1: the same path on this machine's venv (CPU, tiny models), before spending device time.
if [ -z "${BENCH_DRY_RUN:-}" ] && wheels_missing; then
  install_wheels "$R/pip.log" || { say "pip install failed"; tail -20 "$R/pip.log"; exit 1; }
fi
site_first
say "wheels installed"
if [ -n "${BENCH_QUICK:-}" ]; then
  # A short follow-up call: reuse the machine facts and kernel check of the previous full call.
  cp bench/work/sft/prev/env.json bench/work/sft/prev/varlen_check.json "$R/"
else
ENV_JSON="$R/env.json" python3 - >"$R/env.err" 2>&1 <<'PY'
import json, os, subprocess, sys
import torch, transformers, deepspeed, llamafactory
from transformers.utils import is_flash_attn_2_available
try:
    import liger_kernel, importlib.metadata as md; liger = md.version("liger-kernel")
except Exception as exc: liger = f"missing: {exc}"
sys.path.insert(0, "workflow")
from llmft.core import varlen
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
open(os.environ["ENV_JSON"], "w").write(json.dumps({"gpus": smi, "cpus": os.cpu_count(), "python": sys.version.split()[0],
    "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
    "transformers": transformers.__version__, "deepspeed": deepspeed.__version__,
    "llamafactory": llamafactory.__version__, "liger_kernel": liger,
    "flash_attn_2_package": is_flash_attn_2_available(), "torch_varlen_attention": varlen.available()}, indent=1))
PY
say "env: $(tr -d '\n' <"$R/env.json" | head -c 600) $(tail -3 "$R/env.err")"
timeout 120 python3 bench/sft_bench.py check-varlen --out "$R" >"$R/varlen_check.log" 2>&1
say "varlen check: $(tail -1 "$R/varlen_check.log")"
timeout 120 python3 bench/sft_bench.py check-fusedce --out "$R" >"$R/fusedce_check.log" 2>&1
say "fusedce check: $(tail -1 "$R/fusedce_check.log")"
fi

# Inputs made here when only the tokenizer was carried (the data does not fit beside .whl/ in one
# call's carry): 6000 synthetic rows, prepared and tokenized as prepare_data does, their lengths.
W=bench/work/sft
if [ ! -f "$W/data/train.jsonl" ] || [ ! -f "$W/lengths.json" ]; then
  cat >"$R/data_cfg.yaml" <<EOF
run: bench
data: {sources: [{path: $W/alpaca_synth.json, format: alpaca}], cutoff_len: 2048, heldout_fraction: 0.02}
model: {template: default}
EOF
  { python3 bench/sft_models.py data "$W/alpaca_synth.json" --rows 6000 &&
    python3 -m llmft prepare-data --config "$R/data_cfg.yaml" --tokenizer "$W/tok" --out-dir "$W/data" &&
    python3 bench/sft_bench.py lengths "$W/data" "$W/tok"; } >"$R/data.log" 2>&1 ||
    { say "data failed"; tail -20 "$R/data.log"; pack; exit 1; }
  say "data: $(tail -1 "$R/data.log")"
fi

mk() {
  [ -f "$MODELS/llama$1/config.json" ] && return 0
  timeout 240 python3 bench/sft_models.py model "$([ -n "${BENCH_DRY_RUN:-}" ] && echo tiny || echo "$1")" "$MODELS/llama$1" bench/work/sft/tok >>"$R/models.log" 2>&1 ||
    { say "model $1 failed"; tail -20 "$R/models.log"; return 1; }
  say "model $1: $(tail -1 "$R/models.log")"
}

for spec in ${@:-ours_1b:55 hand_1b:55 recipe_1b:60 ours_8b:95 hand_8b:95 recipe_8b:90 ours_1b_sdpamask:50 ours_1b_noliger:50 ours_1b_zero2:55}; do
  IFS=: read -r name est steps <<<"$spec"
  if [ $(($(el) + est)) -gt "$DEADLINE" ]; then say "SKIP $name (elapsed $(el)s + est ${est}s > ${DEADLINE}s)"; continue; fi
  case $name in *8b*) mk 8b || continue ;; *) mk 1b || continue ;; esac
  left=$((DEADLINE + 25 - $(el)))
  res=$(python3 bench/sft_bench.py run "$name" --out "$R" --timeout "$left" ${steps:+--max-steps $steps} 2>&1 | tail -1)
  say "$name: ${res:0:400}"
  pack
done
# Which Triton kernels this call compiled, and when (map the times onto the first run's steps).
python3 bench/sft_bench.py triton-compiles --out "$R/triton_compiles.json" 2>&1 | tail -1 | tee -a "$R/driver.log"
python3 bench/sft_bench.py report "$R" --json "$OUT/sft_h200x2.json" \
  --command "bash bench/sft_gpu.sh $*" 2>&1 | tee -a "$R/driver.log"
pack
say done
