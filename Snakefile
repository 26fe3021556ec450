# llmft: LLaMA-Factory + DeepSpeed ZeRO-3 SFT as five Slurm stages.
# Run:  snakemake --profile profiles/local   (the embedded CPU demo)
#       snakemake --profile profiles/slurm   (an MI300X / GPU cluster)
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


wildcard_constraints:
    run=r"[A-Za-z0-9_-][A-Za-z0-9_.-]*",
    which=r"base|tuned",


include: "workflow/rules/env.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/sft.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/benchmarks.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
