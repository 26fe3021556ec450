# Standard benchmarks (eval.benchmarks: lm-eval-harness tasks) on the base and the tuned model, one
# job each, offline: task data comes from eval.benchmark_include_path and the datasets cache. With
# no benchmarks configured there are no such jobs. A model's scores are kept in results/.bench-cache/
# under a key of its files, the tasks and their settings, and lm-eval's version; a rerun with the
# same base model reuses them. `--forcerun benchmarks` reruns both jobs and nothing else (delete
# results/.bench-cache to score a model again from scratch).
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


rule benchmarks:
    input:
        model=eval_model,
    output:
        scores="results/{run}/bench/{which}/scores.json",
    log:
        "results/{run}/logs/benchmarks_{which}.log",
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template", benchmarks=True),
        cache="results/.bench-cache",
    shell:
        "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m llmft bench {params.cfg} --model {input.model:q}"
        " --out {output.scores:q} --cache-dir {params.cache:q} --threads {threads} > {log:q} 2>&1"
