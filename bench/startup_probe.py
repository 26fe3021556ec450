"""Where a fresh process's accelerator start-up goes, step by step (device bench helper).

    python bench/startup_probe.py MODEL_DIR      # prints one JSON line of seconds per step

Run it twice in a row: the first run pays what a cold machine pays (page cache, driver), the second
what every later process pays. Each step is timed on its own, in the order evaluate's processes
meet them: imports, the driver, a context per device, the model load, the first fp32 / bf16 GEMM
and the first forward of the model.
"""

import argparse
import json
import time

# Parsed before the clock starts, so the arguments cost no step's time.
ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model_dir", help="a Hugging Face model folder (config, weights, tokenizer); needs CUDA")
MODEL = ap.parse_args().model_dir

T = {}
t = time.perf_counter()


def mark(step):
    global t
    now = time.perf_counter()
    T[step] = round(now - t, 3)
    t = now


import torch  # noqa: E402

mark("import_torch")
n = torch.cuda.device_count()
mark("device_count")
torch.cuda.init()
mark("cuda_init")
for i in range(n):
    torch.empty(1, device=f"cuda:{i}")
    torch.cuda.synchronize(i)
mark("contexts")
a = torch.randn(1024, 1024, device="cuda:0")
(a @ a).sum().item()
mark("first_fp32_gemm")
b = a.bfloat16()
(b @ b).sum().item()
mark("first_bf16_gemm")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

mark("import_transformers")
AutoTokenizer.from_pretrained(MODEL)
mark("tokenizer")
model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32, device_map={"": "cuda:0"})
torch.cuda.synchronize()
mark("load_fp32")
with torch.inference_mode():
    ids = torch.randint(3, 1000, (64, 96), device="cuda:0")
    model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=33).logits.sum().item()
    mark("first_forward")
    model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=33).logits.sum().item()
    mark("second_forward")
print(json.dumps(T))
