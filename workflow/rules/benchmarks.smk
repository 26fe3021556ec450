include: "benchmarks_helpers.smk"


# Standard benchmarks (eval.benchmarks: lm-eval-harness tasks) on the base and the tuned model, one
# job each, offline: task data comes from eval.benchmark_include_path and the datasets cache. A job
# on a node with several GPUs runs one lm-eval process per GPU it was given (torchrun over
# llmft.benchmarks.worker), each scoring a share of the documents. With no benchmarks configured
# there are no such jobs. A model's scores are kept in results/.benchmarks-cache/
# under a key of its files, the tasks and their settings, and lm-eval's version; a rerun with the
# same base model reuses them. `--forcerun benchmarks` reruns both jobs and nothing else (delete
# results/.benchmarks-cache to score a model again from scratch).
rule benchmarks:
    input:
        model=eval_model,
    output:
        scores="results/{run}/benchmarks/{which}/scores.json",
    log:
        "results/{run}/logs/benchmarks_{which}.log",
    benchmark:
        "results/{run}/timings/benchmarks_{which}.tsv"
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template", benchmarks=True),
        cache="results/.benchmarks-cache",
    shell:
        "HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 python -m llmft benchmarks {params.cfg} --model {input.model:q}"
        " --out {output.scores:q} --cache-dir {params.cache:q} --threads {threads} > {log:q} 2>&1"
