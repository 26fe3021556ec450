# The same job shape and per-node launch as sft, so every node that will train is checked, through
# the same srun path.
rule verify_env:
    output:
        "results/{run}/env/verify.json",
    log:
        "results/{run}/logs/verify_env.log",
    benchmark:
        "results/{run}/benchmarks/verify_env.tsv"
    conda:
        "../../envs/llmft.yaml"
    resources:
        **per_node_resources(),
    params:
        cfg=cfg_arg("hardware", "verify", "sft.flash_attn", "sft.zero_stage"),
        launcher=per_node_launcher,
    shell:
        "{params.launcher} python -m llmft verify-env {params.cfg} --out {output} > {log} 2>&1"
