#!/bin/bash
# The planner's step-time estimate against measured steps, one device run (nvidia-h200, ~7 min):
# a random-init 4.5 B Llama (bench/sft_models.py 4b5) trained a few steps three ways (the planner's
# choice, gradient checkpointing, ZeRO-3 + CPU offload) by bench/steptime_check.py.
#   bash bench/steptime_gpu.sh
# Needs, carried from the checkout: .whl/ (as bench/pipeline_gpu.sh) and bench/work/pipeline/tok/.
# DeepSpeed's CPU Adam (offload) is JIT-built in the background while the other plans train.
# Results in $OUT: steptime_check_h200.json, steptime_gpu.log, steptime_runs.tar.gz (logs, YAMLs).
# Knobs: STEPTIME_SIZE (a bench/sft_models.py shape, default 4b5), STEPTIME_PLANS (before CPU Adam
# is built, default auto,recompute), STEPTIME_OFFLOAD=0 (skip the offload plan).
set -u
cd "$(dirname "$0")/.."
SIZE=${STEPTIME_SIZE:-4b5}
PLANS=${STEPTIME_PLANS:-auto,recompute}
source bench/gpu_common.sh
OUT=${OUT:-/tmp/out}
R=/tmp/steptime
mkdir -p "$R" "$OUT"
LOG=$R/steptime_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
pack() {
  [ -f "$R/result.json" ] && cp "$R/result.json" "$OUT/steptime_check_h200.json"
  cp "$LOG" "$OUT/"
  tar czf "$OUT/steptime_runs.tar.gz" --exclude='model' --exclude='w' --exclude='data' \
    --exclude='rows.json' -C "$R" . 2>/dev/null
}
use_wheels "$R/pip.log" liger_kernel jsonschema deepspeed || { say "pip install failed"; pack; exit 1; }
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
say "wheels installed; building DeepSpeed CPU Adam in the background"
(python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" >"$R/cpu_adam_build.log" 2>&1; echo "rc $?" >>"$R/cpu_adam_build.log") &
BUILD=$!
df -h /tmp | tail -1 >>"$LOG"
[ -f "$R/rows.json" ] || python3 bench/sft_models.py data "$R/rows.json" --rows 3000 >>"$LOG" 2>&1
[ -f "$R/model/config.json" ] || python3 bench/sft_models.py model "$SIZE" "$R/model" bench/work/pipeline/tok >>"$LOG" 2>&1
say "model: $(cat "$R/model/param_count.json" 2>/dev/null)"
timeout 400 python3 bench/steptime_check.py --model "$R/model" --data "$R/rows.json" --work "$R" \
  --out "$R/result.json" --steps 8 --only "$PLANS" >>"$LOG" 2>&1
say "$PLANS done"
wait $BUILD
say "cpu adam: $(tail -1 "$R/cpu_adam_build.log")"
[ "${STEPTIME_OFFLOAD:-1}" = 0 ] || timeout 240 python3 bench/steptime_check.py --model "$R/model" --data "$R/rows.json" --work "$R" \
  --out "$R/result_offload.json" --steps 6 --only offload >>"$LOG" 2>&1
python3 - "$R" <<'PY' >>"$LOG" 2>&1
import json, sys
r = sys.argv[1]
a = json.load(open(f"{r}/result.json"))
try:
    b = json.load(open(f"{r}/result_offload.json"))
    a["runs"].update(b["runs"])
except (OSError, ValueError) as exc:
    print("no offload result:", exc)
done = {n: x for n, x in a["runs"].items() if (x.get("measured") or {}).get("median_step_s")}
est = sorted(done, key=lambda n: done[n]["predicted"]["total_s"])
meas = sorted(done, key=lambda n: done[n]["measured"]["median_step_s"])
a["ranking"] = {"estimated": est, "measured": meas, "agree": est == meas}
json.dump(a, open(f"{r}/result.json", "w"), indent=1)
for n, x in a["runs"].items():
    print(n, x["settings"], "predicted", x["predicted"]["total_s"], "measured", (x.get("measured") or {}).get("median_step_s"), "err", x.get("estimate_error"))
print(a["ranking"])
PY
say "done"
pack
