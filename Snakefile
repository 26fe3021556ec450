# llmft: LLaMA-Factory + DeepSpeed ZeRO-3 SFT as five Slurm stages.
# Run:  snakemake --profile profiles/local   (the embedded CPU demo)
#       snakemake --profile profiles/slurm   (an MI300X / GPU cluster)
from snakemake.utils import min_version

min_version("9.0")

import sys
from pathlib import Path

sys.path.insert(0, str(Path(workflow.basedir) / "workflow"))

from llmft.core.config import ConfigError, check_yaml_file

# Snakemake's configfile loader copies every mapping a YAML alias repeats: an alias bomb is refused
# before that load. (A --configfile is loaded before this file runs; its aliases are counted here.)
for _file in ("config/config.yaml", *workflow.config_settings.configfiles):
    try:
        check_yaml_file(_file)
    except ConfigError as exc:
        sys.exit(f"llmft config error: {exc}")


configfile: "config/config.yaml"


report: "workflow/report/workflow.rst"


include: "workflow/rules/common.smk"


wildcard_constraints:
    run=r"[A-Za-z0-9_][A-Za-z0-9_.-]*",
    which=r"base|tuned|promoted|gate",


include: "workflow/rules/env.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/sft.smk"
include: "workflow/rules/eval.smk"
include: "workflow/rules/preference.smk"
include: "workflow/rules/benchmarks.smk"
include: "workflow/rules/gate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        final_outputs(),
