# A config that cannot fit on the GPUs stops here, before any job is submitted, naming the keys to
# change (sft.* auto values are resolved by the same planner when the config is rendered). A
# builtin:tiny model does not exist yet at this point; it always fits.
if CFG["model"]["name_or_path"] != BUILTIN_MODEL:
    from llmft.plan import resolve
    from llmft.sft import resolve_vendor

    try:
        resolve(CFG, CFG["model"]["name_or_path"], resolve_vendor(CFG))
    except ConfigError as exc:
        raise WorkflowError(f"llmft config error: {exc}") from None


rule render_sft_config:
    input:
        base_model=base_model_dir,
        info="results/{run}/data/dataset_info.json",
    output:
        yaml="results/{run}/sft/llamafactory.yaml",
        deepspeed="results/{run}/sft/deepspeed.json",
    log:
        "results/{run}/logs/render_sft_config.log",
    localrule: True
    conda:
        "../../envs/llmft.yaml"
    params:
        cfg=cfg_arg("hardware", "model.template", "data.cutoff_len", "sft"),
    shell:
        "python -m llmft render-sft {params.cfg} --base-model {input.base_model}"
        " --data-dir results/{wildcards.run}/data --out-yaml {output.yaml}"
        " --out-deepspeed {output.deepspeed} --work-root results/{wildcards.run}/work"
        " > {log} 2>&1"


# Checkpoints live in results/{run}/work/sft-<config hash>/, which is not a declared output:
# Snakemake deletes a failed job's outputs, and a retried or requeued job must resume from them.
rule sft:
    input:
        yaml="results/{run}/sft/llamafactory.yaml",
        deepspeed="results/{run}/sft/deepspeed.json",
        verify="results/{run}/env/verify.json",
        train="results/{run}/data/train.jsonl",
        heldout="results/{run}/data/heldout.jsonl",
        tokenized="results/{run}/data/tokenized",
    output:
        model=directory("results/{run}/sft/model"),
        summary="results/{run}/sft/train_summary.json",
    log:
        "results/{run}/logs/sft.log",
    benchmark:
        "results/{run}/benchmarks/sft.tsv"
    conda:
        "../../envs/llmft.yaml"
    resources:
        **per_node_resources(),
    params:
        cfg=cfg_arg("hardware", "verify"),
        launcher=per_node_launcher,
    shell:
        "(python -m llmft sft {params.cfg} --yaml {input.yaml} --verify {input.verify}"
        " --check-only && {params.launcher} python -m llmft sft {params.cfg}"
        " --yaml {input.yaml} --launch-only"
        " && python -m llmft sft {params.cfg} --yaml {input.yaml} --finalize-only"
        " --model-out {output.model} --summary-out {output.summary}) > {log} 2>&1"
