# Helpers shared by all stages. The config is validated here, first; a wrong key or value stops the run
# before any job is submitted, naming the key.
import json
import shlex
import sys
from pathlib import Path

from snakemake.settings.types import DeploymentMethod

# llmft is importable: the Snakefile puts workflow/ on sys.path before it reads the config.
from llmft.core.lf.chat_templates import AUTO as AUTO_TEMPLATE
from llmft.core.lf.chat_templates import for_workflow as template_for_workflow
from llmft.core.config import (
    BUILTIN_DATA,
    BUILTIN_MODEL,
    PREFERENCE_METRICS,
    ConfigError,
    layout,
    validate,
)
from llmft.core.lf.lfdataset import resolve as resolve_lf_entry
from llmft.sft import preference as preference_stage
from llmft.sft.render import precheck
from llmft.core.slurm import launcher_resources_error, launcher_words, profile_mismatch

try:
    CFG = validate(config, base_dir=Path.cwd())
    # A config that could fit on no node of the declared kind stops here, naming the keys to
    # change; the plan sft trains with is made later from the nodes' facts (render_sft_config).
    precheck(CFG)
    if CFG.get("preference") is not None:
        precheck(preference_stage.view(CFG))
except ConfigError as exc:
    # The message alone, first and last: Snakemake would print a file, a line and a trace around it.
    sys.exit(f"llmft config error: {exc}")

# model.template: auto becomes one name here, so every stage gets the same one through cfg_arg; the
# template must fit the tokenizer (its special tokens in the vocabulary, its ids in the embedding
# table).
try:
    _template, _why = template_for_workflow(CFG, Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")
if CFG["model"]["template"] == AUTO_TEMPLATE:
    print(f"llmft: model.template auto -> {_template} ({_why})", file=sys.stderr)
CFG["model"]["template"] = _template

# model.continue_from: the parent run is checked (finished, readable, same base model, tokenizer,
# template, finetuning type and split) and a link to it (results/current) resolved to its folder,
# which every job then sees.
from llmft.core.lineage import resolve as resolve_parent

try:
    LINEAGE = resolve_parent(CFG, Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")

# The run's published folders against the seals their stage wrote: weights changed in place at the
# same size keep their times as Snakemake sees them (a folder's), so its scores and page would
# silently describe other weights. Only files changed since they were last verified are read.
from llmft.core.lineage import published_problems

_changed = published_problems(Path("results") / CFG["run"])
if _changed:
    sys.exit(
        f"llmft config error: run {CFG['run']}: {_changed[0]}; its scores and page describe the "
        "weights published then: restore the folder, or delete it to train it again"
    )


# A Slurm profile that asks for GPUs for a CPU config (or another count than the config's) is
# refused here, before any job; the local executor requests none.
# The resources per_node_launcher writes into a shell line (mpi, cpus_per_task) must be a launcher
# command and a count.
_mismatch = profile_mismatch(
    CFG["hardware"], workflow.resource_settings
) or launcher_resources_error(workflow.resource_settings)
if _mismatch:
    sys.exit(f"llmft config error: {_mismatch}")

RUN = CFG["run"]
LAYOUT = layout(CFG)


PREF = CFG.get("preference")


def final_outputs():
    """What a run promises: the page, its summary, the published model (and LoRA's adapter); with a
    preference section the preference stage's too. Each is a target, so one deleted after a finished
    run is made again: a missing input of a job whose own outputs are current is not rebuilt by
    Snakemake."""
    published = [f"results/{RUN}/sft/model"]
    if CFG["sft"]["finetuning_type"] == "lora":
        published.append(f"results/{RUN}/sft/adapter")
    if PREF is not None:
        published.append(f"results/{RUN}/preference/model")
        if preference_stage.finetuning_type(CFG) == "lora":
            published.append(f"results/{RUN}/preference/adapter")
    return [
        f"results/{RUN}/report/index.html",
        f"results/{RUN}/report/summary.json",
        *published,
    ]


# The eval keys of the benchmark jobs: in the slice of a stage that reads them only (benchmarks=True),
# so adding a benchmark reruns neither evaluate nor, without benchmarks, the report.
BENCH_KEYS = (
    "benchmarks",
    "benchmark_backend",
    "benchmark_include_path",
    "benchmark_data_cache",
)


def cfg_arg(*keys, benchmarks=False):
    """`--config-json '<subset>'`: the config keys a rule depends on, and only those.

    Snakemake reruns a job when its params change, so each stage sees just its own slice; a new
    learning rate reruns sft, evaluate and report, never data preparation.
    """
    subset = {"run": RUN}
    for dotted in keys:
        src, dst = CFG, subset
        parts = dotted.split(".")
        for part in parts[:-1]:
            src = src[part]
            dst = dst.setdefault(part, {})
        dst[parts[-1]] = src[parts[-1]]
    if not benchmarks and isinstance(subset.get("eval"), dict):
        subset["eval"] = {
            k: v for k, v in subset["eval"].items() if k not in BENCH_KEYS
        }
    return f"--config-json {shlex.quote(json.dumps(subset, sort_keys=True))}"


def continue_keys(*keys):
    """The continue keys a stage reads, only in a continued run: other runs' params (and so what
    Snakemake reruns) stay as they were."""
    return keys if LINEAGE else ()


def parent_marker():
    """What of the parent a continued run's data depends on: its data fingerprint (a parent that
    prepared other rows changes which rows are new)."""
    if not LINEAGE:
        return ""
    stats = Path(CFG["model"]["continue_from"]) / "data" / "stats.json"
    return json.loads(stats.read_text()).get("fingerprint", "")


def base_model_dir(wildcards):
    name = CFG["model"]["name_or_path"]
    return f"results/{wildcards.run}/base_model" if name == BUILTIN_MODEL else name


def dataset_inputs(wildcards):
    """The data files prepare_data reads; for a LLaMA-Factory dataset entry, the entry's file and
    the dataset_info.json (editing the entry's columns or tags changes what is read)."""
    out = []
    for i, src in enumerate(CFG["data"]["sources"]):
        if src.get("dataset_info"):
            entry = resolve_lf_entry(src, Path.cwd(), where=f"data.sources[{i}]")
            out += [entry["path"], entry["dataset_info"]]
        elif src["path"] == BUILTIN_DATA:
            out.append(f"results/{wildcards.run}/data/synthetic.jsonl")
        else:
            out.append(src["path"])
    return out


def preference_inputs(wildcards):
    """The files prepare_preference reads: data files, and for a LLaMA-Factory entry its file and
    its dataset_info.json; the builtin task is made in the job."""
    out = []
    for i, src in enumerate(CFG["preference"]["data"]["sources"]):
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


def per_node_resources():
    """Slurm resources of a stage that runs once per node (verify_env, sft).

    On several nodes the job declares `mpi`: without it the Slurm plugin runs the rule under
    `srun -n1`, on one node; with it the rule's own shell starts one task per node (per_node_launcher).
    One node is a plain job: the plugin rejects `mpi` with a single task.
    """
    if LAYOUT.nodes > 1:
        return {"nodes": LAYOUT.nodes, "tasks": LAYOUT.nodes, "mpi": "srun"}
    return {"nodes": 1, "tasks": 1}


def per_node_launcher(wildcards, resources, threads):
    """Prefix that runs a stage's command once on every node of its job; "" on one node.

    `--cpus-per-task` is repeated because since Slurm 22.05 srun no longer inherits it from the job
    (and the jobstep plugin strips SRUN_CPUS_PER_TASK): without it each node's launcher, and all its
    ranks, would be bound to one CPU on clusters that bind tasks to cores.
    """
    if LAYOUT.nodes == 1:
        return ""
    cpus = resources.get("cpus_per_task") or threads
    return shlex.join(launcher_words(resources.get("mpi"), LAYOUT.nodes, cpus))


def stage_container(per_node=False):
    """The image of a stage's `container:` (None: none). A stage that starts one task per node with
    its own `srun` (per_node_launcher) runs that srun on the job's host, where Slurm's tools are, and
    enters the image inside it instead (stage_python)."""
    if per_node and LAYOUT.nodes > 1:
        return None
    return CFG["container"]["image"] or None


def stage_python():
    """`python` for verify_env and sft, as words for `{params.python:q}`: inside the image when
    they srun one task per node."""
    image = CFG["container"]["image"]
    settings = workflow.deployment_settings
    if (
        not image
        or LAYOUT.nodes == 1
        or DeploymentMethod.APPTAINER not in settings.deployment_method
    ):
        return ["python"]
    return ["apptainer", "exec", *shlex.split(settings.apptainer_args), image, "python"]


def quantization_keys():
    """The keys that make verify_env check bitsandbytes, only when they ask for it: switching between
    full, freeze and plain LoRA does not rerun verify_env."""
    if CFG["sft"]["quantization_bit"] == "none":
        return []
    return ["sft.finetuning_type", "sft.quantization_bit"]


def sft_adapter_output():
    """sft's extra output under LoRA: the adapter, beside the merged model."""
    if CFG["sft"]["finetuning_type"] != "lora":
        return {}
    return {"adapter": directory("results/{run}/sft/adapter")}


def sft_output_log(wildcards):
    """Where sft's steps append their output: not its declared log, which Snakemake deletes first."""
    return f"results/{wildcards.run}/logs/sft.log"


def preference_output_log(wildcards):
    """The same for the preference stage."""
    return f"results/{wildcards.run}/logs/preference.log"


# The shell of a training stage (sft, preference): check (the verify_env gate), launch (once per
# node), finalize (publish); bash stops at the first that fails. See the sft rule for the logs.
_TRAIN_SHELL = """
        echo "[llmft] STAGE job started $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname): output in" {params.out:q} | tee {log:q} >>{params.out:q}
        from=$(stat -c %s {params.out:q})
        trap 'tail -c +$((from + 1)) {params.out:q} | tail -n 60 >>{log:q}' EXIT
        rm -f {params.page:q}
        {params.python:q} -m llmft sft check --config {input.config:q} --yaml {input.yaml:q} --verify {input.verify:q} >>{params.out:q} 2>&1
        {params.launcher} {params.python:q} -m llmft sft launch --config {input.config:q} --yaml {input.yaml:q} >>{params.out:q} 2>&1
        {params.python:q} -m llmft sft finalize --config {input.config:q} --yaml {input.yaml:q} --model-out {output.model:q} --summary-out {output.summary:q} >>{params.out:q} 2>&1
        """


def train_shell(stage):
    """The training shell of `stage` (its name in the first line it logs)."""
    return _TRAIN_SHELL.replace("STAGE", stage, 1)


def preference_start(wildcards):
    """The model the preference stage trains: sft's published model, or the base model."""
    if PREF["start_from"] == "sft":
        return f"results/{wildcards.run}/sft/model"
    return base_model_dir(wildcards)


def preference_reference(wildcards):
    """The reference model's folder when it is not the starting model (reference: base), else none."""
    if preference_stage.reference(CFG) == "base":
        return {"ref": base_model_dir(wildcards)}
    return {}


def preference_ref_arg(wildcards, input):
    """render-sft's reference-model words, quoted by the rule's {params.ref:q}; none without one."""
    return ["--ref-model", input.ref] if "ref" in input.keys() else []


def preference_adapter_output():
    if PREF is None or preference_stage.finetuning_type(CFG) != "lora":
        return {}
    return {"adapter": directory("results/{run}/preference/adapter")}


def preference_eval_model(wildcards):
    """base, tuned (sft's model) or preference."""
    if wildcards.model == "base":
        return base_model_dir(wildcards)
    return f"results/{wildcards.run}/{'sft' if wildcards.model == 'tuned' else 'preference'}/model"


# The report's config keys gain `preference` only when the section is set, and `nightly.metric` (the
# gate's metric, first on the page's gate table) only with it or with nightly.compare_with: a run
# with neither renders the same report params as before.
REPORT_OPTIONAL_KEYS = (("preference",) if PREF is not None else ()) + (
    ("nightly.metric",) if PREF is not None or CFG["nightly"]["compare_with"] else ()
)


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


def run_page(wildcards):
    """The run's page and summary.json, which sft removes before it replaces their model."""
    return [
        f"results/{wildcards.run}/report/{name}"
        for name in ("index.html", "summary.json")
    ]


def eval_model(wildcards):
    if wildcards.which in ("tuned", "gate"):
        return f"results/{wildcards.run}/sft/model"
    if wildcards.which == "promoted":
        # not an input: results/<that run>/sft/model matches sft's output, and Snakemake would try
        # to rebuild that run with this run's config; the nightly checked the folder before any job
        return []
    return base_model_dir(wildcards)


def eval_model_path(wildcards, input):
    """The model folder evaluate scores: its input, or (which=promoted) nightly.compare_with's model."""
    if wildcards.which == "promoted":
        return f"{CFG['nightly']['compare_with']}/sft/model"
    return input.model


def gate_rows_words():
    """`--max-rows` of the nightly gate's evaluations: every held-out row, or nightly.gate_max_rows;
    a word list, quoted by the rules' {params.rows:q}."""
    return ["--max-rows", str(CFG["nightly"]["gate_max_rows"] or "all")]


def eval_rows(wildcards):
    """evaluate's row words: none for base and tuned (eval.max_rows, the page's rows); the gate's
    (gate_rows_words) for the two models the nightly gate compares.
    """
    return gate_rows_words() if wildcards.which in ("promoted", "gate") else []


def compared_inputs(wildcards):
    """The gate's scores, when the nightly asks for them (nightly.compare_with): the promoted model
    and this run's tuned model, both on the gate's held-out rows; with a preference nightly.metric
    their preference models (and reference models) on the held-out pairs instead."""
    if not CFG["nightly"]["compare_with"]:
        return []
    if PREF_GATE:
        return expand(
            "results/{run}/preference/gate/{side}/logps.jsonl",
            run=wildcards.run,
            side=pref_gate_sides(),
        )
    return expand(
        "results/{run}/eval/{which}/metrics.json",
        run=wildcards.run,
        which=("promoted", "gate"),
    )


# -- the nightly gate on a preference metric (rules/preference.smk, evaluate_preference_gate) -------
PREF_GATE = (
    bool(CFG["nightly"]["compare_with"])
    and CFG["nightly"]["metric"] in PREFERENCE_METRICS
)
if PREF_GATE:
    from llmft.report.preference import reference_model as pref_reference_model

    # The promoted run's preference model is scored on this run's pairs: a run without one (trained
    # before the preference section was set) cannot be compared on the metric. Once scored it is not
    # read again (the night re-renders the page after retention).
    _promoted_pref = Path(CFG["nightly"]["compare_with"]) / "preference" / "model"
    _scored = Path(f"results/{RUN}/preference/gate/promoted/logps.jsonl")
    if not _promoted_pref.is_dir() and not _scored.is_file():
        sys.exit(
            f"llmft config error: config key nightly.metric: {CFG['nightly']['metric']} compares the "
            f"preference models, but the promoted run {Path(CFG['nightly']['compare_with']).name} "
            f"(nightly.compare_with) has none ({_promoted_pref} does not exist); promote a run with a "
            "preference stage (`llmft promote RUN`) or gate on another metric"
        )


def pref_gate_sides():
    """evaluate_preference_gate's jobs: this run's preference model (gate) and the promoted run's
    (promoted); with a reference model also theirs: reference base, the one base model for both
    (gate_reference); reference sft, each run's own sft model (gate_reference, promoted_reference).
    """
    ref = pref_reference_model(CFG)
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
        if pref_reference_model(CFG) == "base":
            return base_model_dir(wildcards)
        return f"results/{wildcards.run}/sft/model"
    # not an input (see eval_model): the promoted run's folders, checked before any job
    return []


def pref_gate_model_path(wildcards, input):
    """The model folder evaluate_preference_gate scores (promoted: nightly.compare_with's)."""
    promoted = CFG["nightly"]["compare_with"]
    if wildcards.side == "promoted":
        return f"{promoted}/preference/model"
    if wildcards.side == "promoted_reference":
        return f"{promoted}/sft/model"
    return input.model


# -- eval.benchmarks (rules/benchmarks.smk) -------------------------------------------------------
from llmft.benchmarks.tasks import check as check_benchmarks

try:
    # An unknown task (with close matches) or one whose data is not here stops the run before any job.
    check_benchmarks(CFG["eval"], Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")


def benchmark_inputs(wildcards):
    """The two benchmark scores the run's report compares; none without benchmarks."""
    if not CFG["eval"]["benchmarks"]:
        return []
    return expand(
        "results/{run}/bench/{which}/scores.json",
        run=wildcards.run,
        which=("base", "tuned"),
    )
