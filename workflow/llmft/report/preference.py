"""The preference stage on the run's page and in summary.json: held-out preference accuracy, reward
margin and likelihood accuracy of base, sft and the preference-tuned model (evaluate/preference.py
says how each is counted), their generation metrics on the held-out prompts, and the stage's training
summary."""

from __future__ import annotations

from pathlib import Path

from llmft.core.io import read_json
from llmft.evaluate.preference import gate_block, scores
from llmft.report.draw import esc, table
from llmft.sft import preference as stage

# summary.json's model names -> the folders of results/<run>/preference/eval/.
MODELS = {"base": "base", "sft": "tuned", "preference": "preference"}
SCORES = ("preference_accuracy", "reward_margin", "likelihood_accuracy")
GENERATION = ("exact_match", "rouge_l", "eval_loss")


def reference_model(cfg: dict) -> str:
    """The stage's reference as a model name of the table: base | sft | none."""
    ref = stage.reference(cfg)
    if ref == "none":
        return "none"
    if ref == "base" or cfg["preference"]["start_from"] == "base":
        return "base"
    return "sft"


def load(cfg: dict, run_dir: Path) -> dict | None:
    """summary.json's `preference` block, or None without a preference stage."""
    if cfg.get("preference") is None:
        return None
    folder = run_dir / "preference"
    files = {name: str(folder / "eval" / sub / "logps.jsonl") for name, sub in MODELS.items()}
    out = scores(cfg["preference"], reference_model(cfg), files)
    for name, sub in MODELS.items():
        path = folder / "eval" / sub / "metrics.json"
        if path.is_file() and name in out["models"]:
            metrics = read_json(path)
            out["models"][name].update({m: metrics.get(m) for m in GENERATION})
    train = folder / "train_summary.json"
    if train.is_file():
        t = read_json(train)
        out["train"] = {
            k: t.get(k) for k in ("steps", "first_loss", "final_loss", "tokens_per_second_per_gpu")
        }
        out["train"]["finetuning_type"] = t.get("finetuning_type")
    return out


def gate_blocks(cfg: dict, run_dir: Path) -> tuple[dict, dict]:
    """summary.json's `gate` and `compared_with` on a preference nightly.metric: this run's preference
    model and the promoted run's (nightly.compare_with), each against its own reference model (base:
    the one base model; sft: each run's sft model), on this run's held-out pairs (preference/gate/)."""
    folder = run_dir / "preference" / "gate"
    ref = reference_model(cfg)
    own = folder / "gate_reference" if ref != "none" else None
    theirs = {"none": None, "base": own, "sft": folder / "promoted_reference"}[ref]
    promoted = {"run": Path(cfg["nightly"]["compare_with"]).name}
    return (
        gate_block(cfg["preference"], folder / "gate", own),
        {**promoted, **gate_block(cfg["preference"], folder / "promoted", theirs)},
    )


def section(block: dict | None) -> str:
    """The page's preference section ("" without a preference stage)."""
    if not block:
        return ""
    names = [n for n in MODELS if n in block["models"]]
    rows = [[m, *(block["models"][n].get(m) for n in names)] for m in (*SCORES, *GENERATION)]
    loss = f", loss {block['loss']}" if block.get("loss") else ""
    train = block.get("train") or {}
    title = f"Preference stage: {block['method']}{loss}, beta {block['beta']}"
    return f"""<h2 id="preference">{esc(title)}</h2>
{table(["held-out metric", *names], rows)}
<p class="muted">Reference model: {esc(block["reference"])} (for every row, base and sft too: the model
that is the reference ranks no pair, accuracy 0 and margin 0). preference_accuracy: pairs whose implicit
reward beta x (log pi - log ref) is higher for the chosen answer (KTO: rows whose reward has the tag's
sign); reward_margin: its mean difference; likelihood_accuracy: pairs whose chosen answer the model
itself finds more likely (no reference). Generation metrics: greedy answers to the held-out prompts
against the chosen answer. Training: {esc(train.get("steps"))} steps, loss {esc(train.get("first_loss"))}
-> {esc(train.get("final_loss"))}, {esc(train.get("tokens_per_second_per_gpu"))} tokens/s per GPU.</p>
"""
