"""The typed config (llmft.core.settings) against the schema, the one source of the keys: every schema
key has a field with the schema's default and a comment, every field has a key, and a validated
config round-trips through the dataclasses unchanged."""

import dataclasses

import pytest
import yaml
from llmft.core.config import layout, load_schema, lora_settings, uses_reference, validate
from llmft.core.settings import Config, replace

from tests.conftest import REPO

DEMO = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
SOURCE = (REPO / "workflow" / "llmft" / "core" / "settings.py").read_text()


def _pairs(schema: dict, cls: type, key: str = ""):
    """(dotted key, schema of the key, dataclass field) of every key under `schema`, depth first."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert list(fields) == list(schema["properties"]), f"fields of {cls.__name__} vs schema {key or 'top'}"
    for name, sub in schema["properties"].items():
        f = fields[name]
        dotted = f"{key}.{name}" if key else name
        yield dotted, sub, f
        kind = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if name == "preference" and not key:
            kind = type(Config.from_dict(validate({"preference": {}})).preference)
        if kind is not None and dataclasses.is_dataclass(kind):
            yield from _pairs(sub, kind, dotted)


def _default(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return f.default


def test_every_schema_key_is_a_field_with_its_default_and_every_field_a_key():
    pairs = list(_pairs(load_schema(), Config))
    assert len(pairs) > 140
    for dotted, sub, f in pairs:
        if "default" in sub and not dataclasses.is_dataclass(f.default_factory):
            # a section's own default ({}) is filled key by key: its fields are checked one by one
            assert _default(f) == sub["default"], dotted
            assert type(_default(f)) is type(sub["default"]), dotted


def test_every_field_carries_the_first_words_of_its_keys_description():
    flat = " ".join(line.strip().lstrip("#").strip() for line in SOURCE.splitlines())
    for dotted, sub, _field in _pairs(load_schema(), Config):
        words = " ".join(sub.get("description", "").split(". ")[0].split()[:3])
        if words and dotted != "run":
            assert words in flat, dotted


@pytest.mark.parametrize(
    "raw",
    [
        {},
        DEMO,
        {"preference": {"method": "kto"}, "sft": {"finetuning_type": "lora", "learning_rate": 1e-4}},
        {"nightly": {"max_benchmark_drop": {"arc": 0.1}}, "hardware": {"processes_per_node": 3}},
    ],
)
def test_a_validated_config_round_trips(raw):
    cfg = validate(raw, base_dir=REPO)
    typed = Config.from_dict(cfg)
    assert typed.to_dict() == cfg
    assert typed.hardware.layout == layout(cfg)
    assert typed.sft.lora == lora_settings(cfg["sft"])
    if cfg["preference"] is not None:
        assert typed.preference.uses_reference == uses_reference(cfg["preference"])


def test_sections_are_frozen_and_replace_makes_a_copy():
    typed = Config.from_dict(validate({}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.model.template = "qwen"
    other = replace(typed, "model.template", "qwen")
    assert (other.model.template, typed.model.template) == ("qwen", "auto")
    assert other.sft is typed.sft


def test_packing_auto_is_neat_on_gpus_and_off_on_cpu():
    auto = Config.from_dict(validate({})).sft
    assert (auto.packing_on(True), auto.packing_on(False)) == ("neat", "off")
    off = Config.from_dict(validate({"sft": {"packing": "off"}})).sft
    assert (off.packing_on(True), off.packing_on(False)) == ("off", "off")
