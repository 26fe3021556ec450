"""A trained folder gets its base's structure: a tied head saved once, the base's dtype, or a refusal."""

import shutil

import pytest
import torch
from llmft.core.assets import build_tiny_model
from llmft.core.modelfiles import (
    HEAD,
    StructureError,
    keep_base_structure,
    safetensors_stats,
    structure_difference,
    tensor_index,
)
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    build_tiny_model(root / "tied", hidden_size=32, num_layers=1, vocab_size=300)
    build_tiny_model(root / "untied", hidden_size=32, num_layers=1, vocab_size=300, tied=False)
    return root


def saved_like_zero3(base, out, head=None, dtype=None):
    """What a gathered save writes: the tied head as its own tensor (a copy), maybe another dtype."""
    shutil.copytree(base, out)
    tensors = load_file(str(out / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"]
    tensors[HEAD] = emb.clone() if head is None else head
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_duplicate_tied_head_is_removed_and_the_count_is_the_bases(bases, tmp_path):
    base = bases / "tied"
    tuned = saved_like_zero3(base, tmp_path / "tuned")
    assert safetensors_stats(tuned)["n_params"] > safetensors_stats(base)["n_params"]
    out = keep_base_structure(tuned, base)
    assert out["dropped"] == [HEAD] and out["n_params"] == safetensors_stats(base)["n_params"]
    assert structure_difference(tuned, base) == []
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tuned))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied


def test_a_head_that_came_untied_is_refused(bases, tmp_path):
    base = bases / "tied"
    other = torch.zeros_like(load_file(str(base / "model.safetensors"))["model.embed_tokens.weight"])
    tuned = saved_like_zero3(base, tmp_path / "tuned", head=other)
    with pytest.raises(StructureError, match="came untied"):
        keep_base_structure(tuned, base)


def test_bf16_weights_from_an_fp32_base_are_written_back_in_fp32(bases, tmp_path):
    base = bases / "tied"
    tuned = saved_like_zero3(base, tmp_path / "tuned", dtype=torch.bfloat16)
    out = keep_base_structure(tuned, base)
    assert set(out["cast"].values()) == {"F32"} and out["dtypes"] == ["F32"]
    assert {t["dtype"] for t in tensor_index(tuned).values()} == {"F32"}


def test_an_untied_model_keeps_its_head(bases, tmp_path):
    base = bases / "untied"
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)
    out = keep_base_structure(tuned, base)
    assert out["dropped"] == [] and HEAD in tensor_index(tuned)
    assert out["n_params"] == safetensors_stats(base)["n_params"]


def test_a_missing_tensor_is_refused_by_name(bases, tmp_path):
    base = bases / "untied"
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)
    tensors = load_file(str(tuned / "model.safetensors"))
    del tensors[HEAD]
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(StructureError, match="lm_head.weight"):
        keep_base_structure(tuned, base)
