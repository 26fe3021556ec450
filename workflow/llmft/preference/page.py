"""The preference stage on the run's page and in summary.json.

The page leads with comparisons that can fail, each model scored as it is on the held-out pairs
(preference/evaluate.py says how each is counted): likelihood accuracy and likelihood margin (no
reference model), the reward margin of every model that is not the reference, and the chosen answers'
loss, for base, sft and the preference-tuned model side by side with the tuned model's change from the
model the stage started from. The reference ranks no pair against itself (accuracy 0, margin 0 by
construction), so its reward scores are never shown as a baseline; the tuned model's preference
accuracy against it follows, alone. A run that hardly moved is named by a warning (HARDLY_MOVED) on
the page, in summary.json and in the report's log.
"""

from __future__ import annotations

import logging
from pathlib import Path

import yaml
from llmft.core.config import PREFERENCE_METRICS
from llmft.core.draw import esc, fmt, table
from llmft.core.io import read_json
from llmft.core.settings import Config
from llmft.preference import stage
from llmft.preference.evaluate import gate_block, scores

log = logging.getLogger("llmft.report")

# summary.json's model names -> the folders of results/<run>/preference/eval/.
MODELS = {"base": "base", "sft": "tuned", "preference": "preference"}
GENERATION = ("exact_match", "rouge_l", "eval_loss")
# The page's comparisons, in order; reward_margin is left blank for the reference model.
COMPARED = (
    "likelihood_accuracy",
    "likelihood_margin",
    "reward_margin",
    "eval_loss",
    "exact_match",
    "rouge_l",
)
# Significant digits of every number in the section (draw.table prints its cells with as many).
DIGITS = 4

# The reward_margin row's note: against a reference model (DPO sigmoid, KTO), or without one (orpo,
# simpo: the length-normalised reward).
REWARD_NOTE = {
    True: "the mean implicit reward beta x (log pi - log ref) of the chosen answer minus the rejected "
    "one's (KTO: of the desirable rows minus the undesirable ones) against the reference model ({ref}); "
    "the reference's own is 0 by construction and not shown.",
    False: "the mean reward beta x log pi / answer tokens of the chosen answer minus the rejected one's "
    "(no reference model).",
}

# The warning of a stage that hardly moved its model: the training loss changed by less than
# LOSS_SHARE of its first value and the held-out likelihood accuracy by less than LIKELIHOOD_POINTS
# (points of 100) from the starting model's. At the recipe rate 5e-7 the demo's DPO loss moved 0.09 %
# and its likelihood accuracy not at all; a run that learned moves both by far more.
HARDLY_MOVED = "preference_hardly_moved"
LOSS_SHARE = 0.01
LIKELIHOOD_POINTS = 2.0


def reference_model(cfg: Config) -> str:
    """The stage's reference as a model name of the table: base | sft | none."""
    ref = stage.reference(cfg)
    if ref == "none":
        return "none"
    if ref == "base" or cfg.preference.start_from == "base":
        return "base"
    return "sft"


def hardly_moved(block: dict) -> dict | None:
    """The HARDLY_MOVED warning of summary.json's preference block (its numbers and a message), or
    None when the run moved, or its training loss or likelihood accuracies are missing."""
    train = block.get("train") or {}
    first, final = train.get("first_loss"), train.get("final_loss")
    before = block["models"].get(block["start"], {}).get("likelihood_accuracy")
    after = block["models"].get("preference", {}).get("likelihood_accuracy")
    if None in (first, final, before, after) or first == 0:
        return None
    loss_pct = 100 * (final - first) / abs(first)
    points = 100 * (after - before)
    if abs(loss_pct) >= 100 * LOSS_SHARE or abs(points) >= LIKELIHOOD_POINTS:
        return None
    message = (
        f"{HARDLY_MOVED}: the preference stage hardly moved the model. Training loss {fmt(first, DIGITS)} -> "
        f"{fmt(final, DIGITS)} ({loss_pct:+.2g} %, under {100 * LOSS_SHARE:g} %) and held-out likelihood "
        f"accuracy {fmt(before, DIGITS)} ({block['start']}) -> {fmt(after, DIGITS)} ({points:+.2g} points, "
        f"under {LIKELIHOOD_POINTS:g}) over {train.get('steps')} steps at learning rate "
        f"{train.get('learning_rate')}; raise preference.learning_rate or preference.num_train_epochs."
    )
    return {
        "name": HARDLY_MOVED,
        "loss_change_percent": round(loss_pct, 3),
        "likelihood_accuracy_change_points": round(points, 2),
        "thresholds": {
            "loss_change_percent": 100 * LOSS_SHARE,
            "likelihood_accuracy_points": LIKELIHOOD_POINTS,
        },
        "message": message,
    }


def load(cfg: Config, run_dir: Path) -> dict | None:
    """summary.json's `preference` block, or None without a preference stage."""
    if cfg.preference is None:
        return None
    folder = run_dir / "preference"
    files = {name: str(folder / "eval" / sub / "logps.jsonl") for name, sub in MODELS.items()}
    out = scores(cfg.preference, reference_model(cfg), files)
    out["start"] = "base" if cfg.preference.start_from == "base" else "sft"
    for name, sub in MODELS.items():
        path = folder / "eval" / sub / "metrics.json"
        if path.is_file() and name in out["models"]:
            metrics = read_json(path)
            out["models"][name].update({m: metrics.get(m) for m in GENERATION})
    train = folder / "train_summary.json"
    if train.is_file():
        t = read_json(train)
        keys = (
            "steps",
            "first_loss",
            "final_loss",
            "eval_loss",
            "tokens_per_second_per_gpu",
            "finetuning_type",
        )
        out["train"] = {k: t.get(k) for k in keys}
        # the rate it trained at, as rendered (`auto` resolves by the code of its day)
        rendered = folder / "llamafactory.yaml"
        args = yaml.safe_load(rendered.read_text()) if rendered.is_file() else {}
        out["train"]["learning_rate"] = args.get("learning_rate")
    warning = hardly_moved(out)
    out["warnings"] = [warning] if warning else []
    if warning:
        log.warning("%s", warning["message"])
    return out


def gate_blocks(cfg: Config, run_dir: Path) -> tuple[dict, dict]:
    """The nightly gate's two sides on a preference nightly.metric (gate.json's and summary.json's
    `gate` and `compared_with`; `llmft gate` gives this to llmft.nightly.gate): this run's preference
    model and the promoted run's (nightly.compare_with), each against its own reference model (base:
    the one base model; sft: each run's sft model), on this run's held-out pairs (preference/gate/)."""
    folder = run_dir / "preference" / "gate"
    ref = reference_model(cfg)
    own = folder / "gate_reference" if ref != "none" else None
    theirs = {"none": None, "base": own, "sft": folder / "promoted_reference"}[ref]
    promoted = {"run": Path(cfg.nightly.compare_with).name}
    return (
        gate_block(cfg.preference, folder / "gate", own),
        {**promoted, **gate_block(cfg.preference, folder / "promoted", theirs)},
    )


def comparison_rows(block: dict) -> list[list]:
    """One row per COMPARED metric: each model's value, then the tuned model's change from the model
    the stage started from; the reference's reward_margin is the word "reference" and has no change."""
    names = [n for n in MODELS if n in block["models"]]
    rows = []
    for m in COMPARED:
        values = {n: block["models"][n].get(m) for n in names}
        if all(v is None for v in values.values()):
            continue
        cells = [
            "reference" if (m == "reward_margin" and n == block["reference"]) else values[n] for n in names
        ]
        start, tuned = values.get(block["start"]), values.get("preference")
        change = "" if None in (start, tuned) else f"{tuned - start:+.{DIGITS}g}"
        rows.append([m, *cells, change])
    return rows


def section(block: dict | None) -> str:
    """The page's preference section ("" without a preference stage)."""
    if not block:
        return ""
    names = [n for n in MODELS if n in block["models"]]
    loss = f", loss {block['loss']}" if block.get("loss") else ""
    title = f"Preference stage: {block['method']}{loss}, beta {block['beta']}"
    warnings = "".join(
        f'<p class="verdict warn">{esc(w["message"])}</p>\n' for w in block.get("warnings", [])
    )
    ref, start = block["reference"], block["start"]
    tuned = block["models"].get("preference", {})
    accuracy = ""
    if ref != "none" and tuned.get("preference_accuracy") is not None:
        accuracy = f"""<p>Preference-tuned model against its reference ({esc(ref)}): preference_accuracy
{esc(fmt(tuned["preference_accuracy"], DIGITS))}, the share of held-out pairs whose implicit reward beta x
(log pi - log ref) is higher for the chosen answer (KTO: rows whose reward has the tag's sign). Any
step away from the reference moves it off 0, whatever the step learned: it is no gain over the
{esc(ref)} model, which against itself ranks no pair; the comparisons above are the ones that can
fail.</p>
"""
    train = block.get("train") or {}
    first, final = train.get("first_loss"), train.get("final_loss")
    speed = train.get("tokens_per_second_per_gpu")
    speed = f", {fmt(speed, DIGITS)} tokens/s per GPU" if speed else ""
    moved = f" ({100 * (final - first) / abs(first):+.2g} %)" if None not in (first, final) and first else ""
    held = f", held-out preference loss {fmt(train['eval_loss'], DIGITS)}" if train.get("eval_loss") else ""
    rate = f" at learning rate {train['learning_rate']:g}" if train.get("learning_rate") else ""
    return f"""<h2 id="preference">{esc(title)}</h2>
{warnings}<p>Held-out comparisons: the preference-tuned model beside the {esc(start)} model it started from
(and base); change = tuned - {esc(start)}.</p>
{table(["held-out metric", *names, "change"], comparison_rows(block))}
<p class="muted">likelihood_accuracy: pairs whose chosen answer the model itself finds more likely than
the rejected one (KTO: a desirable and an undesirable answer to one prompt); likelihood_margin: the
mean log-likelihood of the chosen answer minus the rejected one's, in nats; neither uses a reference
model. reward_margin: {esc(REWARD_NOTE[ref != "none"].format(ref=ref))} eval_loss: the chosen answers'
loss per token;
exact_match, rouge_l: greedy answers to the held-out prompts against the chosen answer.</p>
{accuracy}<p class="muted">Training: {esc(train.get("steps"))} steps{esc(rate)}, loss
{esc(fmt(first, DIGITS))} -&gt; {esc(fmt(final, DIGITS))}{esc(moved)}{esc(held)}{esc(speed)}.</p>
"""


def add_to_summary(summary: dict, block: dict) -> None:
    """The section's block in summary.json. A preference nightly.metric of a night without a promoted
    model is read from `tuned`: the run's final model, the preference-tuned one (on the page's
    eval.max_rows pairs)."""
    summary["preference"] = block
    for m in PREFERENCE_METRICS:
        summary["tuned"][m] = block["models"].get("preference", {}).get(m)
