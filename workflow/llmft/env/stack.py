"""The stack values node facts did not have yet, read on the node that trains (nodefacts' `stack`).

Cheap reads only, each bounded: torch's git hash and NCCL/RCCL version (no GPU work), the ROCm
version file, hipBLASLt's library file name, cuBLAS's wheel and cuBLASLt's own version call, the
GPU driver and firmware from the vendor's tool, and the container image. A missing tool or file
is None, never a failure. llmft.core.stack turns the result into the fingerprint.

The container's digest never reads the image's data: an Apptainer/Singularity SIF is named by
SHA-256 over its 128-byte global header and its descriptor table (the image's build UUID, times and
every object's offset and size: a rebuilt image differs, an unchanged one does not); where the SIF
file is not readable inside the container (or the image is a sandbox folder), by SHA-256 over the
build labels Apptainer records inside every image (/.singularity.d/labels.json).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.metadata
import os
import re
import struct
from pathlib import Path

from llmft.core.stack import joined

SIF_MAGIC = b"SIF_MAGIC"
SIF_HEADER = 128  # launch script 32, magic 10, version 3, arch 3, UUID 16, eight int64
DESCRIPTORS_MAX = 1 << 20  # a SIF's descriptor table is tens of KB; never read more than 1 MiB
LABELS = "/.singularity.d/labels.json"


def rocm_dir() -> Path:
    """Where ROCm is installed: $ROCM_PATH, else /opt/rocm."""
    return Path(os.environ.get("ROCM_PATH") or "/opt/rocm")


def _read(path: Path | str, limit: int = 4096) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read(limit).strip() or None
    except OSError:
        return None


def rocm_version(root: Path | None = None) -> str | None:
    """The installed ROCm release as its version file prints it (`.info/version`: e.g. 7.1.0-38)."""
    return _read((root or rocm_dir()) / ".info" / "version")


def so_version(path: str) -> str | None:
    """The version in a shared library's file name: libhipblaslt.so.0.12.60300 -> 0.12.60300."""
    m = re.search(r"\.so\.(\d[\w.]*)$", os.path.basename(os.path.realpath(path)))
    return m.group(1) if m else None


def hipblaslt_version(torch_lib: str | None, root: Path | None = None) -> str | None:
    """hipBLASLt's version from its library file: the one torch's wheel bundles when its name is
    versioned, else the ROCm install's (lib/libhipblaslt.so, through its links)."""
    bundled = sorted(glob.glob(os.path.join(torch_lib, "libhipblaslt*.so*"))) if torch_lib else []
    for path in bundled + [str((root or rocm_dir()) / "lib" / "libhipblaslt.so")]:
        if os.path.exists(path) and (v := so_version(path)):
            return v
    return None


def cublas_wheel() -> str | None:
    """cuBLAS (and its cuBLASLt) as installed beside a CUDA torch: the nvidia-cublas wheel's version."""
    for dist in ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def cublaslt_version() -> str | None:
    """cublasLtGetVersion() of the cuBLASLt torch loaded (found by its soname): 120804 -> 12.8.4."""
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            lib = ctypes.CDLL(name)
            lib.cublasLtGetVersion.restype = ctypes.c_size_t
            v = int(lib.cublasLtGetVersion())
        except (OSError, AttributeError):
            continue
        return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
    return None


def collectives_version(torch) -> str | None:
    """torch.cuda.nccl.version(): NCCL's on CUDA, RCCL's (in NCCL's numbering) on ROCm; no GPU work."""
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a build without NCCL/RCCL
        return None
    if isinstance(v, tuple):
        return ".".join(str(x) for x in v if x != "")
    if isinstance(v, int):  # NCCL_VERSION_CODE: x*10000 + y*100 + z since 2.9, x*1000 + y*100 + z before
        if v >= 10000:
            return f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        return f"{v // 1000}.{v // 100 % 10}.{v % 100}"
    return str(v)


def parse_amd_smi_static(text: str) -> dict:
    """Driver and firmware from `amd-smi static` (text): each `GPU: N` block's DRIVER VERSION and
    VBIOS VERSION (IFWI in newer amd-smi); {"driver": [...], "firmware": [...]} in GPU order."""
    out: dict[str, list[str]] = {"driver": [], "firmware": []}
    section = ""
    for line in text.splitlines():
        key, sep, value = line.strip().partition(":")
        if not sep:
            continue
        key, value = key.strip().upper(), value.strip()
        if not value:
            section = key
        elif key == "VERSION" and section == "DRIVER":
            out["driver"].append(value)
        elif key == "VERSION" and section in ("VBIOS", "IFWI"):
            out["firmware"].append(value)
    return out


def parse_rocm_smi(text: str) -> dict:
    """Driver and firmware from `rocm-smi --showdriverversion --showvbios`: `Driver version: X` and
    each `GPU[i] : VBIOS version: Y`."""
    driver = re.findall(r"Driver version:\s*(\S+)", text)
    firmware = re.findall(r"VBIOS version:\s*(\S+)", text)
    return {"driver": driver[:1], "firmware": firmware}


def _one(values: list[str]) -> str | None:
    """The GPUs' values as one (llmft.core.stack.joined), the tools' "N/A" left out."""
    return joined(v for v in values if v.upper() != "N/A")


def amd_driver_firmware(run_tool, sysfs: str = "/sys/module/amdgpu/version") -> dict:
    """The amdgpu driver (/sys/module/amdgpu/version, else amd-smi / rocm-smi) and GPU firmware
    (VBIOS, from amd-smi static, else rocm-smi); `run_tool(cmd, timeout) -> (stdout, error)`."""
    found = {"driver": [], "firmware": []}
    text, _ = run_tool(["amd-smi", "static"], 30)
    if text:
        found = parse_amd_smi_static(text)
    if not found["driver"] or not found["firmware"]:
        text, _ = run_tool(["rocm-smi", "--showdriverversion", "--showvbios"], 30)
        more = parse_rocm_smi(text)
        found = {k: found[k] or more[k] for k in found}
    return {"driver": _read(sysfs) or _one(found["driver"]), "gpu_firmware": _one(found["firmware"])}


def sif_digest(path: str) -> dict | None:
    """{"digest": "sha256:…", "id": the SIF's build UUID} from a SIF file's global header and
    descriptor table (about 30 KB of a multi-GB image); None when `path` is not a readable SIF."""
    try:
        with open(path, "rb") as f:
            head = f.read(SIF_HEADER)
            if len(head) < SIF_HEADER or head[32:41] != SIF_MAGIC:
                return None
            offset, size = struct.unpack_from("<qq", head, 96)
            f.seek(offset)
            table = f.read(max(0, min(size, DESCRIPTORS_MAX)))
    except OSError:
        return None
    uuid = head[48:64].hex()
    uuid = f"{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:]}"
    digest = "sha256:" + hashlib.sha256(head + table).hexdigest()
    return {"digest": digest, "id": uuid, "source": "sif header"}


def container(env: dict | None = None, labels: str = LABELS) -> dict:
    """The image this process runs in: {"image", "digest", "id", "source"}; image None outside one."""
    env = os.environ if env is None else env
    image = env.get("APPTAINER_CONTAINER") or env.get("SINGULARITY_CONTAINER")
    if not image:
        return {"image": None, "digest": None}
    found = sif_digest(image) if os.path.isfile(image) else None
    if found is None:
        try:
            data = Path(labels).read_bytes()[:DESCRIPTORS_MAX]
            found = {"digest": "sha256:" + hashlib.sha256(data).hexdigest(), "source": "labels.json"}
        except OSError:
            found = {"digest": None, "source": "none readable"}
    return {"image": image, **found}


def gather(torch, build: str, smi: dict, run_tool) -> dict:
    """Nodefacts' `stack`: what the fingerprint needs beyond the facts nodefacts already has."""
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    out: dict = {
        "torch_git": getattr(torch.version, "git_version", None),
        "collectives_lib": collectives_version(torch) if build != "cpu" else None,
        "rocm": rocm_version() if build == "rocm" or smi.get("tool") == "rocminfo" else None,
        "hipblaslt": hipblaslt_version(torch_lib) if build == "rocm" else None,
        "cublas": cublas_wheel() if build == "cuda" else None,
        "cublaslt": cublaslt_version() if build == "cuda" else None,
        "flash_attn_triton_amd": os.environ.get("FLASH_ATTENTION_TRITON_AMD_ENABLE"),
        "container": container(),
    }
    if smi.get("tool") == "rocminfo":
        out.update(amd_driver_firmware(run_tool))
    return out
