"""Neat packing's varlen inputs against LLaMA-Factory's 4-D mask, and the divergence diagnosis."""

import torch
from llamafactory.data.collator import prepare_4d_attention_mask
from llmft.core import varlen
from llmft.sft.callbacks import diagnose
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_segments_become_sequences_per_row_and_sample():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 2, 3, 3, 3]])
    pos, cu, max_len = varlen.segments_to_varlen(seg)
    assert pos.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 0, 1, 2]]
    assert cu.tolist() == [0, 2, 5, 6, 7, 9, 12] and max_len == 3


def test_varlen_attention_equals_llamafactory_block_diagonal_mask():
    torch.manual_seed(0)
    seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 3 + [0] * 1, [1] * 9 + [2] * 7])
    batch, seq, heads, kv_heads, dim = 2, 16, 4, 2, 8
    q = torch.randn(batch, heads, seq, dim)
    k, v = torch.randn(batch, kv_heads, seq, dim), torch.randn(batch, kv_heads, seq, dim)
    _, cu, max_len = varlen.segments_to_varlen(seg)

    class Module:  # what sdpa_attention_forward reads from the attention layer
        num_key_value_groups = heads // kv_heads
        is_causal = True
        training = False

    out, _ = varlen.attention(
        Module, q, k, v, None, scaling=dim**-0.5, cu_seq_lens_q=cu, max_length_q=max_len
    )
    mask = prepare_4d_attention_mask(seg, torch.float32)
    ref, _ = sdpa_attention_forward(Module, q, k, v, mask, scaling=dim**-0.5)
    real = seg != 0  # padding rows: LLaMA-Factory masks them entirely, varlen lets them self-attend
    assert torch.allclose(out[real], ref[real], atol=1e-5)


def test_diagnosis_ranks_fp16_then_learning_rate():
    history = [{"step": s, "loss": 2.0, "grad_norm": g} for s, g in ((1, 1.0), (2, 30.0))]
    event = {"step": 3, "what": "loss is nan", "learning_rate": 1e-3}
    d = diagnose(event, history, precision="fp16", peak_lr=1e-3, finetuning_type="full", cutoff_len=4096,
                 warmup_steps=0)  # fmt: skip
    assert d["causes"][0].startswith("precision: fp16") and "sft.precision: bf16" in d["causes"][0]
    assert d["causes"][1].startswith("learning rate") and "0.0001" in d["causes"][1]
    assert any("data.cutoff_len=4096" in c for c in d["causes"])


def test_diagnosis_of_a_modest_bf16_run_points_at_the_data():
    history = [{"step": s, "loss": 2.0, "grad_norm": 1.0} for s in range(1, 30)]
    d = diagnose({"step": 30, "what": "loss is inf"}, history, precision="bf16", peak_lr=1e-5,
                 finetuning_type="full", cutoff_len=2048, warmup_steps=3)  # fmt: skip
    assert d["causes"][0].startswith("over-long rows")


def test_profile_window_records_only_the_asked_steps(tmp_path):
    import pytest
    from llmft.sft.callbacks import ProfileWindow, profile_window
    from transformers import TrainerState, TrainingArguments

    assert profile_window(None) is None
    assert profile_window("2:3") == (2, 3)
    for bad in ("3", "3:2", "0:1", "a:b"):
        with pytest.raises(ValueError, match="LLMFT_PROFILE_STEPS"):
            profile_window(bad)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[])
    state = TrainerState()
    cb = ProfileWindow(2, 3)
    x = torch.randn(64, 64)
    for step in range(5):  # global_step counts finished optimizer steps
        state.global_step = step
        cb.on_step_begin(args, state, None)
        (x @ x).sum()
        state.global_step = step + 1
        cb.on_step_end(args, state, None)
        if step == 0:
            assert cb.prof is None  # step 1 is not profiled
    text = (tmp_path / "llmft_profile_rank0.txt").read_text()
    assert text.startswith("optimizer steps 2-3 (2):")
    assert "aten::mm" in text
    import gzip
    import json

    trace = json.loads(gzip.decompress((tmp_path / "llmft_trace_rank0.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])  # the timeline of the same steps
    assert cb.prof is None and cb.done


def test_kernel_inputs_follow_autocast_like_sdpa():
    """fp32 q/k/v under autocast (plain DDP + rotary embedding) reach the kernel in the autocast dtype."""
    q = torch.randn(4, 2, 8)
    assert varlen.kernel_dtype(q, q)[0].dtype == torch.float32  # no autocast: left alone
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = varlen.kernel_dtype(q, q, q)
        assert [t.dtype for t in cast] == [torch.bfloat16] * 3
        half = q.half()
        assert varlen.kernel_dtype(half)[0] is half  # already 16 bit: unchanged


def test_flattened_batch_has_no_padding_and_the_same_loss_as_llamafactory_neat_packing(monkeypatch):
    """The varlen collator's one-row batch (padding dropped) gives the loss LLaMA-Factory's own neat
    packing gives on the padded batch (4-D block-diagonal mask), on a tiny random Llama."""
    torch.manual_seed(0)
    seg = torch.tensor([[1] * 5 + [2] * 7 + [3] * 3 + [0] * 3, [1] * 9 + [2] * 9, [1] * 6 + [0] * 12])
    ids = torch.randint(3, 100, seg.shape).masked_fill(seg == 0, 0)
    labels = ids.clone().masked_fill(seg == 0, -100)
    labels[0, 5:8] = -100  # a prompt inside a row: no target
    batch = {"input_ids": ids, "labels": labels, "attention_mask": seg}
    flat = varlen.flatten_packed({k: v.clone() for k, v in batch.items()}, pad_id=0, multiple=1)
    real = int((seg != 0).sum())
    assert flat["input_ids"].shape == (1, real) and flat["attention_mask"].tolist() == [[1] * real]
    assert flat["cu_seq_lens_q"].tolist() == [0, 5, 12, 15, 24, 33, 39] and flat["max_length_q"] == 9
    assert flat["position_ids"][0, :14].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1]
    # each row's first token is no target once rows are joined
    assert flat["labels"][0, [0, 15, 33]].tolist() == [-100, -100, -100]
    # padded to a multiple of 16: 39 real tokens + a 9-token sequence of padding, never a target
    padded = varlen.flatten_packed({k: v.clone() for k, v in batch.items()}, pad_id=1, multiple=16)
    assert padded["input_ids"].shape == (1, 48) and padded["cu_seq_lens_q"].tolist()[-2:] == [39, 48]
    assert padded["input_ids"][0, 39:].tolist() == [1] * 9 and padded["labels"][0, 39:].eq(-100).all()
    assert padded["position_ids"][0, 39:].tolist() == list(range(9))
    # the trainer's non_padding count (attention_mask.sum()) is the real tokens only
    assert padded["attention_mask"].tolist() == [[1] * 39 + [0] * 9]
    # sft.static_shapes: padded to the micro-batch's capacity (3 rows x 18), one 15-token pad sequence
    monkeypatch.setenv(varlen.PAD_TO_ENV, str(seg.numel()))
    static = varlen.flatten_packed({k: v.clone() for k, v in batch.items()}, pad_id=1)
    monkeypatch.delenv(varlen.PAD_TO_ENV)
    assert static["input_ids"].shape == (1, 54) and static["cu_seq_lens_q"].tolist()[-2:] == [39, 54]
    assert static["labels"][0, 39:].eq(-100).all() and int(static["attention_mask"].sum()) == 39

    model = _tiny_llama().eval()
    varlen.register()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        mask = prepare_4d_attention_mask(seg, torch.float32)
        ref = model(input_ids=ids, labels=labels, attention_mask=mask)
        model.set_attn_implementation(varlen.NAME)
        ours = model(**flat)
        ours_padded = model(**padded)
        ours_static = model(**static)
    assert torch.allclose(ours.loss, ref.loss, atol=1e-5), (ours.loss, ref.loss)
    assert torch.allclose(ours_padded.loss, ref.loss, atol=1e-5), (ours_padded.loss, ref.loss)
    assert torch.allclose(ours_static.loss, ref.loss, atol=1e-5), (ours_static.loss, ref.loss)


def test_guard_logs_before_every_save():
    """A checkpoint's steps pass the guard first: a step that saves also logs (logging comes first)."""
    from llmft.sft.callbacks import DivergenceGuard
    from transformers import TrainerControl

    guard = DivergenceGuard(factor=100, precision="bf16", finetuning_type="full", cutoff_len=2048)
    control = TrainerControl()
    guard.on_step_end(None, None, control)
    assert control.should_log is False  # no save, logging stays on its own schedule
    control.should_save = True
    guard.on_step_end(None, None, control)
    assert control.should_log is True


def test_the_trainer_counts_varlen_tokens_on_the_host_and_the_model_never_sees_the_count(tmp_path):
    """A real transformers Trainer on collated varlen batches: the token count is the batches' real
    tokens (what transformers' own non_padding count gives), read from the host integer, and the
    integer is dropped before the model's forward."""
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    varlen.register()
    varlen.count_tokens_on_host()
    model = _tiny_llama()
    model.set_attn_implementation(varlen.NAME)
    seen = []
    model.register_forward_pre_hook(lambda _m, _a, kwargs: seen.append(set(kwargs)), with_kwargs=True)
    segs = [[1] * 5 + [2] * 7 + [0] * 4, [1] * 16, [1] * 3 + [0] * 13, [1] * 9 + [2] * 5 + [0] * 2]
    rows = []
    for seg in segs:
        seg = torch.tensor(seg)
        ids = torch.randint(3, 100, seg.shape).masked_fill(seg == 0, 0)
        rows.append({"input_ids": ids, "labels": ids.masked_fill(seg == 0, -100), "attention_mask": seg})

    def collate(features):
        batch = {k: torch.stack([f[k] for f in features]) for k in features[0]}
        out = varlen.trainer_batch(batch)
        assert out[varlen.TOKENS_KEY] == int((batch["attention_mask"] != 0).sum())
        return out

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[], use_cpu=True,
        include_num_input_tokens_seen="non_padding", save_strategy="no", logging_steps=1,
        dataloader_num_workers=0, remove_unused_columns=False,
    )  # fmt: skip
    trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
    trainer.train()
    real = sum(int((torch.tensor(s) != 0).sum()) for s in segs)
    assert trainer.state.num_input_tokens_seen == real == 45
    assert len(seen) == 2 and all(varlen.TOKENS_KEY not in kw and "cu_seq_lens_q" in kw for kw in seen)


def _sum_over_ranks(rank, path, out):
    import torch.distributed as dist
    from llmft.core import hostcomm

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    out.put((rank, hostcomm.total(10 + rank), hostcomm.any_rank(rank == 1), hostcomm.any_rank(False)))
    dist.destroy_process_group()


def test_host_collectives_sum_and_max_over_ranks_through_a_cpu_group(tmp_path):
    import torch.multiprocessing as mp
    from llmft.core import hostcomm

    assert hostcomm.total(7) == 7 and hostcomm.any_rank(True)  # no process group: this rank's own
    ctx = mp.get_context("fork")  # CPU only: the children reuse the imported torch
    out = ctx.Queue()
    procs = [ctx.Process(target=_sum_over_ranks, args=(r, tmp_path / "init", out)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert results == [(0, 21, True, False), (1, 21, True, False)]


def test_install_counts_on_the_host_unless_the_bench_switch_keeps_transformers_count(monkeypatch):
    from llamafactory.train.sft import workflow

    monkeypatch.setattr(
        workflow, "SFTDataCollatorWith4DAttentionMask", workflow.SFTDataCollatorWith4DAttentionMask
    )
    calls = []
    monkeypatch.setattr(varlen, "count_tokens_on_host", lambda: calls.append("host"))
    monkeypatch.setenv(varlen.DEVICE_COUNT_ENV, "1")
    varlen.install()
    assert calls == []  # transformers' own count: the bench's fp8_lora_devcount_8b
    monkeypatch.delenv(varlen.DEVICE_COUNT_ENV)
    varlen.install()
    assert calls == ["host"]
