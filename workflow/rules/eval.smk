include: "eval_helpers.smk"


# One job per model: base and tuned on the page's eval.max_rows rows; with nightly.compare_with, the
# gate's two: promoted (the promoted run's model) and gate (this run's tuned model), both on every
# held-out row unless nightly.gate_max_rows caps them (capped at eval.max_rows, gate takes tuned's
# scores: the same model on the same rows, one generation fewer a night). On a GPU node the job runs
# one evaluation process per GPU it was given; on CPU it is one process with {threads} compute threads
# (more would fight other jobs).
rule evaluate:
    input:
        model=eval_model,
        heldout="results/{run}/data/heldout.jsonl",
        reused=eval_reused,
    output:
        metrics="results/{run}/eval/{which}/metrics.json",
        predictions="results/{run}/eval/{which}/predictions.jsonl",
    log:
        "results/{run}/logs/evaluate_{which}.log",
    benchmark:
        "results/{run}/timings/evaluate_{which}.tsv"
    container:
        stage_container()
    params:
        cfg=cfg_arg("eval", "model.template"),
        model=eval_model_path,
        rows=eval_rows,
        reuse=eval_reuse_words,
    shell:
        "python -m llmft evaluate {params.cfg} --model {params.model:q} --heldout {input.heldout:q}"
        " --out-dir results/{wildcards.run}/eval/{wildcards.which} --label {wildcards.which}"
        " {params.rows:q} {params.reuse:q} --threads {threads} > {log:q} 2>&1"
