# One job per model (base, tuned, and promoted: the nightly's promoted model on this run's held-out
# split, for the gate). On a GPU node the job runs one evaluation process per GPU it was given; on
# CPU it is one process with {threads} compute threads (more would fight other jobs).
rule evaluate:
    input:
        model=eval_model,
        heldout="results/{run}/data/heldout.jsonl",
    output:
        metrics="results/{run}/eval/{which}/metrics.json",
        predictions="results/{run}/eval/{which}/predictions.jsonl",
    log:
        "results/{run}/logs/evaluate_{which}.log",
    benchmark:
        "results/{run}/benchmarks/evaluate_{which}.tsv"
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template"),
        model=eval_model_path,
    shell:
        "python -m llmft evaluate {params.cfg} --model {params.model:q} --heldout {input.heldout:q}"
        " --out-dir results/{wildcards.run}/eval/{wildcards.which} --label {wildcards.which}"
        " --threads {threads} > {log:q} 2>&1"
