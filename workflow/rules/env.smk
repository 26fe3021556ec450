include: "env_helpers.smk"


# The same job shape and per-node launch as sft, so every node that will train is checked, through
# the same srun path. In a night's run (nightly.compare_with) it also runs the stack quarantine
# (nightly.on_stack_change) before any training.
rule verify_env:
    output:
        "results/{run}/env/verify.json",
    log:
        "results/{run}/logs/verify_env.log",
    benchmark:
        "results/{run}/timings/verify_env.tsv"
    container:
        stage_container(per_node=True)
    resources:
        **per_node_resources(),
    params:
        cfg=cfg_arg(
            "hardware",
            "verify",
            "sft.flash_attn",
            "sft.packing",
            "sft.zero_stage",
            "sft.offload",
            "sft.precision",
            "sft.liger_kernel",
            *quantization_keys(),
            *quarantine_keys(),
        ),
        launcher=per_node_launcher,
        python=stage_python(),
    shell:
        "{params.launcher} {params.python:q} -m llmft verify-env {params.cfg} --out {output:q} > {log:q} 2>&1"
