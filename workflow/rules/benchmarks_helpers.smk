# The Snakemake helpers of rules/benchmarks.smk, which includes this file first (a snakefile holds
# rules or functions, not both); what every rule file shares is in rules/common.smk.
from llmft.benchmarks.tasks import check as check_benchmarks

try:
    # An unknown task (with close matches) or one whose data is not here stops the run before any job.
    check_benchmarks(SETTINGS.eval, Path.cwd())
except ConfigError as exc:
    sys.exit(f"llmft config error: {exc}")


def benchmark_inputs(wildcards):
    """The two benchmark scores the run's report compares; none without benchmarks."""
    if not SETTINGS.eval.benchmarks:
        return []
    return expand(
        "results/{run}/benchmarks/{which}/scores.json",
        run=wildcards.run,
        which=("base", "tuned"),
    )
