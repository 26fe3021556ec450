rule report:
    input:
        verify="results/{run}/env/verify.json",
        stats="results/{run}/data/stats.json",
        train="results/{run}/sft/train_summary.json",
        sft_yaml="results/{run}/sft/llamafactory.yaml",
        base="results/{run}/eval/base/metrics.json",
        tuned="results/{run}/eval/tuned/metrics.json",
        predictions="results/{run}/eval/tuned/predictions.jsonl",
    output:
        html=report(
            "results/{run}/report/index.html",
            caption="../report/index.rst",
            category="Report",
            labels={"page": "run report"},
        ),
        summary="results/{run}/report/summary.json",
    log:
        "results/{run}/logs/report.log",
    conda:
        "../../envs/llmft.yaml"
    params:
        cfg=cfg_arg("run", "hardware", "model", "data", "sft", "verify", "eval"),
    shell:
        "python -m llmft report {params.cfg} --run-dir results/{wildcards.run}"
        " --out-html {output.html} --out-summary {output.summary} > {log} 2>&1"
