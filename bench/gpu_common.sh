# Sourced by the GPU bench scripts (bench/sft_gpu.sh, bench/eval_gpu.sh): the environment every
# device run needs, the run clock, and the install of the carried wheels.
# Never NVLink multicast on the shared host.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
el() { echo $(($(date +%s) - T0)); }

# wheels_missing MODULE...: true unless every module is in /tmp/site (a warm machine keeps the last
# call's install, which may lack what this script needs).
wheels_missing() {
  local m
  [ -f /tmp/site/llamafactory/__init__.py ] || return 0
  for m in "$@"; do [ -d "/tmp/site/$m" ] || return 0; done
  return 1
}

# install_wheels LOG: the carried wheels (.whl/*.whl, or $WHEELS/*.whl) into /tmp/site (no network on
# the device machine).
install_wheels() {
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl >"$1" 2>&1
}

# site_first: the carried wheels (/tmp/site) and this checkout's llmft first on PYTHONPATH, their
# scripts and the image's python3 first on PATH.
site_first() {
  export PYTHONPATH=/tmp/site:$PWD/workflow
  export PATH=/tmp/site/bin:$(dirname "$(command -v python3)"):$PATH
}

# use_wheels LOG MODULE...: the carried wheels installed (unless a warm machine has them all) and put
# first on PYTHONPATH / PATH beside this checkout's llmft; non-zero, with the pip log's tail, on failure.
use_wheels() {
  local log=$1
  shift
  if wheels_missing "$@"; then
    install_wheels "$log" || { tail -20 "$log"; return 1; }
  fi
  site_first
}

# use_image_python: site_first, and `python` the image's python3 (the workflow's rules call
# `python -m llmft`), for the drivers that run Snakemake pipelines on the device.
use_image_python() {
  local py_dir
  py_dir=$(dirname "$(command -v python3)")
  site_first
  if [ "$(command -v python)" != "$py_dir/python" ] && [ ! -x "$py_dir/python" ]; then
    mkdir -p /tmp/pybin && ln -sf "$(command -v python3)" /tmp/pybin/python && export PATH=/tmp/pybin:$PATH
  fi
}
