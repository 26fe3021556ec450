# Two commands on a fresh machine:
#   make demo   set up .venv and run the whole pipeline on the embedded default (CPU, tiny model)
#   make test   set up .venv (and the local Slurm test cluster) and run the test suite
SHELL := /bin/bash
VENV  := .venv
BIN   := $(VENV)/bin
STAMP := $(VENV)/.llmft-installed

.PHONY: demo test lint venv clean-results

$(STAMP): envs/cpu.txt envs/cpu-nodeps.txt envs/dev.txt envs/install-cpu.sh pyproject.toml
	bash envs/install-cpu.sh $(VENV)
	touch $@

venv: $(STAMP)

# SLURM_CONF=/dev/null: Snakemake imports the Slurm plugin for every profile, and the import waits
# ~10 s on `scontrol show config` where Slurm is installed but no controller answers; no local job uses it.
# "demo: N s" is the whole command's wall time, .venv set-up included (MAKE_START is read when make
# starts); the pipeline's own share is printed beside it.
MAKE_START := $(shell date +%s)
demo: $(STAMP)
	@pipeline_start=$$(date +%s); \
	SLURM_CONF=/dev/null PATH=$(CURDIR)/$(BIN):$$PATH snakemake --profile profiles/local && \
	end=$$(date +%s) && \
	echo "report: results/demo/report/index.html" && \
	echo "demo: $$((end - $(MAKE_START))) s (the pipeline $$((end - pipeline_start)) s, set-up before it $$((pipeline_start - $(MAKE_START))) s)"

lint: $(STAMP)
	$(BIN)/ruff check workflow tests bench
	$(BIN)/ruff format --check workflow tests bench
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakefmt --check Snakefile workflow/rules
# linted as deployed on a cluster, with an image for every stage (config key container.image)
	SLURM_CONF=/dev/null PATH=$(CURDIR)/$(BIN):$$PATH snakemake --lint --config 'container={image: llmft-rocm.sif}'

# The whole command's time is counted from here (the venv's set-up included), the suite's around pytest.
test: TEST_START := $(shell date +%s)
test: $(STAMP)
	$(MAKE) lint
	bash tests/setup-chromium.sh
	bash tests/setup-tokenizers.sh
# tests/slurm run on a real two-node Slurm cluster on this machine, stopped by PID even on failure.
# LLMFT_NO_SKIPS=1: a skip not on tests/allowed_skips.yaml fails the run (tests/skipgate.py).
	trap 'bash tests/slurm/cluster-down.sh' EXIT; bash tests/slurm/cluster-up.sh && { \
	suite=$$(date +%s); \
	LLMFT_NO_SKIPS=1 PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest -ra --durations=30 -n 2 --no-loadscope-reorder tests; \
	rc=$$?; now=$$(date +%s); \
	echo "make test: the suite $$((now - suite)) s, the whole command $$((now - $(TEST_START))) s (pytest exit $$rc)"; \
	exit $$rc; }
