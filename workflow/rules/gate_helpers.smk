# The Snakemake helpers of rules/gate.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
def gate_verdict(wildcards):
    """The nightly gate's verdict, which the report renders: with nightly.compare_with only (rules/gate.smk)."""
    if not SETTINGS.nightly.compare_with:
        return []
    return f"results/{wildcards.run}/nightly/gate.json"


def gate_cfg():
    """The gate's config keys: what it compares (nightly.metric, tolerance, the benchmark budget, the
    promoted run), whether benchmarks count (eval.benchmarks) and a stage's section (REPORT_STAGE_KEYS:
    the preference models' scores need it)."""
    keys = ("metric", "tolerance", "max_benchmark_drop", "compare_with")
    return cfg_arg(
        *(f"nightly.{k}" for k in keys),
        "eval.benchmarks",
        *REPORT_STAGE_KEYS,
        benchmarks=bool(SETTINGS.eval.benchmarks),
    )
