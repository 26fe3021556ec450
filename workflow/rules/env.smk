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
        nodes=LAYOUT.nodes,
    params:
        cfg=cfg_arg("hardware", "verify", "sft.flash_attn", "sft.zero_stage"),
    shell:
        "python -m llmft verify-env {params.cfg} --out {output} > {log} 2>&1"
