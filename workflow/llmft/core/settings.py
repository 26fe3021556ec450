"""The validated config as frozen dataclasses: one per section of workflow/schemas/config.schema.yaml,
with the values the stages derive from it (the layout, the LoRA settings, whether a loss uses a
reference model) as properties.

The schema stays the one source of the keys, their defaults and their documentation: each field here
carries the first sentence of its key's description, and tests/unit/core/test_settings.py checks
that every schema key has a field with the schema's default, and no field lacks a key. A CLI call
builds one `Config` from the validated dict (`Config.from_dict(validate(raw))`); the stages receive
its sections. Lists and mappings inside (data.sources, sft.extra) are the validated config's own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from llmft.core.config import Layout, fp8_blocker, hardware_layout, lora_settings, runs_on_cpu, uses_reference


@dataclass(frozen=True)
class Hardware:
    """config key hardware: Where training runs."""

    # Accelerator stack.
    vendor: str = "auto"
    # Nodes for sft and verify_env (one torchrun per node).
    nodes: int = 1
    # GPUs per node (8 on an MI300X node); 0 trains on CPU processes.
    gpus_per_node: int = 0
    # true: a CPU config (gpus_per_node 0) may run in Slurm jobs that request GPUs (a smoke test of
    # the GPU partition).
    allow_cpu_on_gpu_jobs: bool = False
    # torchrun processes per node; 0 = gpus_per_node on GPU nodes, 2 on CPU.
    processes_per_node: int = 0
    # GPU model for thresholds and MFU (mi300x, h200, h100, ...); empty = detect.
    gpu_model: str = ""
    # NCCL/RCCL/Gloo socket interface (e.g.
    socket_ifname: str = ""
    # NCCL_IB_HCA for multi-node traffic; empty = library default.
    ib_hca: str = ""

    @property
    def on_cpu(self) -> bool:
        """Whether training runs on CPU processes (vendor cpu, or no GPUs per node)."""
        return runs_on_cpu(vars(self))

    @property
    def layout(self) -> Layout:
        """Processes per node resolved (0: one per GPU, 2 on CPU) and the world size."""
        return hardware_layout(vars(self))


@dataclass(frozen=True)
class Container:
    """config key container: The Apptainer image every stage runs in under `snakemake --sdm apptainer`
    (docs/containers.md).
    """

    # Path of a .sif built from envs/apptainer/rocm.def (MI300X nodes) or cuda.def (NVIDIA nodes), or
    # a docker:// / oras:// / library:// URI.
    image: str = ""


@dataclass(frozen=True)
class TinyModel:
    """config key model.tiny: Shape of the builtin tiny model."""

    # Hidden width.
    hidden_size: int = 128
    # Decoder layers.
    num_layers: int = 2
    # Attention heads.
    num_heads: int = 4
    # BPE vocabulary.
    vocab_size: int = 2048


@dataclass(frozen=True)
class Model:
    """config key model: The base model."""

    # Local model folder (HF format), or builtin:tiny to build a random-init tiny Llama and its
    # tokenizer offline (the demo).
    name_or_path: str = "builtin:tiny"
    # LLaMA-Factory chat template (default, alpaca, chatml, qwen, llama3, ...), or auto: the one whose
    # rendering matches the model folder's own chat template, else the one of its model_type (default
    # for the builtin model).
    template: str = "auto"
    # Start from an earlier run's output instead of name_or_path: its folder results/<run>, or a link
    # to one (results/current, the promoted nightly model).
    continue_from: str | None = None
    # Shape of the builtin tiny model.
    tiny: TinyModel = field(default_factory=TinyModel)

    @property
    def continues(self) -> bool:
        """Whether the run continues from an earlier run (model.continue_from set)."""
        return bool(self.continue_from)


@dataclass(frozen=True)
class Dedup:
    """config key data.dedup: Exact duplicates (after normalisation) are always dropped."""

    # Also drop rows that are near-duplicates of an earlier row.
    near: bool = False
    # Drop every train row that is a near-duplicate of a held-out row, so held-out metrics do not
    # measure memorisation.
    decontaminate: bool = True
    # Similarity at and above which two rows are near-duplicates.
    threshold: float | int = 0.8
    # MinHash permutations (more = finer similarity estimate, slower).
    num_perm: int = 64


@dataclass(frozen=True)
class Data:
    """config key data: Instruction data and how it is split."""

    # Datasets to mix, read in this order (earlier rows win dedup ties).
    sources: list[dict] = field(
        default_factory=lambda: [{"path": "builtin:synthetic", "format": "alpaca", "weight": 1.0}]
    )
    # Rows that builtin:synthetic generates (held in memory while they are written).
    synthetic_rows: int = 3000
    # The largest share of the rows read that the length filter (rows over data.cutoff_len), or
    # invalid rows dropped under invalid_rows: drop, may remove before prepare_data fails naming the
    # cause and the fix.
    max_dropped_fraction: float | int = 0.1
    # Share of rows held out, decided by a hash of each row's content.
    heldout_fraction: float | int = 0.1
    # Salt of the split hash; change it only to draw a new split on purpose.
    split_salt: str = "llmft"
    # Max tokens of prompt + answer; longer rows are dropped (not truncated).
    cutoff_len: int = 128
    # The largest JSON row (one line of a .jsonl file, one element of a .json array) read, in bytes; a
    # longer row is a bad row (data.invalid_rows decides), never held in memory whole.
    max_row_bytes: int = 4194304
    # true = row texts are cleaned before tokenizing (Unicode NFC, \r\n and \r to \n, ends stripped;
    # inner spacing kept).
    clean_text: bool = True
    # Before tokenizing, the tokenizer as transformers loads it encodes a few probe texts (English,
    # code, digits, Chinese, spacing, emoji) and must give the ids of the folder's tokenizer.json.
    tokenizer_check: str = "fail"
    # fail = check every row, name each bad one in the log, then stop; drop = skip bad rows, count
    # them in stats.json and list them in rejected.jsonl.
    invalid_rows: str = "fail"
    # Exact duplicates (after normalisation) are always dropped.
    dedup: Dedup = field(default_factory=Dedup)


@dataclass(frozen=True)
class Sft:
    """config key sft: Supervised fine-tuning through LLaMA-Factory + DeepSpeed."""

    # LLaMA-Factory finetuning_type.
    finetuning_type: str = "full"
    # LoRA rank r of each adapter (LLaMA-Factory lora_rank).
    lora_rank: int = 8
    # LoRA scale alpha; the update is scaled by alpha / rank (LLaMA-Factory lora_alpha).
    lora_alpha: int | str = "auto"
    # Dropout on the adapters' input (LLaMA-Factory lora_dropout).
    lora_dropout: float | int = 0.0
    # Modules that get adapters (LLaMA-Factory lora_target): all = every linear layer but the output
    # head (LLaMA-Factory's meaning), or module names, as a list or comma-separated (q_proj,v_proj).
    lora_target: str | list[str] = "all"
    # Load the frozen base model quantized by bitsandbytes, 4 = QLoRA (NF4, double quantization), 8 =
    # int8 (LLaMA-Factory quantization_bit); none = not quantized.
    quantization_bit: str | int = "none"
    # Decoder layers that train under freeze (LLaMA-Factory freeze_trainable_layers): n > 0 = the last
    # n, n < 0 = the first -n; the rest stays frozen.
    freeze_trainable_layers: int = 2
    # Experiment trackers the trainer logs to (rank 0 only: one tracked run per training job,
    # continued after a requeue), under results/<run>/tracking/.
    tracking: list[str] = field(default_factory=lambda: ["tensorboard"])
    # DeepSpeed ZeRO stage (0 = plain data parallel, no DeepSpeed).
    zero_stage: str | int = "auto"
    # ZeRO-3 offload of parameters and optimizer state to CPU memory.
    offload: str | bool = "auto"
    # Training precision.
    precision: str = "bf16"
    # FP8 matmuls in the decoder's linear layers (torchao float8, tensorwise scaling; applied by
    # llmft, not LLaMA-Factory's fp8 flag, which falls back to bf16 silently and is refused in
    # sft.extra).
    fp8: bool | str = "auto"
    # Micro-batch (rows) per process.
    per_device_train_batch_size: int | str = "auto"
    # Micro-steps per optimizer step.
    gradient_accumulation_steps: int | str = "auto"
    # Token budget of one micro-batch per process when the batch size is auto (rows of data.cutoff_len
    # tokens; packed rows are exactly that long).
    micro_batch_tokens: int = 16384
    # Tokens per optimizer step (all processes) that an auto gradient_accumulation_steps aims for: the
    # global batch, which decides what is learned, kept independent of the hardware.
    tokens_per_step: int = 32768
    # Peak learning rate.
    learning_rate: float | int = 1e-05
    # Epochs (ignored when max_steps > 0).
    num_train_epochs: float | int = 3.0
    # Optimizer steps; -1 = use num_train_epochs.
    max_steps: int = -1
    # transformers' learning-rate schedule (its SchedulerType names).
    lr_scheduler_type: str = "cosine"
    # Warm-up share of steps.
    warmup_ratio: float | int = 0.1
    # Share of the optimizer steps in the final decay of lr_scheduler_type warmup_stable_decay (also
    # the preference stage's, when its lr_scheduler_type is warmup_stable_decay); the launcher turns
    # it into steps from the trainer's own step count.
    decay_ratio: float | int = 0.2
    # AdamW weight decay.
    weight_decay: float | int = 0.0
    # Gradient clipping.
    max_grad_norm: float | int = 1.0
    # Log loss every N steps.
    logging_steps: int = 10
    # Checkpoint every N steps (resume point).
    save_steps: int = 200
    # Recompute activations in backward to save memory (costs ~1/3 more compute).
    gradient_checkpointing: str | bool = "auto"
    # Pack rows into sequences of data.cutoff_len tokens.
    packing: str = "auto"
    # Liger's fused Triton kernels (RMSNorm, SwiGLU, RoPE, linear + cross-entropy without materialised
    # logits).
    liger_kernel: str | bool = "auto"
    # Compile each decoder layer with torch.compile (regional compilation: one layer's graph, reused
    # by every layer; the first steps compile).
    torch_compile: str | bool = "auto"
    # Pad every micro-batch's flattened row (neat packing through varlen attention) to the micro-
    # batch's capacity (rows x data.cutoff_len tokens; the padding trains nothing and is not counted),
    # so the compiled decoder layers keep one shape instead of recompiling as dynamic-shape graphs.
    static_shapes: str | bool = "auto"
    # Let Inductor tune the block sizes of each kernel it generates for the compiled decoder layers
    # (coordinate descent): longer first steps, faster fused float8 casts.
    compile_tuning: str | bool = "auto"
    # DeepSpeed reduce/all-gather/prefetch bucket size in elements.
    zero_bucket_size: int | str = "auto"
    # Attention kernel.
    flash_attn: str = "auto"
    # A hung collective fails the job after this long (LLaMA-Factory's default is years); the launcher
    # then names the rank and node that stopped responding.
    collective_timeout_minutes: float | int = 30
    # Training seed, 0 to 2^32 - 1 (the range numpy's generator takes).
    seed: int = 42
    # Stop early, with a diagnosis, when the gradient norm exceeds this many times its running median
    # and the next logged loss confirms it (more than doubled from its running median and up by over
    # 0.1; a spike no logged step follows is judged by its own loss); a NaN/inf loss or gradient norm
    # always ...
    divergence_factor: float | int = 100
    # Under Slurm, after SIGUSR1/SIGTERM (the job's --signal before its time limit, or preemption) the
    # trainer saves a checkpoint and each node asks Slurm to requeue the job (the first ask wins),
    # which resumes from that checkpoint; false = save and fail (a Snakemake retry then resumes).
    requeue_on_preempt: bool = True
    # Any other LLaMA-Factory training argument, passed through as is (e.g.
    extra: dict = field(default_factory=lambda: {})

    @property
    def lora(self) -> dict:
        """The adapter settings as LLaMA-Factory reads them (lora_alpha resolved, lora_target a string)."""
        return lora_settings(vars(self))

    @property
    def fp8_blocker(self) -> str | None:
        """Why the rest of the sft config rules FP8 out, whatever the nodes (None: nothing does)."""
        return fp8_blocker(vars(self))

    def packing_on(self, on_gpu: bool) -> str:
        """The packing sft trains with on GPUs (`on_gpu`) or on CPU processes: auto is neat on GPUs,
        off on CPU."""
        return ("neat" if on_gpu else "off") if self.packing == "auto" else self.packing

    @property
    def finetuning_args(self) -> dict:
        """LLaMA-Factory's arguments of finetuning_type's own keys: LoRA's adapter settings (and
        QLoRA's quantization_bit), freeze's trainable layers; none for full."""
        if self.finetuning_type == "lora":
            out = self.lora
            if self.quantization_bit != "none":
                out["quantization_bit"] = self.quantization_bit
            return out
        if self.finetuning_type == "freeze":
            return {"freeze_trainable_layers": self.freeze_trainable_layers}
        return {}


@dataclass(frozen=True)
class PreferenceData:
    """config key preference.data: Preference data: read, checked row by row, deduplicated, split and
    tokenized once as LLaMA-Factory's dpo (pairs) or kto (tagged rows) stage would (prepare_preference).
    """

    # Files or LLaMA-Factory dataset_info entries of pairs (chosen/rejected) or of KTO rows (a boolean
    # kto_tag or label column), read in this order (earlier rows win dedup ties); all of one kind, the
    # kind preference.method trains (pairs: dpo, KTO rows: kto).
    sources: list[dict] = field(
        default_factory=lambda: [{"path": "builtin:synthetic_pairs", "format": "alpaca"}]
    )
    # Rows that builtin:synthetic_pairs / builtin:synthetic_kto generate (held in memory while they
    # are prepared).
    synthetic_rows: int = 1500
    # Share of prompts held out, decided by a hash of each prompt's content: all rows of one prompt
    # sit on one side, and added rows never move a row across the split.
    heldout_fraction: float | int = 0.1
    # Salt of the split hash; change it only to draw a new split on purpose.
    split_salt: str = "llmft"
    # Max tokens of prompt + answer, for each side of a pair (prompt + chosen, prompt + rejected) or a
    # KTO row, with the template; longer rows are dropped (not truncated) and named in rejected.jsonl
    # with the side and its tokens.
    cutoff_len: int = 128
    # fail = check every row, name each bad one, then stop; drop = skip bad rows, listing them with
    # their reason in rejected.jsonl.
    invalid_rows: str = "fail"
    # The largest share of the rows read that the length filter, or bad rows under invalid_rows: drop,
    # may remove before prepare_preference fails naming the cause.
    max_dropped_fraction: float | int = 0.1


@dataclass(frozen=True)
class Preference:
    """config key preference: A preference-tuning stage after sft (LLaMA-Factory's dpo or kto stage), its
    own job on sft's partition and launcher, on its own data (preference.data);
    results/<run>/preference/.
    """

    # dpo = pairs (chosen vs rejected answer to one prompt), LLaMA-Factory stage dpo with
    # preference.loss; kto = single answers tagged desirable or undesirable (stage kto).
    method: str = "dpo"
    # dpo's loss (LLaMA-Factory pref_loss): sigmoid = DPO against a reference model; orpo and simpo
    # need no reference model.
    loss: str = "sigmoid"
    # Preference loss beta (LLaMA-Factory pref_beta): how far the policy may move from the reference
    # (DPO, KTO), ORPO's odds-ratio weight, SimPO's reward scale.
    beta: float | int = 0.1
    # SimPO's target reward margin (LLaMA-Factory simpo_gamma).
    simpo_gamma: float | int = 0.5
    # Weight of an added SFT loss on the chosen answers (LLaMA-Factory pref_ftx).
    ftx: float | int = 0.0
    # Weight of the desirable rows' loss (LLaMA-Factory kto_chosen_weight).
    kto_desirable_weight: float | int = 1.0
    # Weight of the undesirable rows' loss (LLaMA-Factory kto_rejected_weight).
    kto_undesirable_weight: float | int = 1.0
    # The model the stage trains: sft = the sft run's published model (results/<run>/sft/model; after
    # LoRA sft the base with sft's adapter merged in), base = model.name_or_path.
    start_from: str = "sft"
    # The frozen reference model of dpo's sigmoid loss and of kto.
    reference: str = "auto"
    # What trains (LLaMA-Factory finetuning_type).
    finetuning_type: str = "auto"
    # Peak learning rate.
    learning_rate: float | int | str = "auto"
    # Epochs over the preference pairs (ignored when max_steps > 0).
    num_train_epochs: float | int = 1.0
    # Optimizer steps; -1 = use num_train_epochs.
    max_steps: int = -1
    # Warm-up share of steps.
    warmup_ratio: float | int = 0.1
    # transformers' learning-rate schedule, as sft.lr_scheduler_type (warmup_stable_decay decays over
    # sft.decay_ratio of the steps).
    lr_scheduler_type: str = "cosine"
    # Pairs (dpo) or rows (kto) per micro-batch and process.
    per_device_train_batch_size: int | str = "auto"
    # Micro-steps per optimizer step.
    gradient_accumulation_steps: int | str = "auto"
    # Batch pairs of similar length: transformers' length-grouped sampler (train_sampling_strategy
    # group_by_length) over each pair's longer side, which prepare_preference stores with the
    # tokenized pairs (LLaMA-Factory's own pairwise rows carry no length it can read).
    group_by_length: bool | str = "auto"
    # dpo: run the pairs of a micro-batch as one row of their real tokens (each sequence its own
    # positions, torch's varlen attention kernel; per-sequence SDPA on a CPU) and compute each token's
    # log-probability a chunk of tokens at a time through the output layer, instead of LLaMA-Factory's
    # padded ...
    padding_free: bool | str = "auto"
    # Where the reference model's log-probabilities come from (dpo's sigmoid loss, kto).
    reference_logps: str = "auto"
    # Preference data: read, checked row by row, deduplicated, split and tokenized once as LLaMA-
    # Factory's dpo (pairs) or kto (tagged rows) stage would (prepare_preference).
    data: PreferenceData = field(default_factory=PreferenceData)

    @property
    def uses_reference(self) -> bool:
        """Whether the loss compares the policy with a frozen reference model (dpo's sigmoid, kto)."""
        return uses_reference(vars(self))


@dataclass(frozen=True)
class Verify:
    """config key verify: Environment verification before training."""

    # fail = sft does not start after a failed check; warn = record and go on.
    on_failure: str = "fail"
    # Train a small fixed model for a few dozen steps on every node, through the kernels sft will use,
    # and compare its loss curve with the committed golden curve (llmft.canary); false skips it.
    canary: bool = True
    # Packages that must import on the training nodes.
    required_packages: list[str] = field(
        default_factory=lambda: ["torch", "transformers", "llamafactory", "deepspeed"]
    )
    # Bound on the collective check, counted from the moment all its processes have met (after every
    # node's probe); a hung collective is killed and reported with the step it hung in.
    timeout_seconds: int = 120
    # Bound on each node's probe (imports, a DeepSpeed op build, kernel calls, then the numerics
    # canary with its FP8 leg and diagnosis reruns), on its own clock before the collective check's; a
    # probe over it is reported as slow, naming the part and step it was in.
    probe_timeout_seconds: int = 600
    # bf16 GEMM TFLOP/s every GPU must reach; 0 = the GPU model's floor in llmft/hardware.py.
    min_gemm_tflops: float | int = 0
    # All-reduce bus bandwidth (GB/s, nccl-tests definition) at the largest message; 0 = the floor for
    # the GPU model, GPUs per node and node count (llmft/hardware.py).
    min_allreduce_busbw_gbs: float | int = 0
    # All-gather bus bandwidth floor (GB/s); 0 = from llmft/hardware.py like the all-reduce one.
    min_allgather_busbw_gbs: float | int = 0


@dataclass(frozen=True)
class Eval:
    """config key eval: Held-out evaluation of the base and the tuned model."""

    # Held-out rows the page evaluates, base and tuned (first N in split order); the nightly gate
    # scores every row (nightly.gate_max_rows).
    max_rows: int = 300
    # Generation batch size.
    batch_size: int = 64
    # Greedy decoding length cap, at most 131072 (a long-context model's whole window).
    max_new_tokens: int = 32
    # KV cache of greedy decoding.
    decoding: str = "auto"
    # Weights and compute of the evaluation.
    precision: str = "auto"
    # lm-eval-harness tasks run on the base and the tuned model (results/{run}/benchmarks/), e.g.
    benchmarks: list[dict] = field(default_factory=lambda: [])
    # lm-eval model of the benchmark jobs.
    benchmark_backend: str = "llmft"
    # Folders of your own lm-eval task YAML files (lm-eval's --include_path), relative to the working
    # directory or absolute.
    benchmark_include_path: list[str] = field(default_factory=lambda: [])
    # The Hugging Face datasets cache that holds the benchmarks' data on nodes without internet ("" =
    # HF_DATASETS_CACHE, else ~/.cache/huggingface/datasets).
    benchmark_data_cache: str = ""


@dataclass(frozen=True)
class Nightly:
    """config key nightly: Scheduled retrains (`python -m llmft nightly`)."""

    # Held-out metric of the tuned model that the promotion gate compares (exact_match on 0-1; rouge_*
    # and bleu_4 on LLaMA-Factory's 0-100 scale; eval_loss lower is better; preference_accuracy, 0-1,
    # and reward_margin of the preference-tuned model on the held-out pairs: need a preference
    # section, and ...
    metric: str = "exact_match"
    # A new model is promoted unless it is worse than the current one by more than this, in the
    # metric's own units (0.01 of exact match; for rouge_*/bleu_4 a value such as 1 point).
    tolerance: float | int = 0.01
    # Forgetting budget of the gate, per eval.benchmarks task: the most the new model's score may fall
    # below the promoted model's, in the task metric's own units (acc 0-1), e.g.
    max_benchmark_drop: dict = field(default_factory=lambda: {})
    # Nightly runs kept under results/; older ones are deleted, never the promoted one, the runs a
    # rollback can return to (nightly.keep_promoted), nor any run those descend from (summary.json
    # lineage).
    keep_runs: int = 7
    # Promoted models kept for rollback: the current one and the keep_promoted - 1 promoted before it
    # (`llmft rollback` steps back through them), each with every run it descends from.
    keep_promoted: int = 3
    # retrain: each night trains from model.name_or_path on all rows.
    mode: str = "retrain"
    # continue mode: at most retrain_every - 1 continued runs in a row.
    retrain_every: int | None = 7
    # What a continue night does when there is no promoted model yet: error (the night is refused,
    # naming nightly.mode) or retrain (it trains from the base model and says so in its log and
    # state).
    fallback: str = "error"
    # Set by the nightly, not by hand: a run folder (results/<run>) whose published model is also
    # scored on this run's held-out split (results/<run>/eval/promoted/), so the gate compares both
    # models on the same rows.
    compare_with: str | None = None
    # What a night does when the software stack of its nodes (llmft.core.stack: torch, ROCm/CUDA,
    # driver, RCCL/NCCL, flash-attn, DeepSpeed, LLaMA-Factory, transformers, the container, ...)
    # differs from the one the promoted run recorded (its summary.json / verify.json `stack`).
    on_stack_change: str = "quarantine"
    # Set by the nightly, not by hand: the stacks (their hashes) that already passed a quarantine
    # against the promoted run's stack (results/nightly/state.json `quarantine_passes`); verify_env
    # does not quarantine them again.
    quarantine_passed: list[str] = field(default_factory=lambda: [])
    # Held-out rows (preference metric: held-out pairs) the gate scores both models on (eval/gate/ and
    # eval/promoted/, or preference/gate/; the first N in split order).
    gate_max_rows: int | None = None
    # Cron schedule of the generated scrontab / crontab entry: five fields (minute hour day month
    # weekday) or an @daily-style shortcut.
    schedule: str = "0 2 * * *"
    # Applies to every run with model.continue_from, nightly or not: the share of the run's own
    # distinct train rows that are replayed rows of the parent run (those still in the data, a
    # deterministic sample), trained beside the new rows against forgetting.
    replay_fraction: float | int = 0.25
    # Applies to every run with model.continue_from: the peak learning rate of its fresh schedule
    # (warmup and decay start again; the optimizer state is not carried).
    continue_learning_rate: float | None = None
    # Applies to every run with model.continue_from (sft.max_steps unset): the epochs of its fresh
    # schedule.
    continue_epochs: float | None = None
    # Applies to every run with model.continue_from when continue_learning_rate is null: its learning
    # rate is this factor x sft.learning_rate (a model that already learned the task needs a gentler
    # rate).
    continue_learning_rate_factor: float | int = 0.25
    # Partition of the scrontab job that drives Snakemake (it only submits jobs).
    partition: str = "cpu"


@dataclass(frozen=True)
class Config:
    """The whole validated config."""

    # Name of this run; all outputs go to results/{run}/.
    run: str = "demo"
    hardware: Hardware = field(default_factory=Hardware)
    container: Container = field(default_factory=Container)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    sft: Sft = field(default_factory=Sft)
    # The preference stage; None: the run has none.
    preference: Preference | None = None
    verify: Verify = field(default_factory=Verify)
    eval: Eval = field(default_factory=Eval)
    nightly: Nightly = field(default_factory=Nightly)

    @classmethod
    def from_dict(cls, validated: dict) -> Config:
        """The config of a dict `llmft.core.config.validate` returned (every key there, defaults filled)."""
        return _build(cls, validated)

    def to_dict(self) -> dict:
        """The config as the validated dict, keys in the schema's order (for JSON and YAML that need one)."""
        return dataclasses.asdict(self)


def _nested(f: dataclasses.Field) -> type | None:
    """The dataclass a field holds (a section or subsection), or None for a plain value."""
    factory = f.default_factory
    if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory):
        return factory
    return SECTION_TYPES.get(f.name) if f.name == "preference" else None


def _build(cls: type, values: dict) -> Any:
    if values is None:
        return None
    kwargs = {}
    for f in dataclasses.fields(cls):
        value = values[f.name]
        kind = _nested(f)
        kwargs[f.name] = _build(kind, value) if kind is not None else value
    return cls(**kwargs)


def replace(cfg: Config, dotted: str, value: Any) -> Config:
    """A copy of `cfg` with the key `dotted` (e.g. model.template) set to `value`."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return dataclasses.replace(cfg, **{head: value})
    return dataclasses.replace(cfg, **{head: replace(getattr(cfg, head), rest, value)})


# The section classes by config key (the nested ones are named by their parent's field).
SECTION_TYPES = {"preference": Preference}
