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
from llmft.core.config import BUILTIN_DATA, BUILTIN_MODEL, ConfigError, validate
from llmft.core.lf.lfdataset import resolve as resolve_lf_entry
from llmft.core.settings import Config
from llmft.core.settings import replace as replace_setting
from llmft.sft.render import precheck
from llmft.core.slurm import launcher_resources_error, launcher_words, profile_mismatch

try:
    # A config that could fit on no node of the declared kind stops here, naming the keys to
    # change; the plan sft trains with is made later from the nodes' facts (render_sft_config).
    # (Another training stage's config is checked so by its own snakefile: rules/preference_helpers.smk.)
    SETTINGS = Config.from_dict(validate(config, base_dir=Path.cwd()))
    precheck(SETTINGS)
except ConfigError as exc:
    # The message alone, first and last: Snakemake would print a file, a line and a trace around it.
    sys.exit(f"llmft config error: {exc}")

# model.template: auto becomes one name here, so every stage gets the same one through cfg_arg; the
# template must fit the tokenizer (its special tokens in the vocabulary, its ids in the embedding
# table).
try:
    _template, _why = template_for_workflow(SETTINGS.model, Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")
if SETTINGS.model.template == AUTO_TEMPLATE:
    print(f"llmft: model.template auto -> {_template} ({_why})", file=sys.stderr)
SETTINGS = replace_setting(SETTINGS, "model.template", _template)

# model.continue_from: the parent run is checked (finished, readable, same base model, tokenizer,
# template, finetuning type and split) and a link to it (results/current) resolved to its folder,
# which every job then sees. SETTINGS: the config as the stages' helpers take it (typed).
from llmft.core.lineage import resolve as resolve_parent

try:
    SETTINGS, LINEAGE = resolve_parent(SETTINGS, Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")

# The run's published folders against the seals their stage wrote: weights changed in place at the
# same size keep their times as Snakemake sees them (a folder's), so its scores and page would
# silently describe other weights. Only files changed since they were last verified are read.
from llmft.core.lineage import published_problems

_changed = published_problems(Path("results") / SETTINGS.run)
if _changed:
    sys.exit(
        f"llmft config error: run {SETTINGS.run}: {_changed[0]}; its scores and page describe the "
        "weights published then: restore the folder, or delete it to train it again"
    )


# A Slurm profile that asks for GPUs for a CPU config (or another count than the config's) is
# refused here, before any job; the local executor requests none.
# The resources per_node_launcher writes into a shell line (mpi, cpus_per_task) must be a launcher
# command and a count.
_mismatch = profile_mismatch(
    SETTINGS.hardware, workflow.resource_settings
) or launcher_resources_error(workflow.resource_settings)
if _mismatch:
    sys.exit(f"llmft config error: {_mismatch}")

RUN = SETTINGS.run
LAYOUT = SETTINGS.hardware.layout
# The config as the jobs' slices are cut from it (cfg_arg): the validated keys, the template and
# continue_from resolved above.
_SLICE_SOURCE = SETTINGS.to_dict()


# What a stage's rules file (included after this one) adds to what every run has: the folders it
# publishes (final_outputs), the config keys the report reads of it (report_optional_keys), and, when
# the nightly gate compares on its metric, the scores the gate reads (compared_inputs).
STAGE_OUTPUTS = []  # functions () -> the folders a stage publishes
REPORT_STAGE_KEYS = []  # config keys
STAGE_GATE_INPUTS = (
    None  # a function (wildcards) -> the gate's scores, or None: evaluate's two
)


def final_outputs():
    """What a run promises: the page, its summary, the published model (and LoRA's adapter); with
    another training stage its published folders too (STAGE_OUTPUTS). Each is a target, so one deleted
    after a finished run is made again: a missing input of a job whose own outputs are current is not
    rebuilt by Snakemake."""
    published = [f"results/{RUN}/sft/model"]
    if SETTINGS.sft.finetuning_type == "lora":
        published.append(f"results/{RUN}/sft/adapter")
    for stage_outputs in STAGE_OUTPUTS:
        published += stage_outputs()
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
        src, dst = _SLICE_SOURCE, subset
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


def base_model_dir(wildcards):
    name = SETTINGS.model.name_or_path
    return f"results/{wildcards.run}/base_model" if name == BUILTIN_MODEL else name


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
    return SETTINGS.container.image or None


def stage_python():
    """`python` for verify_env and sft, as words for `{params.python:q}`: inside the image when
    they srun one task per node."""
    image = SETTINGS.container.image
    settings = workflow.deployment_settings
    if (
        not image
        or LAYOUT.nodes == 1
        or DeploymentMethod.APPTAINER not in settings.deployment_method
    ):
        return ["python"]
    return ["apptainer", "exec", *shlex.split(settings.apptainer_args), image, "python"]


def sft_output_log(wildcards):
    """Where sft's steps append their output: not its declared log, which Snakemake deletes first."""
    return f"results/{wildcards.run}/logs/sft.log"


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


def report_optional_keys():
    """The report's config keys beyond its own: a stage's (REPORT_STAGE_KEYS), and `nightly.metric` (the
    gate's metric, first on the page's gate table) only with one or with nightly.compare_with: a run
    with neither renders the same report params as before."""
    compared = REPORT_STAGE_KEYS or SETTINGS.nightly.compare_with
    return (*REPORT_STAGE_KEYS, *(("nightly.metric",) if compared else ()))


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


def gate_rows_words():
    """`--max-rows` of the nightly gate's evaluations: every held-out row, or nightly.gate_max_rows;
    a word list, quoted by the rules' {params.rows:q}."""
    return ["--max-rows", str(SETTINGS.nightly.gate_max_rows or "all")]


def compared_inputs(wildcards):
    """The gate rule's scores (nightly.compare_with): the promoted model and this run's tuned model,
    both on the gate's held-out rows; with a stage's nightly.metric (a preference metric) what that
    stage's rule file says instead (STAGE_GATE_INPUTS)."""
    if not SETTINGS.nightly.compare_with:
        return []
    if STAGE_GATE_INPUTS is not None:
        return STAGE_GATE_INPUTS(wildcards)
    return expand(
        "results/{run}/eval/{which}/metrics.json",
        run=wildcards.run,
        which=("promoted", "gate"),
    )
