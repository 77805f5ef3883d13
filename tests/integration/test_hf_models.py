"""transformers 5.x architectures beyond Llama on fsdp_compose, 2 CPU gloo ranks: every layer of every
``nn.ModuleList`` sharded, then the root; two AdamW steps against a single-process reference on the global batch;
``generate()`` through ``fc.register_forward_method``; ``fc.full_state_dict`` loaded into an unsharded model.
Models are built from small configs in code (no downloads) and run in eval mode (no dropout)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

import fsdp_compose as fc
from tests.dist_utils import max_param_diff, mesh_1d

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 96, 12, 4


def _build(arch: str) -> tuple[nn.Module, bool]:
    """(model, can ``generate``)."""
    t = transformers
    small = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64}
    if arch == "gpt2":  # Conv1D layers, tied embeddings
        config = t.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64)
        return t.GPT2LMHeadModel(config), True
    if arch == "qwen2":
        config = t.Qwen2Config(**small, num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64)
        return t.Qwen2ForCausalLM(config), True
    if arch == "mixtral":  # mixture of experts
        config = t.MixtralConfig(
            **small, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2
        )
        return t.MixtralForCausalLM(config), True
    if arch == "bart":  # encoder-decoder, tied embeddings
        config = t.BartConfig(
            vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        )  # fmt: skip
        return t.BartForConditionalGeneration(config), True
    if arch == "bert":
        config = t.BertConfig(**small, num_hidden_layers=2, max_position_embeddings=64)
        return t.BertForMaskedLM(config), False
    if arch == "vit":
        config = t.ViTConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16,
            patch_size=4, num_channels=3, num_labels=5,
        )  # fmt: skip
        return t.ViTForImageClassification(config), False
    raise AssertionError(arch)


def _lora(rank: int, ws: int) -> float:
    """peft LoRA on Qwen2: base weights frozen, adapters trainable, every decoder layer sharded."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base, _ = _build("qwen2")
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    model.eval()
    reference = copy.deepcopy(model)
    for layer in model.base_model.model.model.layers:
        fc.fully_shard(layer, mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    trainable = [[p for p in m.parameters() if p.requires_grad] for m in (model, reference)]
    opts = [torch.optim.AdamW(ps, lr=1e-2) for ps in trainable]
    for step in range(2):
        batch = _batch("qwen2", step)
        local = {k: v.chunk(ws)[rank] for k, v in batch.items()}
        for m, opt, inputs in ((model, opts[0], local), (reference, opts[1], batch)):
            opt.zero_grad()
            m(**inputs).loss.backward()
            opt.step()
    return max_param_diff(model, reference)


def test_peft_lora_trains_like_the_reference(run_dist) -> None:
    for diff in run_dist(2, _lora):
        assert diff < 3e-4


def _batch(arch: str, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    if arch == "vit":
        return {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=gen), "labels": torch.randint(0, 5, (BATCH,))}
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids.clone()}


def _train(rank: int, ws: int, arch: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model, causal = _build(arch)
    model.eval()
    reference = copy.deepcopy(model)
    for module in list(model.modules()):
        if isinstance(module, nn.ModuleList):
            for layer in module:
                if any(True for _ in layer.parameters()):
                    fc.fully_shard(layer, mesh=mesh_1d(ws))
    fc.fully_shard(model, mesh=mesh_1d(ws))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(2):
        batch = _batch(arch, step)
        local = {k: v.chunk(ws)[rank] for k, v in batch.items()}
        for m, opt, inputs in ((model, opts[0], local), (reference, opts[1], batch)):
            opt.zero_grad()
            m(**inputs).loss.backward()
            opt.step()
    result: dict[str, Any] = {"param_diff": max_param_diff(model, reference)}
    if causal:
        fc.register_forward_method(model, "generate")
        prompt = _batch(arch, 9)["input_ids"][:1, :4]
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
        result["generate"] = torch.equal(model.generate(prompt, **kwargs), reference.generate(prompt, **kwargs))
    full = fc.full_state_dict(model, rank0_only=False)
    unsharded, _ = _build(arch)
    unsharded.load_state_dict(full)
    expected = reference.state_dict()
    result["state_dict_diff"] = max((unsharded.state_dict()[k] - v).abs().max().item() for k, v in expected.items())
    return result


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "mixtral", "bart", "bert", "vit"])
def test_hf_architecture_trains_like_the_reference(run_dist, arch: str) -> None:
    for result in run_dist(2, _train, arch):
        # AdamW divides by the root of tiny second moments: reduction-order rounding grows to ~1e-4 in two steps
        assert result["param_diff"] < 3e-4, result
        assert result["state_dict_diff"] < 3e-4, result
        assert result.get("generate", True), result
