#!/bin/bash
# The whole llmft pipeline (verify_env, prepare_data, sft, evaluate, report) through
# `snakemake --profile profiles/local` on one device run (nvidia-h200, ~6-8 min), on a random-init
# 1.24 B Llama (bench/sft_models.py) and synthetic alpaca rows, config bench/configs/pipeline_h200.yaml.
#   bash bench/pipeline_gpu.sh
#   PIPELINE_DRY_RUN=1 bash bench/pipeline_gpu.sh   # the same path here: .venv, CPU, tiny model
# Needs, carried from the checkout: .whl/ (LLaMA-Factory 0.9.5 + DeepSpeed + liger-kernel +
# Snakemake 9.27.1 and every wheel they need that the device image lacks) and bench/work/pipeline/
# (tok/ alone: the byte-level BPE tokenizer, the same as bench/work/sft/tok). The data and the
# model are made on the machine, in bench/work/pipeline_gen/ (alpaca_synth.json, llama1b/), which is
# not carried: a warm machine keeps and reuses them.
# Results in $OUT: llamafactory.yaml, train_summary.json, verify.json, summary.json (results/$RUN/...),
# pipeline_gpu.log (this driver's log: stage times, plan) and pipeline_logs.tar.gz (results/$RUN/logs,
# benchmarks, metrics, stats, the Snakemake log, pip/model logs).
# Knobs: DEADLINE (s, default 540), PIPELINE_RUN (run name, default h200_pipeline; h200_pipeline_dry
# in a dry run),
# PIPELINE_GPU_SERIAL=0 (let Snakemake run the GPU stages side by side on the one GPU: by default
# verify_env, sft and evaluate get gpu=1 of --resources gpu=1, so timings and verify's GEMM floor are
# not disturbed by a concurrent evaluation), PIPELINE_KEEP=1 (keep results/$RUN of an earlier call).
set -u
cd "$(dirname "$0")/.."
source bench/gpu_common.sh
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/out}
DRY=${PIPELINE_DRY_RUN:-}
RUN=${PIPELINE_RUN:-h200_pipeline${DRY:+_dry}}
CFG=bench/configs/pipeline_h200.yaml
W=bench/work/pipeline
G=bench/work/pipeline_gen
R=${PIPELINE_SCRATCH:-/tmp/pipeline_bench}
rm -rf "$R"
mkdir -p "$R" "$OUT" "$G"
LOG=$R/pipeline_gpu.log
say() { echo "[t=$(el)s] $*" | tee -a "$LOG"; }
pack() {
  local d=results/$RUN
  for f in sft/llamafactory.yaml sft/train_summary.json env/verify.json report/summary.json; do
    [ -f "$d/$f" ] && cp "$d/$f" "$OUT/"
  done
  local smk
  smk=$(ls -t .snakemake/log/*.snakemake.log 2>/dev/null | head -1)
  [ -n "$smk" ] && cp "$smk" "$R/snakemake_main.log"
  local extra=()
  for f in logs benchmarks data/stats.json eval/base/metrics.json eval/tuned/metrics.json \
    sft/deepspeed.json report/heldout_metrics.tsv report/samples.tsv; do
    [ -e "$d/$f" ] && extra+=("$d/$f")
  done
  tar czf "$OUT/pipeline_logs.tar.gz" "${extra[@]}" -C "$R" . 2>/dev/null
  cp "$LOG" "$OUT/"
}
[ -f "$CFG" ] || { say "no $CFG"; exit 1; }
[ -f "$W/tok/tokenizer.json" ] || { say "no $W/tok (carry bench/work/pipeline)"; pack; exit 1; }

if [ -z "$DRY" ]; then
  if wheels_missing snakemake liger_kernel jsonschema deepspeed; then
    install_wheels "$R/pip.log" || { say "pip install failed"; tail -20 "$R/pip.log"; pack; exit 1; }
    # --no-compile install: compile the bytecode now, beside the model build (GPU-bound), instead of
    # in the first stage that imports transformers & co.
    python3 -m compileall -q -j 0 /tmp/site >"$R/compileall.log" 2>&1 &
    COMPILE_PID=$!
    say "wheels installed"
  fi
  use_image_python
  SIZE=1b DEVICE=cuda CORES=${PIPELINE_CORES:-16}
else
  export PYTHONPATH=$PWD/workflow
  export PATH=$PWD/.venv/bin:$PATH CUDA_VISIBLE_DEVICES=""
  SIZE=tiny DEVICE=cpu CORES=${PIPELINE_CORES:-$(nproc)}
fi
say "python: $(command -v python) $(python -c 'import sys, torch, transformers, snakemake; print(sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__, "snakemake", snakemake.__version__, "gpus", torch.cuda.device_count())' 2>&1 | tail -1)"

# Inputs: 6000 synthetic alpaca rows (deterministic, ~2 s; ~2.2 M train tokens, more than 60 steps x 32 k) and the random-init model (1b: ~20 s on a GPU).
if [ ! -f "$G/alpaca_synth.json" ]; then
  python bench/sft_models.py data "$G/alpaca_synth.json" --rows 6000 >"$R/data.log" 2>&1 ||
    { say "data failed"; tail -20 "$R/data.log"; pack; exit 1; }
fi
say "data: $(tail -1 "$R/data.log" 2>/dev/null || echo "kept $G/alpaca_synth.json")"
M=$G/llama$SIZE
if [ ! -f "$M/config.json" ] || ! grep -q "\"size\": \"$SIZE\"" "$M/param_count.json" 2>/dev/null; then
  rm -rf "$M"
  timeout 240 python bench/sft_models.py model $SIZE "$M" "$W/tok" --device $DEVICE >"$R/model.log" 2>&1 ||
    { say "model build failed"; tail -20 "$R/model.log"; pack; exit 1; }
  say "model $SIZE: $(tail -1 "$R/model.log")"
else
  say "model $SIZE: kept $M ($(cat "$M/param_count.json"))"
fi
if [ -n "${COMPILE_PID:-}" ]; then wait "$COMPILE_PID"; say "bytecode compiled"; fi

CFGS=("$CFG")
# PIPELINE_CONFIGS: more --configfile overlays (space-separated), e.g. the benchmarks overlay.
for c in ${PIPELINE_CONFIGS:-}; do CFGS+=("$c"); done
if [ -n "$DRY" ]; then
  # The GPU config, made to fit this machine: CPU processes, fp32, the tiny model (which still has
  # the 128 k vocabulary: small batches and rows), a few steps, few held-out rows (LLaMA-Factory also
  # evaluates the whole held-out split inside sft). A second
  # --configfile, since --config would pass nested values as strings.
  cat >"$G/dry_overrides.yaml" <<EOF
hardware: {vendor: cpu, gpus_per_node: 0, processes_per_node: 2}
model: {name_or_path: $M}
data: {cutoff_len: 512, heldout_fraction: 0.02, max_dropped_fraction: 0.99}
sft: {precision: fp32, per_device_train_batch_size: 2, gradient_accumulation_steps: 1, max_steps: 3, logging_steps: 1}
eval: {max_rows: 8, batch_size: 8, max_new_tokens: 8}
EOF
  CFGS+=("$G/dry_overrides.yaml")
fi
if [ "${PIPELINE_KEEP:-0}" != 1 ]; then rm -rf "results/$RUN"; fi

# The planner's choices for this config, before anything runs (the run's own render log has them too).
python - "${CFGS[@]}" >"$R/plan.txt" 2>&1 <<'PY'
import subprocess, sys, yaml
from llmft.core.config import deep_merge
cfg = {}
for path in ["config/config.yaml", *sys.argv[1:]]:  # Snakemake's merge order
    cfg = deep_merge(cfg, yaml.safe_load(open(path)))
open("/tmp/pipeline_plan_cfg.yaml", "w").write(yaml.safe_dump(cfg))
sys.exit(subprocess.run([sys.executable, "-m", "llmft", "plan", "--config", "/tmp/pipeline_plan_cfg.yaml"]).returncode)
PY
say "plan (exit $?): $(tr '\n' ' ' <"$R/plan.txt" | tr -s ' ' | head -c 1500)"

SMK=(snakemake --profile profiles/local --configfile "${CFGS[@]}" --config run=$RUN --cores "$CORES")
if [ "${PIPELINE_GPU_SERIAL:-1}" = 1 ]; then
  SMK+=(--resources gpu=1 --set-resources verify_env:gpu=1 sft:gpu=1 evaluate:gpu=1 benchmarks:gpu=1)
fi
left=$((DEADLINE - $(el) - 20))
say "\$ timeout -s INT -k 30 $left ${SMK[*]}"
S0=$(date +%s)
timeout -s INT -k 30 "$left" "${SMK[@]}" >"$R/snakemake.log" 2>&1
rc=$?
say "snakemake exit $rc after $(($(date +%s) - S0)) s"
[ $rc -ne 0 ] && tail -40 "$R/snakemake.log" | tee -a "$LOG"
for w in base tuned; do
  f=results/$RUN/bench/$w/scores.json
  [ -f "$f" ] && cp "$f" "$R/bench_${w}_scores.json" && say "bench $w: $(tr -d '\n' <"$f" | tr -s ' ' | head -c 700)"
done
# PIPELINE_BENCH_HF=1: both models' benchmarks again through lm-eval's `hf` backend, same call.
if [ $rc -eq 0 ] && [ "${PIPELINE_BENCH_HF:-0}" = 1 ]; then
  S1=$(date +%s)
  timeout -s INT -k 30 $((DEADLINE - $(el) - 20)) "${SMK[@]}" --configfile "${CFGS[@]}" \
    bench/configs/pipeline_h200_benchmarks_hf.yaml -- "results/$RUN/benchmarks/base/scores.json" \
    "results/$RUN/benchmarks/tuned/scores.json" >"$R/snakemake_hf.log" 2>&1
  say "hf benchmarks: exit $? after $(($(date +%s) - S1)) s"
  for w in base tuned; do
    f=results/$RUN/bench/$w/scores.json
    [ -f "$f" ] && cp "$f" "$R/bench_${w}_scores_hf.json" && say "bench $w (hf): $(tr -d '\n' <"$f" | tr -s ' ' | head -c 700)"
  done
fi

# Stage times: each job's start and end from Snakemake's log, and the benchmark files' wall seconds.
python - "$R/snakemake.log" "results/$RUN/timings" "$S0" <<'PY' 2>&1 | tee -a "$LOG"
import csv, glob, os, re, sys
from datetime import datetime
log, timings, s0 = sys.argv[1], sys.argv[2], int(sys.argv[3])
stamp = re.compile(r"^\[(\w{3} \w{3} +\d+ \d\d:\d\d:\d\d \d{4})\]")
rule = re.compile(r"^(?:local)?(?:checkpoint|rule) (\w+):")
jobid = re.compile(r"^\s+jobid: (\d+)")
which = re.compile(r"^\s+wildcards: .*which=(\w+)")
done = re.compile(r"Finished jobid: (\d+)(?: \(Rule: (\w+)\))?")
t, pending, last, start, name, end = None, None, None, {}, {}, {}
for line in open(log, errors="replace"):
    if m := stamp.match(line):
        t = datetime.strptime(" ".join(m.group(1).split()), "%a %b %d %H:%M:%S %Y").timestamp()
    elif m := rule.match(line):
        pending = m.group(1)
    elif (m := jobid.match(line)) and pending:
        start[m.group(1)], name[m.group(1)], pending, last = t, pending, None, m.group(1)
    elif (m := which.match(line)) and last:
        name[last] += "_" + m.group(1)
    elif m := done.search(line):
        end[m.group(1)] = t
print("stage               start_s  end_s  wall_s   (seconds after snakemake started)")
for j in sorted(start, key=lambda j: start[j] or 0):
    a, b = start[j], end.get(j)
    if a is None:
        continue
    print(f"{name[j]:<18} {a - s0:7.0f} {'' if b is None else f'{b - s0:6.0f}':>6} "
          f"{'unfinished' if b is None else f'{b - a:7.0f}'}")
for f in sorted(glob.glob(os.path.join(timings, "*.tsv"))):
    rows = list(csv.DictReader(open(f), delimiter="\t"))
    if rows:
        r = rows[-1]
        print(f"benchmark {os.path.basename(f)[:-4]}: {float(r['s']):.1f} s wall, max_rss {r.get('max_rss')} MB")
PY
# The page's MFU against the bench's own count for this run (bench/sft_bench.py: the train rows'
# lengths re-measured with its tokenizer pass), and the tuned folder's parameters against the base's.
python - "results/$RUN" "$M" >"$OUT/flops_check.json" 2>"$R/flops_check.log" <<'PY'
import json, sys
from pathlib import Path
import yaml
sys.path.insert(0, ".")
from bench.sft_bench import run_flops, token_lengths
from llmft.core import flops
from llmft.core.modelfiles import safetensors_stats
run, base = Path(sys.argv[1]), Path(sys.argv[2])
page = json.loads((run / "report/summary.json").read_text())
args = yaml.safe_load((run / "sft/llamafactory.yaml").read_text())
bench = run_flops(args, base, token_lengths(run / "data", str(base)))
tps, peak = page["tokens_per_second_per_gpu"], page["peak_tflops"]
print(json.dumps({
    "page_mfu": page["mfu"], "bench_mfu_at_page_tokens_per_s": round(flops.mfu(tps, bench.total, peak), 4),
    "page_flops_per_token": page["flops_per_token"], "bench_flops_per_token": round(bench.total),
    "page_span": page["attention_span_tokens"], "bench_span": round(bench.span, 2),
    "tuned_params": safetensors_stats(run / "sft/model"), "base_params": safetensors_stats(base),
    "page_n_params": page["n_params"],
}, indent=2))
PY
say "flops check: $(tr -d '\n' <"$OUT/flops_check.json" | tr -s ' ' | head -c 900) $(tail -3 "$R/flops_check.log")"
for f in results/$RUN/sft/train_summary.json results/$RUN/report/summary.json; do
  [ -f "$f" ] && say "$f: $(tr -d '\n' <"$f" | tr -s ' ' | head -c 1200)"
done
say "done (snakemake exit $rc)"
pack
exit $rc
