#!/bin/bash
# FP8 benchmark on one H200 (device kind nvidia-h200), issue 33; each comparison is one call:
#   bash bench/sft_fp8_gpu.sh lora1b     # LoRA 1.24 B: llmft auto vs hand-tuned bf16 vs LLaMA-Factory fp8: true
#   bash bench/sft_fp8_gpu.sh lora8b     # the same at 8 B
#   bash bench/sft_fp8_gpu.sh full1b     # full 1.24 B: llmft auto vs hand-tuned vs llmft's bf16 plan
#   bash bench/sft_fp8_gpu.sh full1b_compile  # full 1.24 B FP8 and bf16 with compiled decoder layers vs the bf16 plan
#   bash bench/sft_fp8_gpu.sh acc_full   # 300 steps full 1.24 B, FP8 vs bf16: train and held-out loss
#   bash bench/sft_fp8_gpu.sh acc_lora   # the same for LoRA
#   bash bench/sft_fp8_gpu.sh prof8b     # LoRA 8 B, FP8 and llmft's bf16 plan under torch.profiler (steps 6-7)
#   bash bench/sft_fp8_gpu.sh levers8b   # LoRA 8 B: llmft's bf16 plan, FP8, FP8 with Inductor's C++ wrapper
#   bash bench/sft_fp8_gpu.sh zero8b     # LoRA 8 B FP8: ZeRO-2 (the plan's stage) vs no DeepSpeed vs hand-tuned bf16
#   bash bench/sft_fp8_gpu.sh zero1b     # LoRA 1.24 B compiled: ZeRO-2 vs none, bf16 and FP8, vs hand-tuned bf16
#   bash bench/sft_fp8_gpu.sh auto8b     # LoRA 8 B all auto vs hand-tuned, vs llmft's bf16 plan, vs LLaMA-Factory fp8
#   bash bench/sft_fp8_gpu.sh once8b     # LoRA 8 B FP8: frozen weights cast once vs torchao's per-step casts vs hand-tuned
#   bash bench/sft_fp8_gpu.sh check8b    # LoRA 8 B all auto vs hand-tuned vs torchao's casts
#   bash bench/sft_fp8_gpu.sh proffp8    # LoRA 8 B FP8 alone under torch.profiler (table and timeline)
#   bash bench/sft_fp8_gpu.sh lora2      # LoRA 8 B all auto vs hand-tuned, then the same at 1.24 B (FP8 pinned)
#   bash bench/sft_fp8_gpu.sh count8b    # LoRA 8 B all auto: tokens counted on the host vs read from the GPU, vs hand-tuned
#   bash bench/sft_fp8_gpu.sh ce8b       # LoRA 8 B all auto (llmft's fused loss) vs hand-tuned, vs Liger's fused loss
#   bash bench/sft_fp8_gpu.sh ce1b       # the same at 1.24 B (FP8 pinned)
#   bash bench/sft_fp8_gpu.sh ce1b_prof  # ce1b, then LoRA 8 B FP8 under torch.profiler (proffp8)
#   bash bench/sft_fp8_gpu.sh plain8b    # LoRA 8 B all auto vs the hand-tuned run on LLaMA-Factory's own kernels
#   bash bench/sft_fp8_gpu.sh cefull1b   # full 1.24 B bf16 plan: llmft's fused loss on the trainable head vs Liger's
#   bash bench/sft_fp8_gpu.sh log8b      # plain8b with both runs logging every 10 steps (the workflow's default)
#   bash bench/sft_fp8_gpu.sh proffull1b # full 1.24 B compiled, bf16 and FP8 under torch.profiler, then cefull1b
#   bash bench/sft_fp8_gpu.sh static1b   # full 1.24 B compiled, every micro-batch one shape: FP8, bf16, vs the bf16 plan
#   bash bench/sft_fp8_gpu.sh full1b_auto # full 1.24 B at 16 384 tokens a step: auto vs bf16 plan vs hand-tuned (with and without Liger)
#   bash bench/sft_fp8_gpu.sh acc_auto   # 300 steps full and LoRA 1.24 B, every key auto vs bf16: train and held-out loss
#   bash bench/sft_fp8_gpu.sh lora_static # LoRA 1.24 B and 8 B: one shape + tuned kernels vs the auto plan
#   bash bench/sft_fp8_gpu.sh cdt1b      # static1b's FP8 run with Inductor's kernel tuning, vs the bf16 plan
# Carry .whl (with torchao-0.17.0) and bench/work/sft, as bench/sft_gpu.sh needs. BENCH_CANARY=1 runs
# the numerics canary (with its FP8 leg) into the node facts, so `auto` decides FP8 as the workflow
# does. Results: $OUT/sft_fp8_h200x1_<which>.json and bench/sft_gpu.sh's own files.
set -u
which=${1:?usage: bash bench/sft_fp8_gpu.sh lora1b|lora8b|full1b|full1b_compile|acc_full|acc_lora|prof8b|levers8b|zero8b|zero1b|auto8b|once8b|check8b|proffp8|lora2|count8b|ce8b|ce1b|ce1b_prof|plain8b|cefull1b|log8b|proffull1b|static1b|cdt1b|full1b_auto|acc_auto|lora_static}
case $which in
  lora1b) specs="fp8_lora_hand_1b:60 fp8_lora_auto_1b:80 fp8_lora_lf_1b:60" ;;
  lora8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_lf_8b:110" ;;
  full1b) specs="fp8_full_hand_1b:70 fp8_full_bf16_1b:70 fp8_full_auto_1b:200" ;;
  full1b_compile) specs="fp8_full_bf16_1b:70 fp8_full_compile_1b:120 fp8_full_bf16c_1b:100" ;;
  acc_full) specs="acc_full_bf16_1b:230 acc_full_fp8_1b:230" ;;
  acc_lora) specs="acc_lora_bf16_1b:200 acc_lora_fp8_1b:200" ;;
  prof8b) specs="fp8_lora_prof_8b:150 lora_prof_8b:120" ;;
  levers8b) specs="lora_compile_8b:120 fp8_lora_py_8b:140 fp8_lora_cpp_8b:150" ;;
  zero8b) specs="fp8_lora_hand_8b:110 fp8_lora_py_8b:130 fp8_lora_z0_8b:130" ;;
  zero1b) specs="fp8_lora_hand_1b:60 lora_compile_1b:90 lora_compile0_1b:90 fp8_lora_z0_1b:100" ;;
  auto8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_bf16_8b:120 fp8_lora_lf_8b:70" ;;
  once8b) specs="fp8_lora_hand_8b:110 fp8_lora_ao_8b:130 fp8_lora_py_8b:130" ;;
  check8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_ao_8b:130" ;;
  proffp8) specs="fp8_lora_prof_8b:150" ;;
  count8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_devcount_8b:140" ;;
  ce8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_ligerce_8b:140" ;;
  ce1b) specs="fp8_lora_hand_1b:60 fp8_lora_auto_1b:80 fp8_lora_ligerce_1b:80" ;;
  ce1b_prof) specs="fp8_lora_hand_1b:60 fp8_lora_auto_1b:80 fp8_lora_ligerce_1b:80 fp8_lora_prof_8b:150" ;;
  plain8b) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140" ;;
  cefull1b) specs="fp8_full_bf16_1b:85 fp8_full_fusedce_1b:85" ;;
  proffull1b) specs="full_bf16c_prof_1b:90 fp8_full_prof_1b:110 fp8_full_bf16_1b:85 fp8_full_fusedce_1b:85" ;;
  static1b) specs="fp8_full_static_1b:90 full_bf16c_static_1b:80 fp8_full_bf16_1b:70" ;;
  cdt1b) specs="fp8_full_static_cdt_1b:130 fp8_full_bf16_1b:70" ;;
  log8b) specs="fp8_lora_hand_8b_log10:120 fp8_lora_auto_8b_log10:150" ;;
  lora2) specs="fp8_lora_hand_8b:110 fp8_lora_auto_8b:140 fp8_lora_hand_1b:60 fp8_lora_auto_1b:80" ;;
  full1b_auto) specs="full_auto_1b:200 fp8_full_hand_1b:70 full_bf16_1b:60 full_handliger_1b:70" ;;
  acc_auto) specs="acc_full_auto_1b:200 acc_full_bf16_1b:140 acc_lora_auto_1b:150 acc_lora_bf16_1b:120" ;;
  lora_static) specs="lora_static_1b:130 fp8_lora_auto_1b:80 lora_static_8b:200 fp8_lora_auto_8b:140" ;;
  *) echo "unknown comparison $which" >&2; exit 2 ;;
esac
export BENCH_GPUS=1 BENCH_CANARY=${BENCH_CANARY-1} OUT=${OUT:-/tmp/out} BENCH_OUT=${BENCH_OUT:-/tmp/sft_bench}
source "$(dirname "$0")/gpu_common.sh"
if [ -z "${BENCH_DRY_RUN:-}" ] && wheels_missing torchao; then
  install_wheels "$BENCH_OUT.pip.log" || { tail -20 "$BENCH_OUT.pip.log"; exit 1; }
fi
# shellcheck disable=SC2086
bash "$(dirname "$0")/sft_gpu.sh" $specs
export PYTHONPATH=/tmp/site:$PWD/workflow
python3 bench/sft_fp8_bench.py report "$BENCH_OUT" --json "$OUT/sft_fp8_h200x1_$which.json"
cp "$BENCH_OUT/canary.json" "$OUT/sft_fp8_h200x1_${which}_canary.json" 2>/dev/null || true  # no canary run
