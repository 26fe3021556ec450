#!/bin/bash
# The stack quarantine's cost on one GPU (nightly.on_stack_change: quarantine), one device call
# (nvidia-h200 or nvidia-h100-x1, ~4 min): `llmft verify-env` three times on the same node, as a night
# runs it:
#   plain      no nightly.compare_with: verify_env as every run has it (facts, GEMM floor, canary)
#   changed    nightly.compare_with a promoted run recorded on another stack: verify_env and the
#              quarantine's four checks (accumulation and resume parity, the canary's legs, the
#              promoted model's scores again)
#   unchanged  the same promoted run, its recorded stack now this node's (what `changed` measured):
#              verify_env decides "unchanged" and runs no check
# The promoted run is the CPU demo's (a copy of results/demo: its tiny model, held-out rows and
# scores), carried in bench/work/quarantine/demo and copied to results/demo here (its evaluation names
# its model relative to the repository).
#   WHEELS=bench/work/whl bash bench/quarantine_gpu.sh     # carry bench/work/whl, bench/work/quarantine
# Results in $OUT: quarantine.json (each leg's wall seconds, the quarantine's per-check seconds and
# verdict), quarantine_gpu.log, verify_<leg>.json.
set -u
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
OUT=${OUT:-/tmp/out}
R=/tmp/quarantine_bench
mkdir -p "$R" "$OUT"
LOG=$OUT/quarantine_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
use_wheels "$R/pip.log" jsonschema jieba nltk rouge_chinese >>"$LOG" || { say "pip install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$LOG" 2>&1
rm -rf results/demo && mkdir -p results && cp -r bench/work/quarantine/demo results/demo
leg() {  # leg NAME OVERRIDES_JSON: one verify-env, its wall time in $R/NAME.wall
  local name=$1 over=$2 s
  s=$(date +%s.%N)
  python3 -m llmft verify-env --config config/config.yaml --overrides "$over" \
    --out "$OUT/verify_$name.json" >"$R/$name.log" 2>&1
  echo "exit $?" >>"$R/$name.log"
  python3 -c "print(round($(date +%s.%N) - $s, 1))" >"$R/$name.wall"
  say "$name: $(tail -1 "$R/$name.log"), $(cat "$R/$name.wall") s"
  cat "$R/$name.log" >>"$LOG"
}
HW='"hardware": {"gpus_per_node": 1, "processes_per_node": 0}'
leg plain "{$HW}"
leg changed "{$HW, \"nightly\": {\"compare_with\": \"results/demo\"}}"
# the promoted run's recorded stack becomes this node's: the next night's stack is unchanged
python3 - "$OUT/verify_changed.json" <<'PY'
import json, sys
from pathlib import Path
stack = json.loads(Path(sys.argv[1]).read_text())["stack"]
for rel in ("report/summary.json", "env/verify.json"):
    p = Path("results/demo") / rel
    p.write_text(json.dumps({**json.loads(p.read_text()), "stack": stack}))
PY
leg unchanged "{$HW, \"nightly\": {\"compare_with\": \"results/demo\"}}"
python3 - "$R" "$OUT" <<'PY' | tee -a "$LOG"
import json, sys
from pathlib import Path
r, out = Path(sys.argv[1]), Path(sys.argv[2])
legs = {}
for name in ("plain", "changed", "unchanged"):
    report = out / f"verify_{name}.json"
    data = json.loads(report.read_text()) if report.exists() else {}
    q = data.get("quarantine") or {}
    nodes = q.get("nodes") or {}
    legs[name] = {
        "wall_s": float((r / f"{name}.wall").read_text()),
        "verify_ok": data.get("ok"),
        "quarantine_status": q.get("status"),
        "quarantine_message": q.get("message"),
        "quarantine_seconds": {h: n.get("seconds") for h, n in nodes.items()},
        "check_seconds": {
            h: {c: v.get("seconds") for c, v in (n.get("checks") or {}).items()} for h, n in nodes.items()
        },
        "checks_ok": {h: {c: v.get("ok") for c, v in (n.get("checks") or {}).items()} for h, n in nodes.items()},
    }
result = {
    "bench": "bench/quarantine_gpu.sh",
    "legs": legs,
    "quarantine_cost_s": round(legs["changed"]["wall_s"] - legs["plain"]["wall_s"], 1),
    "unchanged_cost_s": round(legs["unchanged"]["wall_s"] - legs["plain"]["wall_s"], 1),
    "formula": "cost = a leg's verify-env wall seconds - the plain leg's, same node, same call",
}
(out / "quarantine.json").write_text(json.dumps(result, indent=1))
print(json.dumps(result, indent=1))
PY
rm -rf results/demo
