# The preference stage's helpers (DPO, ORPO, SimPO, KTO; config key preference); its rules are in
# preference.smk, which includes this file first (a snakefile holds rules or functions, not both).
# Planned and rendered like sft from the nodes' facts, through sft's own planner and renderer on the
# stage's view of the config and its training objective (llmft.preference.stage), then trained by
# sft's three steps on the same partition and launcher.
from llmft.core.config import is_preference_metric
from llmft.preference import stage as preference_stage
from llmft.preference.page import reference_model as pref_reference_model

PREF = SETTINGS.preference

try:
    # As sft's (common.smk): a preference stage that could fit on no node of the declared kind stops
    # here, naming the keys to change.
    if PREF is not None:
        _staged = preference_stage.training(SETTINGS)
        precheck(_staged.cfg, _staged.objective_for)
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")


def preference_published():
    """The folders the preference stage publishes (final_outputs): its model, and LoRA's adapter."""
    if PREF is None:
        return []
    published = [f"results/{RUN}/preference/model"]
    if preference_stage.finetuning_type(SETTINGS) == "lora":
        published.append(f"results/{RUN}/preference/adapter")
    return published


STAGE_OUTPUTS.append(preference_published)
# The report reads the section, and (common.smk's report_optional_keys) then nightly.metric too.
REPORT_STAGE_KEYS.extend(("preference",) if PREF is not None else ())


def preference_inputs(wildcards):
    """The files prepare_preference reads: data files, and for a LLaMA-Factory entry its file and
    its dataset_info.json; the builtin task is made in the job."""
    out = []
    for i, src in enumerate(PREF.data.sources):
        if src.get("dataset_info"):
            where = f"preference.data.sources[{i}]"
            entry = resolve_lf_entry(src, Path.cwd(), where=where, preference=True)
            out += [entry["path"], entry["dataset_info"]]
        elif not src["path"].startswith("builtin:"):
            out.append(src["path"])
    return out


def preference_data_cfg(wildcards):
    """prepare_preference's config slice (a function: without a preference section there is none)."""
    return cfg_arg(
        "preference.data",
        "preference.method",
        "data.clean_text",
        "data.max_row_bytes",
        "model.template",
    )


def preference_output_log(wildcards):
    """Where the preference stage's steps append their output (as sft_output_log)."""
    return f"results/{wildcards.run}/logs/preference.log"


def preference_start(wildcards):
    """The model the preference stage trains: sft's published model, or the base model."""
    if PREF.start_from == "sft":
        return f"results/{wildcards.run}/sft/model"
    return base_model_dir(wildcards)


def preference_reference(wildcards):
    """The reference model's folder when it is not the starting model (reference: base), else none."""
    if preference_stage.reference(SETTINGS) == "base":
        return {"ref": base_model_dir(wildcards)}
    return {}


# preference.reference_logps: cached (auto: on GPUs) puts the reference step in the DAG; training
# then loads no reference model.
PREF_CACHED = (
    PREF is not None and preference_stage.reference_logps(SETTINGS)[0] == "cached"
)


def preference_reference_model(wildcards):
    """The reference model's folder: the base model (reference: base) or the starting model."""
    if preference_stage.reference(SETTINGS) == "base":
        return base_model_dir(wildcards)
    return preference_start(wildcards)


def preference_reference_record(wildcards):
    """The reference step's record, an input of the stage's render and training when cached."""
    if not PREF_CACHED:
        return {}
    return {
        "reference_record": preference_stage.REFERENCE_RECORD.format(run=wildcards.run)
    }


def preference_ref_arg(wildcards, input):
    """render-sft's reference-model words, quoted by the rule's {params.ref:q}; none without one."""
    return ["--ref-model", input.ref] if "ref" in input.keys() else []


def preference_adapter_output():
    """The preference stage's extra output under LoRA: its new adapter, beside the merged model."""
    if PREF is None or preference_stage.finetuning_type(SETTINGS) != "lora":
        return {}
    return {"adapter": directory("results/{run}/preference/adapter")}


def preference_eval_model(wildcards):
    """base, tuned (sft's model) or preference."""
    if wildcards.model == "base":
        return base_model_dir(wildcards)
    return f"results/{wildcards.run}/{'sft' if wildcards.model == 'tuned' else 'preference'}/model"


def preference_eval_inputs(wildcards):
    """What the report adds with a preference stage: its training summary and each model's
    log-probabilities of the held-out answers; none without one."""
    if PREF is None:
        return []
    return [f"results/{wildcards.run}/preference/train_summary.json"] + expand(
        "results/{run}/preference/eval/{model}/logps.jsonl",
        run=wildcards.run,
        model=("base", "tuned", "preference"),
    )


# -- the nightly gate on a preference metric (evaluate_preference_gate) --------------------------------
PREF_GATE = bool(SETTINGS.nightly.compare_with) and is_preference_metric(
    SETTINGS.nightly.metric
)
if PREF_GATE:

    # The promoted run's preference model is scored on this run's pairs: a run without one (trained
    # before the preference section was set) cannot be compared on the metric. Once scored it is not
    # read again (a later `snakemake --forcerun report` of this run, after retention deleted it).
    _promoted_pref = Path(SETTINGS.nightly.compare_with) / "preference" / "model"
    _scored = Path(f"results/{RUN}/preference/gate/promoted/logps.jsonl")
    if not _promoted_pref.is_dir() and not _scored.is_file():
        sys.exit(
            f"llmft config error: config key nightly.metric: {SETTINGS.nightly.metric} compares the "
            f"preference models, but the promoted run {Path(SETTINGS.nightly.compare_with).name} "
            f"(nightly.compare_with) has none ({_promoted_pref} does not exist); promote a run with a "
            "preference stage (`llmft promote RUN`) or gate on another metric"
        )


def pref_gate_sides():
    """evaluate_preference_gate's jobs: this run's preference model (gate) and the promoted run's
    (promoted); with a reference model also theirs: reference base, the one base model for both
    (gate_reference); reference sft, each run's own sft model (gate_reference, promoted_reference).
    """
    ref = pref_reference_model(SETTINGS)
    return {
        "none": [],
        "base": ["gate_reference"],
        "sft": ["gate_reference", "promoted_reference"],
    }[ref] + ["gate", "promoted"]


def pref_gate_model(wildcards):
    """The model evaluate_preference_gate scores, when it is this run's (or the base model)."""
    if wildcards.side == "gate":
        return f"results/{wildcards.run}/preference/model"
    if wildcards.side == "gate_reference":
        if pref_reference_model(SETTINGS) == "base":
            return base_model_dir(wildcards)
        return f"results/{wildcards.run}/sft/model"
    # not an input (see eval_model): the promoted run's folders, checked before any job
    return []


def pref_gate_model_path(wildcards, input):
    """The model folder evaluate_preference_gate scores (promoted: nightly.compare_with's)."""
    promoted = SETTINGS.nightly.compare_with
    if wildcards.side == "promoted":
        return f"{promoted}/preference/model"
    if wildcards.side == "promoted_reference":
        return f"{promoted}/sft/model"
    return input.model


def pref_gate_cache_keys():
    """The gate's extra config keys when its reference models' scores come from the reference store:
    the precision the store is kept in."""
    return ("sft.precision",) if PREF_CACHED else ()


def pref_gate_cache_words(wildcards):
    """evaluate-preference's words for a reference model's side with cached reference log-probabilities
    (quoted by the rule's {params.cache:q}): read from the shared reference store."""
    if PREF_CACHED and wildcards.side.endswith("_reference"):
        return ["--reference-cache", "results/cache/reference"]
    return []


def preference_gate_inputs(wildcards):
    """The nightly gate's scores on a preference nightly.metric (compared_inputs): the preference
    models (and reference models) on this run's held-out pairs."""
    return expand(
        "results/{run}/preference/gate/{side}/logps.jsonl",
        run=wildcards.run,
        side=pref_gate_sides(),
    )


if PREF_GATE:
    STAGE_GATE_INPUTS = preference_gate_inputs
