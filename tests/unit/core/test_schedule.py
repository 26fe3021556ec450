"""sft.lr_scheduler_type: transformers' own names only, refused before any job when its schedule
would fail at the first step, and warmup_stable_decay with its decay as a share of the steps
(sft.decay_ratio), turned into steps by the launcher from the trainer's own count."""

import copy

import pytest
import torch
import yaml
from llmft.core import schedule
from llmft.core.config import ConfigError, load_schema, validate
from llmft.core.platform import Platform
from llmft.core.settings import Config
from llmft.sft.render import render
from transformers import optimization
from transformers.optimization import get_scheduler
from transformers.trainer_utils import SchedulerType

from tests.conftest import REPO, tiny_config

DEMO = yaml.safe_load((REPO / "config/config.yaml").read_text())


def with_sft(**values) -> dict:
    cfg = copy.deepcopy(DEMO)
    extra = values.pop("extra", None)
    cfg["sft"].update(values)
    if extra is not None:
        cfg["sft"]["extra"] = extra
    return cfg


def test_the_schema_offers_exactly_transformers_schedules():
    props = load_schema()["properties"]
    names = {t.value for t in SchedulerType}
    assert set(props["sft"]["properties"]["lr_scheduler_type"]["enum"]) == names
    assert set(props["preference"]["properties"]["lr_scheduler_type"]["enum"]) == names


BAD = [
    ("a typo", with_sft(lr_scheduler_type="cosin"), "sft.lr_scheduler_type"),
    ("min_lr missing", with_sft(lr_scheduler_type="cosine_with_min_lr"), "needs min_lr or min_lr_rate"),
    (
        "kwargs not a mapping",
        with_sft(extra={"lr_scheduler_kwargs": "min_lr_rate=0.1"}),
        "sft.extra.lr_scheduler_kwargs: 'min_lr_rate=0.1' is not a mapping",
    ),
    (
        "no stable phase",
        with_sft(lr_scheduler_type="warmup_stable_decay", warmup_ratio=0.5, decay_ratio=0.6),
        "sft.decay_ratio: 0.6 and sft.warmup_ratio 0.5 add up to more than all the steps",
    ),
    (
        "decay_ratio beside steps",
        with_sft(
            lr_scheduler_type="warmup_stable_decay",
            decay_ratio=0.3,
            extra={"lr_scheduler_kwargs": {"num_stable_steps": 5}},
        ),
        "sft.decay_ratio: 0.3 is not read when sft.extra.lr_scheduler_kwargs gives num_stable_steps",
    ),
    (
        "decay_ratio under cosine",
        with_sft(decay_ratio=0.3),
        "sft.decay_ratio: 0.3 is only used with lr_scheduler_type: warmup_stable_decay",
    ),
    ("decay_ratio of zero", with_sft(lr_scheduler_type="warmup_stable_decay", decay_ratio=0), "decay_ratio"),
]


@pytest.mark.parametrize("name,cfg,needle", BAD, ids=[b[0] for b in BAD])
def test_a_schedule_that_would_fail_in_the_job_is_refused_by_name(name, cfg, needle):
    with pytest.raises(ConfigError) as err:
        validate(cfg, base_dir=REPO)
    assert needle in str(err.value)


def test_schedules_with_what_they_need_pass():
    for cfg in (
        with_sft(lr_scheduler_type="cosine_with_min_lr", extra={"lr_scheduler_kwargs": {"min_lr_rate": 0.1}}),
        with_sft(lr_scheduler_type="warmup_stable_decay", warmup_ratio=0.1, decay_ratio=0.9),
        # its own decay steps: the ratio is not read, so no sum to check
        with_sft(
            lr_scheduler_type="warmup_stable_decay",
            warmup_ratio=0.5,
            extra={"lr_scheduler_kwargs": {"num_decay_steps": 3}},
        ),
    ):
        assert validate(cfg, base_dir=REPO)["sft"]["lr_scheduler_type"] == cfg["sft"]["lr_scheduler_type"]


@pytest.fixture
def restored(monkeypatch):
    """transformers' schedule table as it was, after the test."""
    table, key = optimization.TYPE_TO_SCHEDULER_FUNCTION, SchedulerType.WARMUP_STABLE_DECAY
    monkeypatch.setitem(table, key, table[key])


def rates(kwargs=None, total=20, warmup=2) -> list[float]:
    """The learning rate of each of `total` optimizer steps, as the trainer creates the schedule."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = get_scheduler(
        "warmup_stable_decay", opt, num_warmup_steps=warmup, num_training_steps=total,
        scheduler_specific_kwargs=kwargs,
    )  # fmt: skip
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_warmup_stable_decay_decays_over_the_ratio_of_the_trainers_steps(restored):
    with pytest.raises(TypeError):  # transformers alone needs the decay in steps
        rates()
    # LLaMA-Factory fills the phases in itself (a third held, two thirds decaying) when the config
    # gives none: as it would for these 20 steps, and as transformers runs them
    lf = {"num_stable_steps": 6, "num_decay_steps": 12}
    assert rates(lf)[2:9] == [1.0] * 7 and rates(lf)[9] < 1.0
    schedule.install(0.25)
    schedule.install(0.25)  # a second install wraps transformers' function, not the wrapper
    lr = rates(lf)
    assert rates() == lr  # the ratio replaces LLaMA-Factory's phases, or stands in for none
    assert lr[:2] == [0.0, 0.5]  # the warm-up (2 steps)
    # the peak, held until the decay (the last 25 %: 5 of 20 steps) starts, then a cosine towards zero
    assert lr[2:16] == [1.0] * 14
    assert all(a > b for a, b in zip(lr[15:], lr[16:], strict=False)) and lr[-1] < 0.1
    assert schedule.decay_steps(0.25, 20) == 5 and schedule.decay_steps(0.01, 20) == 1


def rendered(cfg: dict, tiny, path) -> dict:
    return render(
        Config.from_dict(cfg),
        tiny,
        "d",
        str(path),
        str(path.with_suffix(".json")),
        "w",
        Platform.declared(Config.from_dict(cfg)),
    )


def test_the_rendered_yaml_carries_the_ratio_for_the_launcher(tmp_path):
    tiny = tiny_config(tmp_path / "tiny")
    cfg = validate(with_sft(lr_scheduler_type="warmup_stable_decay", decay_ratio=0.3), base_dir=REPO)
    args = rendered(cfg, tiny, tmp_path / "a.yaml")
    assert args["lr_scheduler_type"] == "warmup_stable_decay" and args["llmft"]["decay_ratio"] == 0.3
    assert "its decay is the last 0.3 of the optimizer steps" in (tmp_path / "a.yaml").read_text()
    # a cosine schedule, or warmup_stable_decay with its phases in steps (LLaMA-Factory's own
    # handling): nothing for the launcher
    kwargs = {"lr_scheduler_kwargs": {"num_decay_steps": 4}}
    for sft in ({}, {"lr_scheduler_type": "warmup_stable_decay", "extra": kwargs}):
        cfg = validate(with_sft(**sft), base_dir=REPO)
        args = rendered(cfg, tiny, tmp_path / "b.yaml")
        assert "decay_ratio" not in args["llmft"]
