"""The container definitions install what envs/*.txt pins: one set of versions, two ways to install it."""

import re
from pathlib import Path

import pytest

ENVS = Path(__file__).resolve().parents[3] / "envs"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
INLINE_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][^\s\"')]*)")
IMAGE_TORCH = {
    "rocm": re.compile(r"^rocm/pytorch:rocm7[\w.]*_pytorch_release_(\d+\.\d+\.\d+)$"),
    "cuda": re.compile(r"^pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\w.-]+-devel$"),
}


def _name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _public(version: str) -> str:
    return version.split("+", 1)[0]


def requirement_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a requirements file."""
    pins = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.split("#", 1)[0].strip())
        if m:
            pins[_name(m.group(1))] = m.group(2)
    return pins


def header_pins(path: Path) -> dict[str, str]:
    """Pins in a requirements file's install steps (comment lines: flash-attn, built separately)."""
    text = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    return {_name(n): v for n, v in INLINE_PIN.findall(text)}


def sections(path: Path) -> dict[str, str]:
    """An Apptainer definition: its header (key: value lines) and its %sections, by name."""
    out, name = {"header": []}, "header"
    for line in path.read_text().splitlines():
        m = re.match(r"^%(\w+)", line)
        if m:
            name = m.group(1)
            out[name] = []
        else:
            out[name].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def code(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.strip().startswith("#"))


def base_image(defn: dict[str, str]) -> str:
    return re.search(r"^From:\s*(\S+)", defn["header"], re.M).group(1)


@pytest.fixture(params=["rocm", "cuda"])
def vendor(request):
    return request.param


def test_the_image_carries_the_torch_release_the_requirements_pin(vendor):
    image = base_image(sections(ENVS / "apptainer" / f"{vendor}.def"))
    m = IMAGE_TORCH[vendor].match(image)
    assert m, f"unexpected base image {image}"
    assert m.group(1) == _public(requirement_pins(ENVS / f"{vendor}.txt")["torch"])


def test_the_def_installs_the_requirements_files_with_the_image_torch(vendor):
    post = code(sections(ENVS / "apptainer" / f"{vendor}.def")["post"])
    assert f"envs/{vendor}.txt" in post and "--no-deps -r envs/cpu-nodeps.txt" in post
    assert "grep -vE '^(torch|torchaudio)=='" in post  # the image's torch stays
    files = sections(ENVS / "apptainer" / f"{vendor}.def")["files"]
    assert re.search(r"^\s*envs\s+/opt/llmft/envs\s*$", files, re.M)


def test_every_version_in_the_def_matches_the_requirements(vendor):
    pins = requirement_pins(ENVS / f"{vendor}.txt")
    pins |= header_pins(ENVS / f"{vendor}.txt") | requirement_pins(ENVS / "cpu-nodeps.txt")
    inline = dict(INLINE_PIN.findall(code(sections(ENVS / "apptainer" / f"{vendor}.def")["post"])))
    for name, version in inline.items():
        assert _name(name) in pins, f"{name}=={version} in {vendor}.def is pinned nowhere in envs/"
        assert version == pins[_name(name)], f"{name}: {vendor}.def {version}, envs/ {pins[_name(name)]}"


def test_torchaudio_is_the_torch_release(vendor):
    pins = requirement_pins(ENVS / f"{vendor}.txt")
    assert _public(pins["torchaudio"]) == _public(pins["torch"])
    assert pins["torchaudio"].partition("+")[2] == pins["torch"].partition("+")[2]  # same index


def test_rocm_pins_a_rocm7_wheel_with_varlen_from_its_index():
    torch = requirement_pins(ENVS / "rocm.txt")["torch"]
    m = re.fullmatch(r"(\d+)\.(\d+)\.\d+\+(rocm7\.\d+)", torch)
    assert m and (int(m.group(1)), int(m.group(2))) >= (2, 10), torch  # torch.nn.attention.varlen
    assert f"download.pytorch.org/whl/{m.group(3)}" in (ENVS / "rocm.txt").read_text()


def test_rocm_def_targets_gfx942():
    defn = sections(ENVS / "apptainer" / "rocm.def")
    assert re.search(r"^\s*export PYTORCH_ROCM_ARCH=gfx942\s*$", defn["environment"], re.M)
    post = code(defn["post"])
    assert "GPU_ARCHS=gfx942" in post and "flash-attn==" in post
    # flash-attn's setup.py skips the ROCm (composable_kernel) build too when this is set
    assert "FLASH_ATTENTION_SKIP_CUDA_BUILD" not in post


def test_the_def_tests_the_imports_a_stage_needs(vendor):
    test = sections(ENVS / "apptainer" / f"{vendor}.def")["test"]
    for module in ("torch", "deepspeed", "llamafactory.train.tuner", "llmft"):
        assert re.search(rf"^import {re.escape(module)}\b", test, re.M), module


def test_rocm_image_runs_the_bare_metal_torch_build():
    """One torch + ROCm build on ROCm: the image installs envs/rocm.txt's torch wheels from their index
    over a base image of the same ROCm minor (the wheel's ROCm compiles flash-attn there)."""
    defn = sections(ENVS / "apptainer" / "rocm.def")
    post = code(defn["post"])
    assert "grep -E '^(torch|torchaudio)==' envs/rocm.txt" in post and '--index-url "$INDEX"' in post
    torch = requirement_pins(ENVS / "rocm.txt")["torch"]
    wheel_rocm = torch.partition("+")[2]  # rocm7.1
    image_rocm = re.match(r"rocm/pytorch:(rocm[\d.]+)_", base_image(defn)).group(1)  # rocm7.1.1
    assert image_rocm == wheel_rocm or image_rocm.startswith(wheel_rocm + "."), (image_rocm, torch)
    assert 'torch.__version__ == pins["torch"]' in defn["test"]


@pytest.mark.parametrize("env", ["cpu", "cuda", "rocm"])
def test_torchao_pin_works_with_the_pinned_peft_and_torch(env):
    """Every environment pins a torchao that verify_env's package rules accept beside its peft and
    torch (torchao 0.18 breaks peft 0.18.1's LoRA; each torchao loads its kernels on its own torch)."""
    from llmft.core.fp8 import package_conflicts

    pins = requirement_pins(ENVS / f"{env}.txt")
    assert "torchao" in pins, f"envs/{env}.txt pins no torchao (FP8 training)"
    versions = {k: pins[k] for k in ("torchao", "peft", "torch")}
    assert package_conflicts(versions) == [], versions
