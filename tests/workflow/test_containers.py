"""`--sdm apptainer` wiring: every stage runs in config key container.image, and a stage that starts one
task per node with its own srun enters the image inside that srun (the image has no Slurm tools).

Apptainer cannot be installed on the test machine and no image can be pulled there, so this is a
dry run (`-n -p`, nothing executed): Snakemake only asks `apptainer --version`, which a stub on PATH
answers; anything else it would run fails loudly.
"""

from __future__ import annotations

import os
import re

from tests.conftest import make_workdir, snakemake

STUB = '#!/bin/sh\n[ "$1" = "--version" ] && echo "apptainer version 1.3.4" && exit 0\nexit 99\n'
IMAGE = "/shared/images/llmft-rocm.sif"


def dry_run(tmp_path, nodes: int) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "apptainer").write_text(STUB)
    (bin_dir / "apptainer").chmod(0o755)
    work = make_workdir(
        tmp_path / "w",
        container__image=IMAGE,
        hardware__nodes=nodes,
        hardware__processes_per_node=1,
        hardware__allow_cpu_on_gpu_jobs=True,
    )
    res = snakemake(
        work, "-n", "-p", "--sdm", "apptainer", "--apptainer-args", "--rocm --bind /scratch",
        profile="slurm", env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    return res.stdout


def test_multi_node_stages_enter_the_image_inside_their_srun(tmp_path):
    out = dry_run(tmp_path, nodes=2)
    inside = f"apptainer exec --rocm --bind /scratch {IMAGE} python -m llmft"
    assert re.search(rf"srun --nodes=2 [^\n]* {re.escape(inside)} verify-env", out)
    assert re.search(rf"srun --nodes=2 [^\n]* {re.escape(inside)} sft launch ", out)
    # sft's gate and publish steps run in the image too, on the job's first node
    assert f"{inside} sft check " in out and f"{inside} sft finalize " in out


def test_one_node_stages_use_the_container_directive(tmp_path):
    out = dry_run(tmp_path, nodes=1)
    assert "apptainer exec" not in out  # Snakemake wraps each job itself: the shells stay plain
    assert "python -m llmft verify-env" in out and "python -m llmft sft" in out
