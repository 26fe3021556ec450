include: "data_helpers.smk"


rule base_model:
    output:
        directory("results/{run}/base_model"),
    log:
        "results/{run}/logs/base_model.log",
    container:
        stage_container()
    params:
        cfg=cfg_arg("model"),
    shell:
        "python -m llmft base-model {params.cfg} --out {output:q} > {log:q} 2>&1"


rule synthetic_data:
    output:
        "results/{run}/data/synthetic.jsonl",
    log:
        "results/{run}/logs/synthetic_data.log",
    container:
        stage_container()
    params:
        cfg=cfg_arg("data.synthetic_rows"),
    shell:
        "python -m llmft synthetic {params.cfg} --out {output:q} > {log:q} 2>&1"


# prepare_data also writes data/train_keys.u64 (every train row's content key, what a run continuing
# from this one compares against), with its other outputs; it is not declared, so runs prepared before
# it existed are not prepared (and trained) again.
rule prepare_data:
    input:
        tokenizer=base_model_dir,
        sources=dataset_inputs,
    output:
        train="results/{run}/data/train.jsonl",
        heldout="results/{run}/data/heldout.jsonl",
        info="results/{run}/data/dataset_info.json",
        stats="results/{run}/data/stats.json",
        rejected="results/{run}/data/rejected.jsonl",
        tokenized=directory("results/{run}/data/tokenized"),
    log:
        "results/{run}/logs/prepare_data.log",
    benchmark:
        "results/{run}/timings/prepare_data.tsv"
    container:
        stage_container()
    # One tokenizing process per thread; Snakemake lowers it to the cores it has (CPU job on Slurm).
    threads: 8
    params:
        cfg=cfg_arg(
            "data",
            "model.template",
            *continue_keys("model.continue_from", "nightly.replay_fraction"),
        ),
        parent=parent_marker(),
        synthetic="results/{run}/data/synthetic.jsonl",
    shell:
        "python -m llmft prepare-data {params.cfg} --tokenizer {input.tokenizer:q}"
        " --out-dir results/{wildcards.run}/data --synthetic {params.synthetic:q}"
        " --workers {threads} > {log:q} 2>&1"
