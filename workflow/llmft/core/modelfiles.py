"""What a model folder's safetensors files hold, read from their headers, and the check that a
trained folder holds what its base holds.

A ZeRO-3 (or ZeRO-2) save gathers every parameter into a fresh tensor, so a tied output head and
input embedding reach `save_pretrained` as two tensors with different storage: both are written,
and the folder counts the head twice (a 1.24 B Llama-3.2 shape saved 1.50 B). `keep_base_structure`
removes such a duplicate head when it equals the embedding bit for bit, writes each tensor in the
base's dtype, then requires the same tensor names, shapes and dtypes as the base: a folder that
still differs is refused, not published.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import xxhash
from llmft.core.io import read_optional, write_json

INDEX = "model.safetensors.index.json"
HEAD = "lm_head.weight"


# Bytes per element of the safetensors dtypes.
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
               "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}  # fmt: skip
# Weights saved with pickle (torch.save): loading one runs whatever code the file names.
PICKLE_WEIGHTS = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
# A tokenizer transformers can load from a folder: fast (tokenizer.json), SentencePiece, BPE, WordPiece,
# tiktoken.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)
# A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER = 100_000_000


class StructureError(RuntimeError):
    """A trained model folder does not have its base model's structure."""


def content_hash(path: Path) -> str:
    """xxh3-128 of a file's bytes: 6.2 GB/s on one core here (sha256 1.45, blake2b 0.88; see
    bench/README.md), so a checkpoint is read at the filesystem's speed. It detects corruption, not
    tampering. xxhash comes with `datasets`, which LLaMA-Factory needs."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as fh:
        while block := fh.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is not a whole one (its header against its size); None when it is."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            return f"its header length {n} runs past the file's {size} bytes"
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, ValueError):
            return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = t["data_offsets"]
            want = math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"tensor {name!r} has no valid dtype, shape and data_offsets"
        if not 0 <= begin <= stop or stop - begin != want:
            return f"tensor {name!r} spans bytes {begin}..{stop}, not the {want} its dtype and shape need"
        end = max(end, stop)
    if 8 + n + end > size:
        return f"its tensors need {8 + n + end} bytes, the file has {size} (truncated)"
    return None


def folder_problems(model_dir: str | Path) -> list[str]:
    """What keeps a model folder from loading: weights that are corrupt or pickled, a sharded index
    naming a missing shard, no tokenizer. Reads headers only, no weight."""
    d = Path(model_dir)
    out = []
    shards = sorted(d.glob("*.safetensors"))
    for f in shards:
        problem = safetensors_problem(f)
        if problem:
            out.append(f"{f} is not a whole safetensors file: {problem}")
    cfg = read_optional(d / "config.json", None)
    if not isinstance(cfg, dict):
        what = "is not JSON" if cfg is None else f"holds a JSON {type(cfg).__name__}, not an object"
        out.append(f"{d / 'config.json'} {what}; a model's config.json is one object of its settings")
    if (d / INDEX).exists():
        index = read_optional(d / INDEX, None)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            out.append(f"{d / INDEX} has no weight_map object")
        else:
            missing = sorted({str(f) for f in weight_map.values()} - {f.name for f in shards})
            if missing:
                out.append(f"{d / INDEX} names shards that are not in the folder: {', '.join(missing[:3])}")
    pickled = sorted({f.name for pattern in PICKLE_WEIGHTS for f in d.glob(pattern)})
    if pickled and not shards:
        out.append(
            f"{d} holds its weights as pickle ({', '.join(pickled[:3])}), which runs code when loaded; "
            "convert them to safetensors (save_pretrained(..., safe_serialization=True)) first"
        )
    if not any(any(d.glob(pattern)) for pattern in TOKENIZER_FILES):
        out.append(f"{d} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
    return out


def tensor_index(model_dir: str | Path) -> dict[str, dict]:
    """Every tensor of a folder's *.safetensors files: {name: {dtype, shape, file, bytes}}."""
    out: dict[str, dict] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, t in header.items():
            if name != "__metadata__":
                nbytes = t["data_offsets"][1] - t["data_offsets"][0]
                out[name] = {"dtype": t["dtype"], "shape": t["shape"], "file": f.name, "bytes": nbytes}
    return out


def safetensors_stats(model_dir: str | Path) -> dict:
    """Parameter count, weight bytes and dtypes from the safetensors headers, no weight loaded."""
    index = tensor_index(model_dir)
    return {
        "n_params": sum(math.prod(t["shape"]) for t in index.values()),
        "weight_bytes": sum(t["bytes"] for t in index.values()),
        "dtypes": sorted({t["dtype"] for t in index.values()}),
    }


def _tied(model_dir: Path) -> bool:
    cfg = read_optional(model_dir / "config.json", {})
    text = cfg.get("text_config") or {}
    return bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _embedding_name(index: dict) -> str | None:
    names = [n for n in index if n.endswith("embed_tokens.weight")]
    return names[0] if len(names) == 1 else None


def _duplicate_head(model_dir: Path, index: dict) -> bool:
    """Whether the folder saved an output head that its tied config says it does not hold.

    Only when the head equals the embedding exactly: a head that differs means training untied them,
    which is refused (StructureError) rather than hidden.
    """
    from safetensors import safe_open

    embed = _embedding_name(index)
    if not _tied(model_dir) or HEAD not in index or embed is None:
        return False
    with safe_open(str(model_dir / index[HEAD]["file"]), "pt") as fh:
        head = fh.get_tensor(HEAD)
    with safe_open(str(model_dir / index[embed]["file"]), "pt") as fh:
        emb = fh.get_tensor(embed)
    if head.shape != emb.shape or head.dtype != emb.dtype or not bool((head == emb).all()):
        raise StructureError(
            f"{model_dir}: config.json ties the output head to the input embedding, but the saved "
            f"{HEAD} differs from {embed}: the weights came untied during training"
        )
    return True


def conform(model_dir: str | Path, base_dir: str | Path) -> dict:
    """Rewrite a trained folder's shards so that they hold what the base holds: a duplicate tied head
    removed, each tensor in the base's dtype (training in bf16 from an fp32 base saves bf16).
    Returns what was changed."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    index, base = tensor_index(model_dir), tensor_index(base_dir)
    drop = {HEAD} if HEAD not in base and _duplicate_head(model_dir, index) else set()
    cast = {
        n: base[n]["dtype"]
        for n in index
        if n in base and index[n]["dtype"] != base[n]["dtype"] and n not in drop
    }
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    if any(d not in dtypes for d in cast.values()):
        return {"dropped": sorted(drop), "cast": {}}
    for file in sorted({index[n]["file"] for n in drop | set(cast)}):
        path = model_dir / file
        tensors = load_file(str(path))
        for name in list(tensors):
            if name in drop:
                del tensors[name]
            elif name in cast:
                tensors[name] = tensors[name].to(dtypes[cast[name]])
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(path)
    index_file = model_dir / INDEX
    if (drop or cast) and index_file.exists():
        meta = json.loads(index_file.read_text())
        for name in drop:
            meta.get("weight_map", {}).pop(name, None)
        if "total_size" in meta.get("metadata", {}):
            meta["metadata"]["total_size"] = safetensors_stats(model_dir)["weight_bytes"]
        index_file.write_text(json.dumps(meta, indent=2) + "\n")
    if cast:
        base_cfg = json.loads((Path(base_dir) / "config.json").read_text())
        cfg_path = model_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in base_cfg:
                cfg[key] = base_cfg[key]
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return {"dropped": sorted(drop), "cast": dict(sorted(cast.items()))}


def structure_difference(model_dir: str | Path, base_dir: str | Path) -> list[str]:
    """How a folder's tensors differ from the base's (names, shapes, dtypes); empty when alike."""
    mine, base = tensor_index(model_dir), tensor_index(base_dir)
    out = []
    extra, missing = sorted(set(mine) - set(base)), sorted(set(base) - set(mine))
    if extra:
        out.append(f"{len(extra)} tensors the base does not have ({', '.join(extra[:3])})")
    if missing:
        out.append(f"{len(missing)} of the base's tensors missing ({', '.join(missing[:3])})")
    for name in sorted(set(mine) & set(base)):
        a, b = mine[name], base[name]
        if a["shape"] != b["shape"] or a["dtype"] != b["dtype"]:
            out.append(f"{name} is {a['dtype']}{a['shape']}, the base's {b['dtype']}{b['shape']}")
    return out


def keep_base_structure(model_dir: str | Path, base_dir: str | Path) -> dict:
    """Give a trained folder its base's structure (a tied head saved once), or refuse it."""
    if not tensor_index(base_dir):
        return {"checked": False, "why": f"{base_dir} holds no safetensors files"}
    changed = conform(model_dir, base_dir)
    diff = structure_difference(model_dir, base_dir)
    if diff:
        raise StructureError(
            f"the trained model in {model_dir} does not have the structure of its base {base_dir}: "
            + "; ".join(diff[:5])
        )
    stats = safetensors_stats(model_dir)
    return {"checked": True, **changed, **stats}


# ------------------------------------------------------------------ the seal of a published folder

# Written into a published folder (sft/model, LoRA's sft/adapter, preference/model) as its last
# file: each file's size and content hash. Headers show truncation; only the content hash shows
# bytes changed in place at the same size.
SEAL = "llmft_seal.json"
# Beside a sealed folder (sft/model.verified.json): the size, times and inode of each file last
# found to match its seal, so an unchanged folder is not read again (an edit in place changes the
# file's ctime, which no tool can set back).
VERIFIED_SUFFIX = ".verified.json"


def seal_folder(folder: str | Path) -> dict:
    """Seal a folder that is about to be published: {file: {size, xxh3_128}} into SEAL."""

    folder = Path(folder)
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "xxh3_128": content_hash(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != SEAL
    }
    write_json(folder / SEAL, {"files": files})
    return files


def _stamp(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def seal_problems(folder: str | Path) -> list[str]:
    """Why a sealed folder no longer holds what was published: a sealed file missing, resized or
    changed in place. Files whose size, times and inode match the cache beside the folder
    (VERIFIED_SUFFIX) are not read again. A folder without SEAL: []."""
    import hashlib

    folder = Path(folder)
    try:
        raw = (folder / SEAL).read_bytes()
    except FileNotFoundError:
        return []
    try:
        files = json.loads(raw)["files"]
    except (ValueError, KeyError, TypeError):
        files = None
    if not isinstance(files, dict) or not all(isinstance(v, dict) for v in files.values()):
        return [f"{folder / SEAL} is not a seal (a JSON object of files, sizes and hashes)"]
    cache_path = folder.with_name(folder.name + VERIFIED_SUFFIX)
    seal_id = hashlib.sha256(raw).hexdigest()
    cache = read_optional(cache_path, {}) or {}
    known = cache.get("files", {}) if isinstance(cache, dict) and cache.get("seal") == seal_id else {}
    verified, problems = {}, []
    for name, sealed in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing (sealed when the folder was published)")
            continue
        stamp = _stamp(path)
        if stamp[0] != sealed.get("size"):
            size = sealed.get("size")
            problems.append(f"{path} has {stamp[0]} bytes, not the {size} sealed when published")
        elif known.get(name) == stamp or content_hash(path) == sealed.get("xxh3_128"):
            verified[name] = stamp
        else:
            problems.append(f"{path} no longer has the content sealed when published (changed in place)")
    if verified != known:
        try:
            write_json(cache_path, {"seal": seal_id, "files": verified})
        except OSError:
            pass  # a read-only results folder: verified again next time
    return problems
