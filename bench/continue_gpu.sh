#!/bin/bash
# bench/continue_bench.py (continue vs retrain, the whole pipeline through Snakemake) on the device
# machine (nvidia-h200): the demo config on the GPU, several pipelines side by side.
#   DEADLINE=430 CONTINUE_RUN_S=135 bash bench/continue_gpu.sh --rows 6000 --seeds 1 2 3 --jobs 9 \
#     --set data.heldout_fraction=0.4 --set eval.max_rows=100000 \
#     --variant lr0.25:nightly.continue_learning_rate_factor=0.25
# (~400 s: three seeds' night1 and retrain side by side, then their continued runs.) On a warm
# machine, --resume "$(ls -d /tmp/continue_bench/work/llmft-continue-bench.*)" goes on from the last
# call's finished runs; --retrain-from bench/results/<file>.json reuses that file's retrains.
# Every argument goes to continue_bench.py, after the keys this script sets: hardware.gpus_per_node=1,
# processes_per_node=0 (one process on the GPU) and sft.precision=bf16 (the GPU's setting; the runs
# in bench/results were made so. The demo config's fp32 failed there at the first step, "FlashAttention
# only support fp16 and bf16 data type": the planner then picked torch's varlen kernel; it now takes
# SDPA under fp32); CONTINUE_DEVICE=cpu sets gpus_per_node=0, processes_per_node=2 and hides the GPU instead
# (the demo's CPU processes, fp32).
# Needs, carried from the checkout: .whl/ (LLaMA-Factory 0.9.5 + DeepSpeed + liger-kernel +
# Snakemake 9.27.1 + jsonschema + the metrics' jieba, nltk, rouge-chinese and every wheel they need
# that the device image lacks; no PuLP: the bench then asks Snakemake for its greedy scheduler).
# Results in $OUT: continue.json (rewritten as each run finishes, so a call stopped at its limit
# still returns the runs it finished), continue_gpu.log (this driver's log and the bench's output),
# continue_logs.tar.gz (each run's Snakemake log and stage logs).
# Knobs: DEADLINE (s, default 560): the bench is stopped then, and starts no run after
# DEADLINE - CONTINUE_RUN_S (default 150) seconds.
set -u
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/out}
S=/tmp/continue_bench
mkdir -p "$OUT" "$S"
LOG=$OUT/continue_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
pack() {
  (cd "$S" && find . \( -name 'snakemake*.log' -o -path '*/results/*/logs/*' \) -type f -print0 |
    tar czf "$OUT/continue_logs.tar.gz" --null -T -) 2>/dev/null
}

if wheels_missing snakemake liger_kernel jsonschema deepspeed jieba nltk rouge_chinese; then
  install_wheels "$S/pip.log" || { say "pip install failed"; tail -20 "$S/pip.log" | tee -a "$LOG"; exit 1; }
  # --no-compile install: compile the bytecode beside the first pipeline, not in each stage.
  python3 -m compileall -q -j 0 /tmp/site >"$S/compileall.log" 2>&1 &
  say "wheels installed"
fi
use_image_python
HW=(--set hardware.gpus_per_node=1 --set hardware.processes_per_node=0 --set sft.precision=bf16)
if [ "${CONTINUE_DEVICE:-gpu}" = cpu ]; then
  HW=(--set hardware.gpus_per_node=0 --set hardware.processes_per_node=2)
  export CUDA_VISIBLE_DEVICES=""
fi
say "python: $(command -v python) $(python -c 'import sys, torch, transformers, snakemake, deepspeed, llamafactory; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "snakemake", snakemake.__version__, "deepspeed", deepspeed.__version__, "llamafactory", llamafactory.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tail -1)"
left=$((DEADLINE - $(el)))
CMD=(python3 bench/continue_bench.py --scratch "$S/work" --keep --deadline $((left - ${CONTINUE_RUN_S:-150}))
  "${HW[@]}" "$@" --out "$OUT/continue.json")
say "\$ timeout -s INT -k 20 $left ${CMD[*]}"
set -o pipefail
timeout -s INT -k 20 "$left" "${CMD[@]}" 2>&1 | tee -a "$LOG"
rc=$?
say "bench exit $rc"
pack
exit $rc
