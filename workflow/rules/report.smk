# The run's page, its figures and tables (also flagged for `snakemake --report`), summary.json, and
# a trend page across runs. The trend page reads every results/*/report/summary.json at the time
# this job runs; other runs' summaries are not declared inputs, because Snakemake would then try
# to (re)build those runs with this run's config. With nightly.compare_with the page renders the
# nightly gate's gate.json (rules/gate.smk): the report runs once a night, before the nightly acts on it.
rule report:
    input:
        verify="results/{run}/env/verify.json",
        stats="results/{run}/data/stats.json",
        lineage="results/{run}/lineage.json",
        train="results/{run}/sft/train_summary.json",
        sft_yaml="results/{run}/sft/llamafactory.yaml",
        model="results/{run}/sft/model",
        base="results/{run}/eval/base/metrics.json",
        tuned="results/{run}/eval/tuned/metrics.json",
        base_predictions="results/{run}/eval/base/predictions.jsonl",
        predictions="results/{run}/eval/tuned/predictions.jsonl",
        benchmarks=benchmark_inputs,
        gate=gate_verdict,
        preference=preference_eval_inputs,
    output:
        html=report(
            "results/{run}/report/index.html",
            caption="../report/index.rst",
            category="Report",
            labels={"page": "run report"},
        ),
        trend=report(
            "results/{run}/report/trend.html",
            caption="../report/trend.rst",
            category="Report",
            labels={"page": "trend across runs"},
        ),
        summary="results/{run}/report/summary.json",
        heldout=report(
            "results/{run}/report/heldout_metrics.tsv",
            caption="../report/heldout_metrics.rst",
            category="Held-out evaluation",
            labels={"table": "base vs tuned"},
        ),
        samples=report(
            "results/{run}/report/samples.tsv",
            caption="../report/samples.rst",
            category="Held-out evaluation",
            labels={"table": "sample generations"},
        ),
        loss=report(
            "results/{run}/report/figures/loss.svg",
            caption="../report/loss.rst",
            category="Training",
            labels={"figure": "loss"},
        ),
        learning_rate=report(
            "results/{run}/report/figures/learning_rate.svg",
            caption="../report/learning_rate.rst",
            category="Training",
            labels={"figure": "learning rate"},
        ),
        grad_norm=report(
            "results/{run}/report/figures/grad_norm.svg",
            caption="../report/grad_norm.rst",
            category="Training",
            labels={"figure": "gradient norm"},
        ),
        throughput=report(
            "results/{run}/report/figures/throughput.svg",
            caption="../report/throughput.rst",
            category="Training",
            labels={"figure": "tokens/s per GPU"},
        ),
        mfu=report(
            "results/{run}/report/figures/mfu.svg",
            caption="../report/mfu.rst",
            category="Training",
            labels={"figure": "MFU"},
        ),
        length_histogram=report(
            "results/{run}/report/figures/length_histogram.svg",
            caption="../report/length_histogram.rst",
            category="Data",
            labels={"figure": "row length histogram"},
        ),
    log:
        "results/{run}/logs/report.log",
    container:
        stage_container()
    params:
        cfg=cfg_arg(
            "run",
            "hardware",
            "model",
            "data",
            "sft",
            "verify",
            "eval",
            "nightly.compare_with",
            *report_optional_keys(),
            benchmarks=bool(SETTINGS.eval.benchmarks),
        ),
    shell:
        "python -m llmft report {params.cfg} --run-dir results/{wildcards.run}"
        " --out-dir results/{wildcards.run}/report --results-dir results > {log:q} 2>&1"
