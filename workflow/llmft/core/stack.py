"""The software stack a run trained on, as one flat fingerprint: pure functions of recorded facts.

verify_env measures the stack on every node that trains (llmft.env.stack gathers the values that
node facts did not have yet); `fingerprint` turns one node's facts into flat, stable keys (None where
a tool did not report), `run_fingerprint` merges every node's, `diff` names what changed between two
fingerprints and `stack_hash` is a short stable name for one. Shared by verify_env (verify.json),
the run page and summary.json, and the trend page; none of them imports another stage for it.
"""

from __future__ import annotations

import hashlib
import json

# The fingerprint's keys, in the order the page shows them.
FIELDS = (
    "python",
    "torch",
    "torch_git",
    "build",
    "hip",
    "cuda",
    "rocm",
    "driver",
    "rccl",
    "nccl",
    "hipblaslt",
    "cublas",
    "cublaslt",
    "flash_attn",
    "flash_attn_backend",
    "attention",
    "deepspeed",
    "llamafactory",
    "transformers",
    "peft",
    "torchao",
    "container",
    "container_digest",
    "gpu_model",
    "gpu_firmware",
)


def joined(values) -> str | None:
    """One value for a node's GPUs: the distinct non-empty ones, comma-joined (None if none)."""
    distinct = sorted({str(v) for v in values if v not in (None, "")})
    return ", ".join(distinct) or None


def _flash_attn_backend(facts: dict, version: str | None) -> str | None:
    """flash-attn's kernels: on ROCm composable_kernel ("ck") unless FLASH_ATTENTION_TRITON_AMD_ENABLE
    selects its Triton backend; CUDA's own kernels on NVIDIA; None without flash-attn or a GPU build."""
    if version is None:
        return None
    build = facts.get("build")
    if build == "rocm":
        triton = (facts.get("stack") or {}).get("flash_attn_triton_amd")
        return "triton" if str(triton).upper() == "TRUE" else "ck"
    return "cuda" if build == "cuda" else None


def _gpu_model(facts: dict) -> str | None:
    """The GPU's model: the tool's marketing name (rocminfo / nvidia-smi), else torch's device name."""
    smi = [g.get("marketing_name") or g.get("name") for g in (facts.get("smi") or {}).get("gpus") or []]
    return joined(smi) or joined(d.get("name") for d in facts.get("devices") or [])


def fingerprint(facts: dict) -> dict:
    """One node's stack from its facts (llmft.env.nodefacts, with `stack` from llmft.env.stack):
    every key of FIELDS, None where the node's tools did not report it."""
    stack = facts.get("stack") or {}
    pkgs = facts.get("packages") or {}
    gpus = (facts.get("smi") or {}).get("gpus") or []
    build = facts.get("build")
    rocm, cuda = build == "rocm", build == "cuda"
    collective = stack.get("collectives_lib")
    container = stack.get("container") or {}
    fa = pkgs.get("flash_attn")
    return {
        "python": facts.get("python"),
        "torch": facts.get("torch_version") or pkgs.get("torch"),
        "torch_git": stack.get("torch_git"),
        "build": build,
        "hip": facts.get("hip_version"),
        "cuda": facts.get("cuda_version"),
        "rocm": stack.get("rocm"),
        "driver": stack.get("driver") or joined(g.get("driver") for g in gpus),
        "rccl": collective if rocm else None,
        "nccl": collective if cuda else None,
        "hipblaslt": stack.get("hipblaslt"),
        "cublas": stack.get("cublas"),
        "cublaslt": stack.get("cublaslt"),
        "flash_attn": fa,
        "flash_attn_backend": _flash_attn_backend(facts, fa),
        "attention": (facts.get("attention") or {}).get("attention"),
        "deepspeed": pkgs.get("deepspeed"),
        "llamafactory": pkgs.get("llamafactory"),
        "transformers": pkgs.get("transformers"),
        "peft": pkgs.get("peft"),
        "torchao": pkgs.get("torchao"),
        "container": container.get("image"),
        "container_digest": container.get("digest"),
        "gpu_model": _gpu_model(facts),
        "gpu_firmware": stack.get("gpu_firmware") or joined(g.get("firmware") for g in gpus),
    }


def stack_hash(fp: dict) -> str:
    """A short stable name for a fingerprint: 12 hex digits of SHA-256 over its canonical JSON."""
    text = json.dumps(fp, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_fingerprint(per_node: dict[str, dict]) -> dict:
    """The run's stack from each node's fingerprint ({host: fingerprint}): `fingerprint` holds the
    value every node agrees on, and for a component the nodes disagree on, {host: value}; `differs`
    names those components; `hash` names the whole."""
    hosts = sorted(per_node)
    merged: dict = {}
    differs = []
    for key in FIELDS:
        values = {h: per_node[h].get(key) for h in hosts}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) <= 1:
            merged[key] = next(iter(values.values()), None)
        else:
            merged[key] = values
            differs.append(key)
    return {"hash": stack_hash(merged), "fingerprint": merged, "differs": differs, "nodes": hosts}


def diff(old: dict | None, new: dict | None) -> list[tuple[str, object, object]]:
    """[(component, old value, new value)] for every component that changed, in FIELDS order (then
    any other key, sorted); a missing fingerprint compares as all None."""
    old, new = old or {}, new or {}
    keys = list(FIELDS) + sorted((set(old) | set(new)) - set(FIELDS))
    return [(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def show(value) -> str:
    """A fingerprint value as text: "n/a" for None, `host: value; ...` for nodes that disagree."""
    if value is None:
        return "n/a"
    if isinstance(value, dict):
        return "; ".join(f"{h}: {show(v)}" for h, v in value.items())
    return str(value)


def diff_text(changes: list[tuple[str, object, object]]) -> str:
    """`torch 2.9.0 -> 2.10.0; rocm 7.0.2 -> 7.1.0`: a diff as one line."""
    return "; ".join(f"{k} {show(a)} -> {show(b)}" for k, a, b in changes)


def of_nodes(nodes: list[dict]) -> dict:
    """The run's stack from every node's facts, each named by its host (a repeated host by its
    position too)."""
    per_node: dict[str, dict] = {}
    for i, facts in enumerate(nodes):
        host = str(facts.get("host") or f"node{i}")
        per_node[host if host not in per_node else f"{host}#{i}"] = fingerprint(facts)
    return run_fingerprint(per_node)


def of_report(verify: dict) -> dict | None:
    """The run's stack from a verify.json: its `stack`, else computed from its nodes (a report
    written before the fingerprint was recorded); None without nodes."""
    if isinstance(verify.get("stack"), dict):
        return verify["stack"]
    return of_nodes(verify["nodes"]) if verify.get("nodes") else None
