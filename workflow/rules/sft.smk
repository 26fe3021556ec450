# A config that cannot fit on the GPUs stops here, before any job is submitted, naming the keys to
# change (sft.* auto values are resolved by the same planner when the config is rendered). A
# builtin:tiny model does not exist yet at this point: its shape comes from model.tiny.
# The same plan says whether the rendered YAML packs rows (plain or neat): then pack_data packs
# prepare_data's tokenized rows on the CPU side and sft loads them as they are.
from llmft.packing import packed_dir_name
from llmft.sft import planned_packing, tiny_shape

try:
    PACKING = planned_packing(
        CFG,
        CFG["model"]["name_or_path"],
        f"results/{RUN}/data",
        (
            tiny_shape(CFG["model"]["tiny"])
            if CFG["model"]["name_or_path"] == BUILTIN_MODEL
            else None
        ),
    )
except ConfigError as exc:
    raise WorkflowError(f"llmft config error: {exc}") from None
# data/packed-<hash of the packing arguments>: what the rendered YAML's tokenized_path names.
PACKED_DIR = packed_dir_name(PACKING) if PACKING else "packed-none"


# Only in the DAG when the config packs. The packing arguments (template, cutoff_len, plain/neat,
# LLaMA-Factory's shard and batch layout) name its output and are its params: a change to any of
# them repacks (and --prune removes the folder packed for the old ones).
rule pack_data:
    input:
        tokenizer=base_model_dir,
        train="results/{run}/data/train.jsonl",
        heldout="results/{run}/data/heldout.jsonl",
        tokenized="results/{run}/data/tokenized",
    output:
        packed=directory(f"results/{{run}}/data/{PACKED_DIR}"),
    log:
        "results/{run}/logs/pack_data.log",
    benchmark:
        "results/{run}/benchmarks/pack_data.tsv"
    conda:
        "../../envs/llmft.yaml"
    threads: 1
    params:
        args=lambda wc: shlex.quote(json.dumps(PACKING, sort_keys=True)),
    shell:
        "python -m llmft pack-data --args-json {params.args} --tokenizer {input.tokenizer}"
        " --data-dir results/{wildcards.run}/data --out {output.packed} --prune > {log} 2>&1"


rule render_sft_config:
    input:
        base_model=base_model_dir,
        info="results/{run}/data/dataset_info.json",
        packed=packed_data,
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
        packed=packed_data,
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
