include: "sft_helpers.smk"


# The run's lineage, its one record (results/{run}/lineage.json, llmft.core.lineage_record): where
# it starts (the parent run, its weights or adapter, the chain back to the base model), the data
# delta since the parent and the replay share, the tokens the plan for the nodes trains against a
# full retrain, and the software stack's hash. render_sft_config and the report read it; a run
# continuing from this one, the nightly and retention read it too.
rule lineage:
    input:
        base_model=base_model_dir,
        stats="results/{run}/data/stats.json",
        verify="results/{run}/env/verify.json",
    output:
        "results/{run}/lineage.json",
    log:
        "results/{run}/logs/lineage.log",
    localrule: True
    container:
        stage_container()
    params:
        cfg=lineage_cfg(),
    shell:
        "python -m llmft lineage {params.cfg} --base-model {input.base_model:q}"
        " --verify {input.verify:q} --data-dir results/{wildcards.run}/data"
        " --out {output:q} > {log:q} 2>&1"


# The plan sft trains with is made here, on the submit host, from the facts verify_env measured on
# the nodes that train (verify.json): vendor, GPU model and memory, torch build, the attention
# kernels that ran there, host memory. The submit host's own torch never enters it. The header's
# lines on where training starts and what it costs come from the run's lineage.json.
rule render_sft_config:
    input:
        base_model=base_model_dir,
        info="results/{run}/data/dataset_info.json",
        verify="results/{run}/env/verify.json",
        lineage="results/{run}/lineage.json",
    output:
        yaml="results/{run}/sft/llamafactory.yaml",
        deepspeed="results/{run}/sft/deepspeed.json",
        config="results/{run}/sft/config.json",
    log:
        "results/{run}/logs/render_sft_config.log",
    localrule: True
    container:
        stage_container()
    params:
        cfg=cfg_arg(
            "hardware",
            "verify",
            "model.template",
            "data.cutoff_len",
            "sft",
            *continue_keys(
                "model.continue_from",
                "nightly.continue_learning_rate",
                "nightly.continue_learning_rate_factor",
                "nightly.continue_epochs",
            ),
        ),
    shell:
        "python -m llmft render-sft {params.cfg} --base-model {input.base_model:q}"
        " --verify {input.verify:q} --data-dir results/{wildcards.run}/data"
        " --lineage {input.lineage:q}"
        " --out-yaml {output.yaml:q} --out-deepspeed {output.deepspeed:q}"
        " --work-root results/{wildcards.run}/work --out-config {output.config:q} > {log:q} 2>&1"


# When the rendered YAML packs rows (plain or neat), pack them once on the CPU side, exactly as
# LLaMA-Factory would, into data/packed-<hash of the packing arguments>/; a re-rendered YAML with the
# same packing arguments (a new learning rate) reuses that folder. The stamp says what sft loads.
rule pack_data:
    input:
        tokenizer=base_model_dir,
        yaml="results/{run}/sft/llamafactory.yaml",
        train="results/{run}/data/train.jsonl",
        heldout="results/{run}/data/heldout.jsonl",
        tokenized="results/{run}/data/tokenized",
    output:
        stamp="results/{run}/data/packed.json",
    log:
        "results/{run}/logs/pack_data.log",
    benchmark:
        "results/{run}/timings/pack_data.tsv"
    container:
        stage_container()
    threads: 1
    shell:
        "python -m llmft pack-data --yaml {input.yaml:q} --tokenizer {input.tokenizer:q}"
        " --data-dir results/{wildcards.run}/data --stamp-out {output.stamp:q} --prune"
        " > {log:q} 2>&1"


# Checkpoints live in results/{run}/work/sft-<config hash>/, which is not a declared output:
# Snakemake deletes a failed job's outputs, and a retried or requeued job must resume from them.
# LoRA also publishes the adapter (sft/adapter); sft/model is then the base with it merged in.
# Three steps, each reading the config render_sft_config wrote: check (the verify_env gate), launch
# (once per node), finalize (publish); bash stops at the first that fails. Their output is appended
# to logs/sft.log, which is not the declared log: Snakemake deletes a job's declared log before the
# job starts, and a job refused because another still trains (a rerun beside a killed Snakemake's
# job, --nolock) must not erase that job's log. The declared log (logs/sft.job.log, what Snakemake
# prints on an error) says where the output is and, on exit, gets the last lines this job wrote
# there. The run's page and summary.json go first: they describe the model this job replaces
# (Snakemake has deleted it), so a failed sft leaves no page that looks current; the report rule
# writes both again after a success.
rule sft:
    input:
        config="results/{run}/sft/config.json",
        yaml="results/{run}/sft/llamafactory.yaml",
        deepspeed="results/{run}/sft/deepspeed.json",
        verify="results/{run}/env/verify.json",
        train="results/{run}/data/train.jsonl",
        heldout="results/{run}/data/heldout.jsonl",
        tokenized="results/{run}/data/tokenized",
        packed="results/{run}/data/packed.json",
    output:
        **sft_adapter_output(),
        model=directory("results/{run}/sft/model"),
        summary="results/{run}/sft/train_summary.json",
    log:
        "results/{run}/logs/sft.job.log",
    benchmark:
        "results/{run}/timings/sft.tsv"
    container:
        stage_container(per_node=True)
    resources:
        **per_node_resources(),
    params:
        launcher=per_node_launcher,
        python=stage_python(),
        out=sft_output_log,
        page=run_page,
    shell:
        train_shell("sft")
