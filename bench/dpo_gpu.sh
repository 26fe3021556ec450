#!/bin/bash
# GPU DPO benchmark, one device call (nvidia-h200, ~9 min): hand-tuned LLaMA-Factory DPO, llmft's plan
# (auto: padding-free pairs, the reference step's cached log-probabilities) and llmft's plan with the
# reference model resident, on the same pairs.
#   bash bench/dpo_gpu.sh    # DPO_VARIANTS=hand,ours for the two alone (~6 min), DPO_STEPS (30) per variant
#   DPO_SIZE=8b DPO_FINETUNING=lora DPO_ROWS=500 DPO_STEPS=12 DPO_WARMUP=4 DPO_VARIANTS=hand,ours bash bench/dpo_gpu.sh
#                            # LoRA DPO of the 8 B model (~6 min: the 16 GB model built first)
#   DPO_MODE=fit DPO_SIZE=8b DPO_FINETUNING=lora DPO_CUTOFF=4096 DPO_HAND_BATCHES=1,2,4 bash bench/dpo_gpu.sh
#                            # each side at the largest micro-batch that fits at one cutoff (DPO_VARIANTS
#                            # unused: hand's search, then ours; DPO_PAIRS_PER_STEP, 8)
# Carried: the wheels (WHEELS=.whld: the LLaMA-Factory + DeepSpeed wheels for the image's Python 3.12,
# liger-kernel, jsonschema and its dependencies, tensorboardX) and bench/work/sft/tok (the tokenizer).
# Results in $OUT: dpo.json (bench/dpo_bench.py's comparison), dpo_gpu.log, dpo_runs.tar.gz (each
# variant's rendered YAML, train log and step log).
set -u
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
OUT=${OUT:-/tmp/out}
R=/tmp/dpo_bench
export BENCH_MODELS=${BENCH_MODELS:-/tmp/models}
mkdir -p "$R" "$OUT" "$BENCH_MODELS"
LOG=$OUT/dpo_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
use_wheels "$R/pip.log" liger_kernel jsonschema >>"$LOG" || { say "pip install failed"; exit 1; }
say "wheels installed"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
SIZE=${DPO_SIZE:-1b}
if [ ! -f "$BENCH_MODELS/llama$SIZE/config.json" ]; then
  python3 bench/sft_models.py model "$SIZE" "$BENCH_MODELS/llama$SIZE" bench/work/sft/tok --device cuda >>"$LOG" 2>&1 \
    || { say "model build failed"; tail -20 "$LOG"; exit 1; }
fi
say "model $SIZE ready"
if [ "${DPO_MODE:-all}" = fit ]; then
  mode=(fit --cutoff "${DPO_CUTOFF:-4096}" --hand-batches "${DPO_HAND_BATCHES:-1,2,4,8}"
    --pairs-per-step "${DPO_PAIRS_PER_STEP:-8}")
else
  mode=(all --variants "${DPO_VARIANTS:-hand,ours,resident}")
fi
python3 bench/dpo_bench.py "${mode[@]}" --out "$R" --json "$OUT/dpo.json" \
  --steps "${DPO_STEPS:-30}" --rows "${DPO_ROWS:-2000}" --size "$SIZE" --finetuning "${DPO_FINETUNING:-full}" \
  --warmup "${DPO_WARMUP:-5}" >>"$LOG" 2>&1
say "bench exit $?"
tail -8 "$LOG"
tar czf "$OUT/dpo_runs.tar.gz" -C "$R" --exclude=data --exclude=pairs.jsonl . 2>/dev/null
