#!/bin/bash
# GPU held-out evaluation bench, one device run (nvidia-h200-x2, ~200 s): llmft evaluate vs
# LLaMA-Factory's do_predict + predict_with_generate on a random-init 1.24 B Llama, bf16, both GPUs.
#   bash bench/eval_gpu.sh
#   ONLY=batched DEADLINE=400 bash bench/eval_gpu.sh   # one comparison, with the whole deadline
# Two comparisons, each one bench/eval.py run (same rows for every tool in it):
#   bs1:     LLaMA-Factory at batch 1 (its example predict config) vs ours on the held-out rows, both
#            in fp32 (BS1_PRECISION): greedy outputs then do not depend on the batch a row lands in
#            (in bf16 a random-init model's near-flat logits flip; it generates one row at a time:
#            rows x new tokens x ~25 ms);
#   batched: a generation-heavy set (train rows: the held-out split has only 83) at batch 64 on both
#            sides, ours as configured by default (eval.decoding auto: llmft's CUDA-graph loop on
#            GPUs), then ours with transformers' dynamic cache (as LLaMA-Factory) if time is left.
# Ours runs with the config default (auto) unless --ours-decoding says otherwise.
# Needs, carried from the checkout: .whl/ (the wheels bench/sft_gpu.sh installs, plus jieba, nltk,
# rouge-chinese and defusedxml: LLaMA-Factory's predict_with_generate refuses to start without them)
# and bench/work/sft/ (tok/ and data/, made as bench/sft_gpu.sh says). Results: $OUT/eval-gpu.json (both comparisons),
# $OUT/eval-gpu-{bs1,batched}.json, $OUT/eval_gpu.log, $OUT/eval_runs.tar.gz (every tool's log).
# BENCH_DRY_RUN=1: the same path on this machine's venv (CPU, the tiny model shape), before device time.
set -u
source "$(dirname "$0")/gpu_common.sh"
DEADLINE=${DEADLINE:-200}
OUT=${OUT:-/tmp/out}
R=${BENCH_OUT:-/tmp/eval_bench}
MODELS=${BENCH_MODELS:-/tmp/models}
DRY=${BENCH_DRY_RUN:-}
# Rows x new tokens of each comparison (the dry run keeps the same shape, smaller).
BS1_ROWS=${BS1_ROWS:-32} BS1_TOKENS=${BS1_TOKENS:-32} BS1_PRECISION=${BS1_PRECISION:-fp32}
BATCH_ROWS=${BATCH_ROWS:-256} BATCH_TOKENS=${BATCH_TOKENS:-64}
ONLY=${ONLY:-bs1 batched}  # which comparisons to run, e.g. ONLY=batched to give it the whole deadline
mkdir -p "$R" "$OUT" "$MODELS"
say() { echo "[t=$(el)s] $*" | tee -a "$R/eval_gpu.log"; }
pack() {
  tar czf "$OUT/eval_runs.tar.gz" -C "$R" . 2>/dev/null
  cp "$R/eval_gpu.log" "$OUT/" 2>/dev/null
}

if [ -z "$DRY" ]; then
  # A warm machine may hold the SFT bench's install without predict's extras: check for them too.
  if wheels_missing jieba rouge_chinese; then
    install_wheels "$R/pip.log" || { say "pip install failed"; tail -20 "$R/pip.log"; pack; exit 1; }
    # The wheels go in without bytecode: compile it now, or whichever tool runs first on a fresh
    # machine pays for compiling transformers & co. inside its timed start-up.
    python3 -m compileall -q -j 0 /tmp/site >"$R/compileall.log" 2>&1 || true
    say "bytecode compiled"
  fi
  site_first
  SIZE=1b
else
  export PYTHONPATH=$PWD/workflow
  export CUDA_VISIBLE_DEVICES=""
  SIZE=tiny
fi
say "wheels ready; $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tail -1)"

M=$MODELS/llama$SIZE
if [ ! -f "$M/config.json" ]; then
  timeout 90 python3 bench/sft_models.py model $SIZE "$M" bench/work/sft/tok --device cuda >"$R/model.log" 2>&1 ||
    { say "model build failed"; tail -20 "$R/model.log"; pack; exit 1; }
fi
say "model $SIZE: $(tail -1 "$R/model.log" 2>/dev/null)"

# bench NAME ROWS_FILE ROWS TOKENS EST_SECONDS MAX_SECONDS ARGS...: one bench/eval.py run within
# what is left of the deadline and at most MAX_SECONDS.
bench() {
  local name=$1 rows_file=$2 rows=$3 tokens=$4 est=$5 most=$6
  shift 6
  case " $ONLY " in *" $name "*) ;; *) return ;; esac
  local left=$((DEADLINE - $(el)))
  if [ "$left" -lt "$est" ]; then say "SKIP $name (${left}s left < ${est}s estimated)"; return; fi
  [ "$left" -gt "$most" ] && left=$most
  python3 bench/eval.py --model "$M" --heldout "$rows_file" --template default --max-rows "$rows" \
    --max-new-tokens "$tokens" --batch-size 64 --repeats 1 --min-match 0 --budget "$left" \
    --out "$OUT/eval-gpu-$name.json" "$@" >"$R/bench-$name.log" 2>&1
  say "$name (rc $?): $(grep -E '^\[bench\] (ours|vs|LLaMA|saved)' "$R/bench-$name.log" | cut -c1-400)"
  [ -f "$OUT/eval-gpu-$name.json" ] || tail -30 "$R/bench-$name.log" | tee -a "$R/eval_gpu.log"
  cp -r "$(sed -n 's/^\[bench\] .* work dir \(.*\)$/\1/p' "$R/bench-$name.log")" "$R/work-$name" 2>/dev/null
  pack
}

# Estimates (2 x H200): ~15 s start-up per LLaMA-Factory run, ~10 s per ours, ~25 ms per decoding
# step at batch 1; the compiled variants add their compile time (seconds for CUDA graphs, tens of
# seconds for inductor) and go last, within the budget.
bench bs1 bench/work/sft/data/heldout.jsonl "$BS1_ROWS" "$BS1_TOKENS" 45 "${BS1_MAX:-80}" --lf-batch-size 1 \
  --precision "$BS1_PRECISION"
bench batched bench/work/sft/data/train.jsonl "$BATCH_ROWS" "$BATCH_TOKENS" 45 999 --lf-batch-size 64 \
  --ours-decoding auto --ours-decoding dynamic

python3 - "$OUT" "$(el)" <<'PY' 2>&1 | tee -a "$R/eval_gpu.log"
import json, os, sys
from pathlib import Path
out = Path(sys.argv[1])
parts = {p.stem.removeprefix("eval-gpu-"): json.loads(p.read_text()) for p in sorted(out.glob("eval-gpu-*.json"))}
summary = {}
for name, r in parts.items():
    summary[name] = {
        "rows": r["rows"], "max_new_tokens": r["max_new_tokens"], "precision": r.get("precision"),
        "timed_out": r["timed_out"],
        "ours": {k: {x: v.get(x) for x in ("decoding_ran", "median_wall_s", "median_eval_s", "median_generate_s",
                                           "median_first_batch_s", "identical_to_ours")}
                 for k, v in r["ours_variants"].items()},
        "llamafactory": {k: {x: v.get(x) for x in v if x.startswith(("ratio", "identical_rows", "median", "match"))}
                         for k, v in r["llamafactory"].items()},
    }
result = {"bench": "bench/eval_gpu.sh", "dry_run": bool(os.environ.get("BENCH_DRY_RUN")),
          "total_seconds": int(sys.argv[2]), "summary": summary, "runs": parts}
(out / "eval-gpu.json").write_text(json.dumps(result, indent=1))
print(json.dumps(summary, indent=1))
PY
say "done"
pack
