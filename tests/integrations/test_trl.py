"""fastckpt inside TRL's SFTTrainer (the real package; skipped without it): the batches TRL builds (right and left
padding, packing, padding-free, completion-only loss), LoRA through `peft_config` and through a PEFT model,
gradient accumulation. `recompute` must train exactly as TRL with HF's gradient checkpointing; the loss head must
serve TRL's fused LM head (never two heads, never silently inert) with the same losses and metrics up to
summation order."""

from __future__ import annotations

import logging

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from fastckpt.integrations import hf  # noqa: E402
from fastckpt.integrations.hf import gateway, trl_head  # noqa: E402
from tests.helpers import tiny_decoder_config  # noqa: E402

VOCAB = 96
LENGTHS = (21, 9, 30, 14, 26, 17, 11, 23)  # one example each; batches of 2 (4 per step with accumulation)
HEAD = dict(policy="recompute", loss_head=True, padded_attention=True)
# What every trainer here is given: two steps on CPU, a metrics line per step, nothing saved or reported.
TRAINING = dict(
    output_dir="/tmp/fastckpt-test-trl",
    per_device_train_batch_size=2,
    max_steps=2,
    learning_rate=1e-2,
    logging_steps=1,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    dataloader_num_workers=0,
    seed=0,
)


@pytest.fixture(scope="module")
def tokenizer():
    from benchmarks.trl import tokenizer as word_level

    return word_level(VOCAB)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tiny_decoder_config("LlamaConfig", VOCAB, max_position_embeddings=256, attn_implementation="sdpa")()
    return transformers.LlamaForCausalLM(config)


def _dataset(completion_only: bool) -> datasets.Dataset:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for length in LENGTHS:
        row = {"input_ids": torch.randint(2, VOCAB, (length,), generator=generator).tolist()}
        if completion_only:  # the first third is the prompt
            row["completion_mask"] = [0] * (length // 3) + [1] * (length - length // 3)
        rows.append(row)
    return datasets.Dataset.from_list(rows)


class _LeftPadding:
    """TRL's collator pads on the right; this one moves each row's padding to its left."""

    def __init__(self, pad_token_id: int) -> None:
        self.collate = trl.trainer.sft_trainer.DataCollatorForLanguageModeling(pad_token_id=pad_token_id)

    def __call__(self, examples: list[dict]) -> dict:
        batch = self.collate(examples)
        shifts = (batch["attention_mask"] == 0).sum(1)
        for key in ("input_ids", "labels", "attention_mask"):
            batch[key] = torch.stack([row.roll(int(s)) for row, s in zip(batch[key], shifts, strict=True)])
        return batch


CASES = {
    "right": {},
    "left": {"collator": "left"},
    "packing": {"packing": True, "max_length": 48},
    "padding_free": {"padding_free": True, "max_length": None},
    "completion_only": {"completion_only_loss": True},
    "lora_config": {"lora": "config"},
    "lora_model": {"lora": "model"},
    "accumulation": {"gradient_accumulation_steps": 2},
}


def _train(tokenizer, setup: dict | None, case: dict, steps: int = 2, bf16: bool = False, after: bool = False):
    """TRL's SFTTrainer for `steps` steps; `setup`: None for HF's checkpointing, else hf.enable's arguments (before
    the trainer is built, or `after`). Returns the trainer and its logged metrics per step."""
    case = dict(case)
    model = _model()
    lora, collator = case.pop("lora", None), case.pop("collator", None)
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear") if lora else None
    if lora == "model":
        model, peft_config = peft.get_peft_model(model, peft_config), None
    if setup is not None and not after:
        hf.enable(model, **setup)
    config = trl.SFTConfig(**{**TRAINING, "max_steps": steps}, bf16=bf16, **case)
    trainer = trl.SFTTrainer(
        model=model,
        args=config,
        train_dataset=_dataset(case.get("completion_only_loss", False)),
        processing_class=tokenizer,
        peft_config=peft_config,
        data_collator=_LeftPadding(tokenizer.pad_token_id) if collator == "left" else None,
    )
    if setup is not None and after:
        hf.enable(trainer.model, **setup)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return trainer, logs


def _metrics(logs: list[dict]) -> list[dict]:
    return [{k: v for k, v in entry.items() if k not in ("train_runtime",)} for entry in logs]


@pytest.fixture
def kernels(monkeypatch):
    """Counts the calls of fastckpt's per-token head and of TRL's own kernel."""
    calls = {"fastckpt": 0, "trl": 0}
    ours = trl_head.linear_log_probs

    def counted_ours(*args, **kwargs):
        calls["fastckpt"] += 1
        return ours(*args, **kwargs)

    monkeypatch.setattr(trl_head, "linear_log_probs", counted_ours)
    original = trl.trainer.utils._ChunkedLogProbFunction
    original = getattr(original, "trl_kernel", None) or original

    class CountedTRL:
        @staticmethod
        def apply(*args):
            calls["trl"] += 1
            return original.apply(*args)

    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", CountedTRL)
    monkeypatch.setattr(trl_head._ServedKernel, "trl_kernel", CountedTRL)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_sft_trainer(tokenizer, kernels, name):
    case = CASES[name]
    _, reference = _train(tokenizer, None, case)
    assert kernels == {"fastckpt": 0, "trl": 2 * (1 + ("gradient_accumulation_steps" in case))}
    trainer, recompute = _train(tokenizer, {"policy": "recompute"}, case)
    assert hf.is_enabled(trainer.model)
    assert _metrics(recompute) == _metrics(reference)  # bit for bit: the same computation, checkpointed by fastckpt
    kernels.update(fastckpt=0, trl=0)
    _, head = _train(tokenizer, HEAD, case)
    assert kernels["trl"] == 0 and kernels["fastckpt"] > 0  # one head: fastckpt's served TRL's forward
    assert [sorted(e) for e in head] == [sorted(e) for e in reference]  # TRL's metrics, all of them
    for got, want in zip(head, reference, strict=True):
        for key, value in want.items():
            if key not in ("train_runtime", "learning_rate", "epoch", "num_tokens"):
                assert got[key] == pytest.approx(value, rel=2e-4, abs=1e-5), key
            else:
                assert got[key] == value, key


def test_enable_after_the_trainer_is_built_and_bf16(tokenizer, kernels, caplog):
    _, reference = _train(tokenizer, None, CASES["right"], bf16=True)
    with caplog.at_level(logging.INFO, logger="fastckpt"):
        trainer, head = _train(tokenizer, HEAD, CASES["right"], bf16=True, after=True)
    assert kernels["fastckpt"] > 0
    said = [r for r in caplog.records if "TRL's fused LM head" in r.getMessage()]
    assert len(said) == 1  # once per model
    for got, want in zip(head, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=2e-2)
        assert got["mean_token_accuracy"] == pytest.approx(want["mean_token_accuracy"], abs=0.02)


def test_a_budget_is_planned_on_trls_first_batch(tokenizer, kernels):
    """enable(budget=...) plans on the first training batch, which under TRL is a fused-head call."""
    _, reference = _train(tokenizer, None, CASES["right"], steps=1)
    trainer, planned = _train(tokenizer, {"budget": "100%", "loss_head": True, "padded_attention": True}, {}, steps=1)
    plan = hf.planned(trainer.model)
    assert plan is not None and plan.applied and plan.measured_peak <= plan.budget
    assert kernels["fastckpt"] > 0
    assert planned[0]["loss"] == pytest.approx(reference[0]["loss"], rel=2e-4)


def test_only_the_enabled_models_head_is_served(kernels):
    """A reference model (or any model without loss_head=True) keeps TRL's kernel; disable hands ours back."""
    served, other = _model(), _model()
    for model in (served, other):
        trl.trainer.utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    hf.enable(served, **HEAD)
    ids = torch.randint(2, VOCAB, (2, 12))
    out = {m: m(input_ids=ids, labels=ids, fused_lm_head=True) for m in (other, served)}
    assert kernels == {"fastckpt": 1, "trl": 1}
    torch.testing.assert_close(out[served].log_probs, out[other].log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[served].entropy, out[other].entropy, rtol=1e-5, atol=1e-5)
    hf.disable(served)
    served(input_ids=ids, labels=ids, fused_lm_head=True)
    assert kernels == {"fastckpt": 1, "trl": 2}


def test_ignored_positions_skip_the_head(monkeypatch):
    """Without Triton TRL hands its kernel every position and zeroes the ignored ones afterwards; fastckpt scores
    the counted ones only (padding, prompt and each sequence's last position cost no head work), with TRL's
    results and gradients."""
    scored = []
    ours = trl_head.linear_log_probs

    def recorded(hidden, *args, **kwargs):
        scored.append(hidden.shape[0])
        return ours(hidden, *args, **kwargs)

    monkeypatch.setattr(trl_head, "linear_log_probs", recorded)
    served, other = _model(), _model()
    outputs = ("log_probs", "entropy", "is_top1")
    for model in (served, other):
        trl.trainer.utils.add_fused_lm_head(model, temperature=0.7, outputs=outputs)
    hf.enable(served, **HEAD)
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    labels, attention = ids.clone(), torch.ones_like(ids)
    labels[:, :4] = -100  # prompts
    labels[1, 9:], attention[1, 9:] = -100, 0  # right padding
    results = {}
    for model in (served, other):
        out = model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
        (out.log_probs.sum() + out.entropy.sum()).backward()
        results[model] = (out, [p.grad for p in model.parameters()])
    assert scored == [int((labels[:, 1:] != -100).sum())]  # 8 + 5 of the 22 shifted positions
    (got, got_grads), (want, want_grads) = results[served], results[other]
    for name in outputs:
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-5, atol=1e-5)
    for grad, ref in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)


def test_scored_positions_follow_shift_labels_and_only_this_call(monkeypatch):
    """The scored positions come from the call's labels: pre-shifted `shift_labels` are scored unshifted, and a
    later call of `forward` without the model's hooks gets every position scored (no mask of an earlier call)."""
    scored = []
    ours = trl_head.linear_log_probs
    monkeypatch.setattr(trl_head, "linear_log_probs", lambda h, *a, **k: scored.append(h.shape[0]) or ours(h, *a, **k))
    served, other = _model(), _model()
    for model in (served, other):
        trl.trainer.utils.add_fused_lm_head(model)
    hf.enable(served, **HEAD)
    ids = torch.randint(2, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    shifted = ids.clone()
    shifted[0, :6] = -100
    for call in ("__call__", "forward"):
        out = {m: getattr(m, call)(input_ids=ids, shift_labels=shifted, fused_lm_head=True) for m in (served, other)}
        torch.testing.assert_close(out[served].log_probs, out[other].log_probs, rtol=1e-5, atol=1e-5)
    assert scored == [int((shifted != -100).sum()), shifted.numel()]


def test_a_tied_embeddings_gradient_is_added_into_the_served_heads(monkeypatch):
    """A full fine-tune of a tied model under TRL's fused head: the embedding's gradient goes into the head's in
    place (no second [vocab, hidden] gradient), with TRL's gradients; the embedding is left as it was."""
    from fastckpt.memory import peak_bytes

    def tied() -> torch.nn.Module:  # few tokens, a vocabulary that outweighs the layers
        torch.manual_seed(0)
        config = tiny_decoder_config("LlamaConfig", 8192, tie_word_embeddings=True, attn_implementation="sdpa")()
        return transformers.LlamaForCausalLM(config)

    served, other = tied(), tied()
    for model in (served, other):
        trl.trainer.utils.add_fused_lm_head(model)
    hf.enable(served, **HEAD)
    ids = torch.randint(2, 8192, (1, 6), generator=torch.Generator().manual_seed(4))

    def backward(model: torch.nn.Module) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()
        return [p.grad for p in model.parameters()]

    for grad, ref in zip(backward(served), backward(other), strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6)
    weight = served.model.embed_tokens.weight
    assert not served.model.embed_tokens.sparse and weight.grad.layout == torch.strided
    peak = peak_bytes(lambda: backward(served))
    monkeypatch.setattr(trl_head, "_tied_embedding", lambda model, head: None)  # the lookup's dense gradient
    dense_peak = peak_bytes(lambda: backward(served))
    assert peak < 2 * weight.numel() * weight.element_size() <= dense_peak


@pytest.mark.parametrize("why", ["no kernel in this TRL", "a DTensor head", "an fp32 head cast"])
def test_what_is_not_served_is_reported(monkeypatch, kernels, why):
    model = _model()
    if why == "an fp32 head cast":  # fp32 hidden states outside autocast for a bf16 head
        model.lm_head.to(torch.bfloat16)
    trl.trainer.utils.add_fused_lm_head(model, cast_lm_head_to_fp32=why == "an fp32 head cast")
    hf.enable(model, **HEAD)
    if why == "no kernel in this TRL":
        monkeypatch.setattr(gateway, "TRL_KERNEL", "_not_in_this_release")
        assert "_not_in_this_release" not in trl_head.trl_forward(model).__code__.co_names
    elif why == "a DTensor head":  # FSDP2 / tensor parallel: TRL gathers the weight into a new tensor
        monkeypatch.setattr(trl_head, "_is_dtensor", lambda tensor: tensor is model.lm_head.weight)
    ids = torch.randint(2, VOCAB, (1, 8))
    with pytest.warns(UserWarning, match="TRL's head computes the log-probabilities"):
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert kernels == {"fastckpt": 0, "trl": 1}


def _words(generator: torch.Generator, n: int) -> str:
    from benchmarks.trl import words

    return words(generator, VOCAB, n)


def _preferences() -> datasets.Dataset:
    generator = torch.Generator().manual_seed(2)
    return datasets.Dataset.from_list(
        [
            {"prompt": _words(generator, p), "chosen": _words(generator, c), "rejected": _words(generator, r)}
            for p, c, r in ((7, 9, 5), (4, 12, 8))
        ]
    )


def _train_dpo(tokenizer, setup: dict | None) -> list[dict]:
    model, reference = _model(), _model()
    if setup is not None:
        hf.enable(model, **setup)
    config = trl.DPOConfig(**TRAINING, bf16=False)
    trainer = trl.DPOTrainer(
        model=model, ref_model=reference, args=config, train_dataset=_preferences(), processing_class=tokenizer
    )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def test_dpo_trainer(tokenizer, kernels):
    """DPO weights each sequence's summed log-probabilities by a sigmoid of the policy's and the reference's: the
    policy's head is fastckpt's, the reference model's TRL's."""
    reference = _train_dpo(tokenizer, None)
    assert kernels["fastckpt"] == 0 and kernels["trl"] > 0
    kernels.update(fastckpt=0, trl=0)
    head = _train_dpo(tokenizer, HEAD)
    assert kernels["fastckpt"] > 0 and kernels["trl"] > 0  # the reference model keeps TRL's kernel
    _assert_same_metrics(head, reference)


def _unpaired() -> datasets.Dataset:
    generator = torch.Generator().manual_seed(3)
    lengths = ((5, 9, True), (3, 6, False), (8, 4, True), (4, 11, False))
    return datasets.Dataset.from_list(
        [{"prompt": _words(generator, p), "completion": _words(generator, c), "label": k} for p, c, k in lengths]
    )


def _prompts() -> datasets.Dataset:
    generator = torch.Generator().manual_seed(4)
    return datasets.Dataset.from_list([{"prompt": _words(generator, n)} for n in (6, 9, 4, 7)])


def _completion_words(completions: list[str], **_: object) -> list[float]:
    """GRPO's reward: the completion's length in characters (differs within a group, so advantages are not 0)."""
    return [float(len(c)) for c in completions]


def _train_kto_or_rl(tokenizer, setup: dict | None, trainer_name: str) -> list[dict]:
    model = _model()
    if setup is not None:
        hf.enable(model, **setup)
    if trainer_name == "kto":  # a reference model, and the KL term's mismatched pairs
        config = trl.KTOConfig(**TRAINING, bf16=False)
        trainer = trl.KTOTrainer(
            model=model, ref_model=_model(), args=config, train_dataset=_unpaired(), processing_class=tokenizer
        )
    else:  # sampled completions, TRL's temperature in the head, the entropy logged
        config_class, trainer_class = (
            (trl.GRPOConfig, trl.GRPOTrainer) if trainer_name == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
        )
        config = config_class(  # beta 0: no reference model (RLOO would load one from the hub)
            **TRAINING, bf16=False, num_generations=2, max_completion_length=6, temperature=0.7, beta=0.0
        )
        trainer = trainer_class(
            model=model,
            reward_funcs=_completion_words,
            args=config,
            train_dataset=_prompts(),
            processing_class=tokenizer,
        )
    trainer.train()
    return [entry for entry in trainer.state.log_history if "loss" in entry]


@pytest.mark.parametrize("trainer_name", ["kto", "grpo", "rloo"])
def test_kto_grpo_and_rloo_trainers(tokenizer, kernels, trainer_name):
    """KTO, GRPO and RLOO build their losses from the same fused forward: with the loss head on, the trained
    model's per-token log-probabilities (GRPO's and RLOO's at their sampling temperature) are fastckpt's, the
    metrics TRL's."""
    reference = _train_kto_or_rl(tokenizer, None, trainer_name)
    assert kernels["fastckpt"] == 0 and kernels["trl"] > 0
    kernels.update(fastckpt=0, trl=0)
    head = _train_kto_or_rl(tokenizer, HEAD, trainer_name)
    assert kernels["fastckpt"] > 0
    # KTO's reference model keeps TRL's kernel; GRPO and RLOO have none (beta = 0)
    assert (kernels["trl"] > 0) == (trainer_name == "kto")
    _assert_same_metrics(head, reference)


def _assert_same_metrics(got_logs: list[dict], want_logs: list[dict]) -> None:
    """The same metrics logged at each step, every number within 1e-3 (the summation order differs); timings
    aside."""
    assert [sorted(e) for e in got_logs] == [sorted(e) for e in want_logs]
    for got, want in zip(got_logs, want_logs, strict=True):
        for key, value in want.items():
            if isinstance(value, float) and key not in ("learning_rate", "epoch") and "time" not in key:
                assert got[key] == pytest.approx(value, rel=1e-3, abs=1e-5), key


@pytest.mark.parametrize("name", ["right", "accumulation", "lora_config"])
def test_sft_trainer_steps_its_optimizer_in_the_backward(tokenizer, kernels, name):
    """hf.enable(optimizer_in_backward=True) under SFTTrainer: TRL's clipping (max_grad_norm 1.0), accumulation
    and scheduler honoured, so every logged metric (grad_norm among them) and the trained weights are those of
    the same run with the plain optimizer step."""
    case = CASES[name]
    plain, reference = _train(tokenizer, HEAD, case)
    trainer, stepped = _train(tokenizer, {**HEAD, "optimizer_in_backward": True}, case)
    assert trainer.optimizer.optimizer.__class__.__name__ == "OptimizerInBackward"
    assert [sorted(e) for e in stepped] == [sorted(e) for e in reference] and "grad_norm" in reference[0]
    for got, want in zip(stepped, reference, strict=True):
        for key, value in want.items():
            if "runtime" not in key and "per_second" not in key:
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for (name_, p), q in zip(trainer.model.named_parameters(), plain.model.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7), name_
