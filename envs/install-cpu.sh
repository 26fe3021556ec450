#!/usr/bin/env bash
# Build the CPU environment (laptop, CI, CPU partition) into $1 (default .venv). Idempotent.
#
# Why not `pip install llamafactory`: its pins pull a 5 GB CUDA torch (+ torchvision, torchaudio)
# onto a CPU machine. We install torch's CPU build and LLaMA-Factory with --no-deps instead.
#
# torchaudio: LLaMA-Factory imports it at module level (data/mm_plugin.py) but text SFT never
# calls it. PyPI's torchaudio wheels link CUDA libraries (libc10_cuda.so) and fail beside a CPU
# torch. torchaudio supports running without its native extension (it checks for the library file
# and falls back), so we install the pure-Python package and remove its CUDA-linked .so files:
# `import torchaudio` works, audio I/O (never used for text) is unavailable.
set -euo pipefail
VENV=${1:-.venv}
HERE=$(cd "$(dirname "$0")" && pwd)
python3 -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
$PIP install -r "$HERE/cpu.txt"
$PIP install --no-deps -r "$HERE/cpu-nodeps.txt"
$PIP install --no-deps "torchaudio==2.11.0"
rm -f "$VENV"/lib/python3*/site-packages/torchaudio/lib/*.so
$PIP install -r "$HERE/dev.txt"
$PIP install --no-deps -e "$HERE/.."
"$VENV/bin/python" -c "import llamafactory.data, deepspeed, snakemake; print('llmft CPU env ready')"
