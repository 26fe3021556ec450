"""Preference evaluation on the held-out pairs (or KTO rows): each model's log-likelihood of every
answer, through evaluate's own batched loss pass, and the scores the page compares.

Per model (base, sft, preference-tuned) `logps.jsonl` holds, per held-out row, the summed
log-probability of each answer given the prompt (as LLaMA-Factory's template encodes them). Scores
need two models' files, the model and the stage's reference:

- implicit reward r(y) = beta * (log pi(y|x) - log ref(y|x)) (DPO sigmoid, KTO; for base and sft the
  reference is also the stage's reference model, so the model that is the reference scores 0: no
  pair is ranked); without a reference (orpo, simpo) r(y) = beta * log pi(y|x) / |y|, SimPO's
  length-normalised reward;
- DPO: preference_accuracy = share of pairs with r(chosen) > r(rejected), reward_margin = mean of
  r(chosen) - r(rejected);
- KTO: preference_accuracy = share of rows whose reward has the tag's sign (desirable > 0,
  undesirable < 0), reward_margin = mean r over desirable rows - mean r over undesirable rows;
- likelihood_accuracy (any model, no reference): share of pairs whose chosen answer is more likely
  than the rejected one (KTO: a desirable and an undesirable answer to the same prompt);
  likelihood_margin: the mean of log pi(chosen) - log pi(rejected) over those pairs, in nats. Both
  compare any two models as they are, where a reward against the reference scores the reference
  itself 0 by construction (DPO's reward_margin is beta x the policy's likelihood_margin minus the
  reference's).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from llmft.core.conversation import ROLE_OF
from llmft.core.heldout import heldout_fingerprint, heldout_rows
from llmft.core.io import read_json, read_jsonl, write_json, write_jsonl
from llmft.core.settings import Config, Preference

log = logging.getLogger("llmft.evaluate")

# evaluate's loss pass (llmft.evaluate.run.answer_nll), given by the CLI: (cfg, model folder, rows in
# messages form, threads) -> {row index: (summed NLL of its last message, its tokens)}.
ScoreAnswers = Callable[[Config, str, list, int], dict]
# evaluate's generation pass (llmft.evaluate.run.evaluate), given by the CLI.
Generate = Callable[..., dict]


def _msg(m: dict) -> dict:
    role = m.get("from", m.get("role"))
    return {"role": ROLE_OF.get(role, role), "content": m.get("value", m.get("content", ""))}


def answer_rows(pref_rows: list[dict]) -> tuple[str, list[dict]]:
    """(dpo | kto, rows in evaluate's messages form: one per answer). A DPO pair gives two rows, chosen
    then rejected; a KTO row one."""
    out = []
    kind = "kto" if pref_rows and "kto_tag" in pref_rows[0] else "dpo"
    for row in pref_rows:
        extra = {k: row[k] for k in ("system", "tools", "task") if row.get(k)}
        msgs = [_msg(m) for m in row["messages"]]
        if kind == "dpo":
            out += [{"messages": [*msgs, _msg(row[side])], **extra} for side in ("chosen", "rejected")]
        else:
            out.append({"messages": msgs, **extra})
    return kind, out


def logps(
    cfg: Config,
    model_dir: str,
    heldout: str,
    out: str,
    threads: int = 0,
    max_rows: int | str | None = None,
    *,
    score_answers: ScoreAnswers,
) -> list[float]:
    """Summed answer log-probabilities of every answer row under `model_dir` (evaluate's loss pass,
    `score_answers`: llmft.evaluate.run.answer_nll; no generation), written to `out` with the row's
    answer length and tag; beside it `rows.json`: how many held-out rows were scored and their
    fingerprint (the nightly gate compares two models' scores only on the same rows). `max_rows`:
    the first N rows, "all", None: eval.max_rows."""
    pref_rows = heldout_rows(heldout, cfg.eval.max_rows, max_rows)
    kind, rows = answer_rows(pref_rows)
    nll = score_answers(cfg, model_dir, rows, threads)
    values = [-nll[i][0] for i in range(len(rows))]
    records = []
    for i, row in enumerate(pref_rows):
        if kind == "dpo":
            rec = {"chosen": values[2 * i], "rejected": values[2 * i + 1]}
            rec.update(chosen_tokens=nll[2 * i][1], rejected_tokens=nll[2 * i + 1][1])
        else:
            rec = {"logp": values[i], "tokens": nll[i][1], "kto_tag": bool(row["kto_tag"])}
        rec.update(
            index=i, kind=kind, prompt=rows[(2 if kind == "dpo" else 1) * i]["messages"][-2]["content"]
        )
        records.append(rec)
    write_jsonl(out, records)
    fingerprint = heldout_fingerprint(pref_rows)
    rows_scored = {
        "model": str(model_dir),
        "kind": kind,
        "rows": len(records),
        "heldout_fingerprint": fingerprint,
    }
    write_json(Path(out).parent / "rows.json", rows_scored)
    log.info("%s: log-probabilities of %d held-out %s rows -> %s", model_dir, len(records), kind, out)
    return values


def _reward(pol: float, ref: float | None, tokens: int, beta: float) -> float:
    if ref is None:
        return beta * pol / max(1, tokens)
    return beta * (pol - ref)


def score(policy: list[dict], reference: list[dict] | None, beta: float) -> dict:
    """preference_accuracy, reward_margin and likelihood_accuracy of one model (module docstring);
    `reference` None: the loss has no reference model."""
    if not policy:
        return {"rows": 0}
    if policy[0]["kind"] == "dpo":
        return _score_pairs(policy, reference, beta)
    return _score_kto(policy, reference, beta)


def _score_pairs(policy: list[dict], reference: list[dict] | None, beta: float) -> dict:
    wins, margins, likely, gaps = 0, [], 0, []
    for i, p in enumerate(policy):
        ref = reference[i] if reference else None
        rc = _reward(p["chosen"], ref["chosen"] if ref else None, p["chosen_tokens"], beta)
        rr = _reward(p["rejected"], ref["rejected"] if ref else None, p["rejected_tokens"], beta)
        wins += rc > rr
        margins.append(rc - rr)
        likely += p["chosen"] > p["rejected"]
        gaps.append(p["chosen"] - p["rejected"])
    n = len(policy)
    return {
        "rows": n,
        "preference_accuracy": round(wins / n, 4),
        "reward_margin": round(sum(margins) / n, 4),
        "likelihood_accuracy": round(likely / n, 4),
        "likelihood_margin": round(sum(gaps) / n, 4),
    }


def _score_kto(policy: list[dict], reference: list[dict] | None, beta: float) -> dict:
    right, by_tag = 0, defaultdict(list)
    by_prompt: dict[str, dict[bool, list[float]]] = defaultdict(lambda: defaultdict(list))
    for i, p in enumerate(policy):
        r = _reward(p["logp"], reference[i]["logp"] if reference else None, p["tokens"], beta)
        right += (r > 0) if p["kto_tag"] else (r < 0)
        by_tag[p["kto_tag"]].append(r)
        by_prompt[p["prompt"]][p["kto_tag"]].append(p["logp"])
    pairs = [(d, u) for t in by_prompt.values() for d in t[True] for u in t[False]]
    mean = {tag: sum(v) / len(v) if v else 0.0 for tag, v in ((t, by_tag[t]) for t in (True, False))}
    return {
        "rows": len(policy),
        "preference_accuracy": round(right / len(policy), 4),
        "reward_margin": round(mean[True] - mean[False], 4),
        "likelihood_accuracy": round(sum(d > u for d, u in pairs) / len(pairs), 4) if pairs else None,
        "likelihood_margin": round(sum(d - u for d, u in pairs) / len(pairs), 4) if pairs else None,
        "likelihood_pairs": len(pairs),
    }


def scores(pref: Preference, reference_of: str, files: dict[str, str]) -> dict:
    """summary.json's preference block: every model's scores against the stage's reference model
    (`reference_of`: base | sft | none; the reference's own reward scores are None); `files`:
    logps.jsonl per model (base, sft, preference)."""
    loaded = {name: read_jsonl(path) for name, path in files.items() if Path(path).is_file()}
    ref = loaded.get(reference_of) if reference_of != "none" else None
    models = {name: score(rows, ref, pref.beta) for name, rows in loaded.items()}
    if reference_of in models:
        # against itself every reward is 0: a value of the construction, not a measurement
        models[reference_of].update(preference_accuracy=None, reward_margin=None)
    return {
        "method": pref.method,
        "loss": pref.loss if pref.method == "dpo" else None,
        "beta": pref.beta,
        "reference": reference_of,
        "models": models,
    }


# What the nightly gate's rows are called, per held-out kind; the scores a gate block carries.
UNITS = {"dpo": "pairs", "kto": "KTO rows"}
GATE_SCORES = ("preference_accuracy", "reward_margin", "likelihood_accuracy")


def gate_block(pref: Preference, policy_dir: Path, reference_dir: Path | None) -> dict:
    """One model's scores for the nightly gate (summary.json `gate` or `compared_with`): the
    log-probabilities evaluate_preference_gate wrote in `policy_dir`, against its reference model's
    in `reference_dir` (None: the loss has no reference), both on the same held-out rows. The rows'
    count and fingerprint come from rows.json; a reference scored on other rows leaves the fingerprint
    None, which the gate refuses to compare."""
    rows = read_json(policy_dir / "rows.json")
    reference, fingerprint = None, rows["heldout_fingerprint"]
    if reference_dir is not None:
        reference = read_jsonl(reference_dir / "logps.jsonl")
        if read_json(reference_dir / "rows.json")["heldout_fingerprint"] != fingerprint:
            reference, fingerprint = None, None
    scored = score(read_jsonl(policy_dir / "logps.jsonl"), reference, pref.beta)
    return {
        "tuned": {m: scored.get(m) for m in GATE_SCORES},
        "heldout_rows": rows["rows"],
        "heldout_fingerprint": fingerprint,
        "rows_unit": UNITS[rows["kind"]],
        "model": rows["model"],
    }


def write_prompts(heldout: str, out: str) -> None:
    """The held-out prompts with their chosen (KTO: desirable) answer, in evaluate's row form, for the
    generation metrics."""
    kind, rows = answer_rows(read_jsonl(heldout))
    if kind == "dpo":
        keep = rows[::2]
    else:
        keep = [r for r, p in zip(rows, read_jsonl(heldout), strict=True) if p["kto_tag"]]
    write_jsonl(out, keep)


def evaluate_model(
    cfg: Config,
    model_dir: str,
    heldout: str,
    out_dir: str,
    label: str,
    threads: int = 0,
    *,
    score_answers: ScoreAnswers,
    generate: Generate,
) -> None:
    """One model's preference evaluation: log-probabilities, then generation metrics on the prompts
    (evaluate's passes, given by the CLI: llmft.evaluate.run.answer_nll and evaluate)."""
    out = Path(out_dir)
    logps(cfg, model_dir, heldout, str(out / "logps.jsonl"), threads, score_answers=score_answers)
    write_prompts(heldout, str(out / "prompts.jsonl"))
    generate(cfg, model_dir, str(out / "prompts.jsonl"), out_dir, label=label, threads=threads)
