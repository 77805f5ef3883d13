"""A GRPO-style post-training loop on a tiny Llama (transformers), sharded by fsdp_compose or torch's fully_shard.

    pip install transformers
    torchrun --standalone --nproc_per_node 2 examples/rl_loop.py            # fsdp_compose
    torchrun --standalone --nproc_per_node 2 examples/rl_loop.py --impl torch

Each iteration: a rollout (greedy ``generate`` under ``torch.inference_mode()``, a group of completions per prompt),
rewards and group-normalised advantages, log-probabilities of a frozen reference model (a ``copy.deepcopy`` of the
sharded policy), one policy-gradient step with a KL penalty, the new weights streamed in bf16 into an unsharded
model that stands in for the inference engine (and checked equal to the policy's), then the policy and its
optimizer moved off the device while the "engine" would run, and back. torch's ``fully_shard`` gets the nearest
equivalents: a no_grad rollout (its first forward under inference mode loses the model), a reference sharded from a
copy made before sharding (it refuses ``deepcopy``), ``get_model_state_dict`` for the weights and no offload.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import fsdp_compose as fc


def log_probs(model: torch.nn.Module, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Per completion token, the log-probability the model gives it."""
    logits = model(sequences).logits[:, prompt_len - 1 : -1].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, sequences[:, prompt_len:, None]).squeeze(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["fc", "torch"], default="fc")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the results as one JSON line on rank 0")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=None,
    )
    policy = LlamaForCausalLM(config)
    engine = copy.deepcopy(policy).to(torch.bfloat16)  # the inference engine's unsharded copy
    if args.impl == "fc":
        for layer in policy.model.layers:
            fc.fully_shard(layer, mesh=mesh)
        fc.fully_shard(policy, mesh=mesh)
        reference = copy.deepcopy(policy)  # an independent sharded model
    else:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        reference = copy.deepcopy(policy)  # torch's fully_shard refuses deepcopy: copy first, shard both
        for model in (policy, reference):
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            register_fsdp_forward_method(model, "generate")
    reference.requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    group, prompt_len, new_tokens = 4, 6, 8
    results: dict[str, Any] = {"loss": [], "reward": [], "engine_equal": []}
    for iteration in range(args.iterations):
        prompts = torch.randint(1, 64, (2, prompt_len), generator=torch.Generator().manual_seed(100 * iteration + rank))
        prompts = prompts.repeat_interleave(group, dim=0)
        rollout = torch.inference_mode if args.impl == "fc" else torch.no_grad
        with rollout():
            # Sampling would differ per completion; greedy with a per-completion first token stands in for it.
            prompts[:, -1] = torch.arange(len(prompts)) % 64
            sequences = policy.generate(prompts, max_new_tokens=new_tokens, do_sample=False)
        sequences = sequences.clone()  # out of inference mode
        completion = sequences[:, prompt_len:]
        reward = (completion % 2 == 0).float().mean(dim=1)  # a toy reward: even token ids
        grouped = reward.view(-1, group)
        advantage = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
        with torch.no_grad():
            reference_lp = log_probs(reference, sequences, prompt_len)
        policy_lp = log_probs(policy, sequences, prompt_len)
        kl = (policy_lp - reference_lp).mean()
        loss = -(advantage[:, None] * policy_lp).mean() + 0.05 * kl
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        # The new weights to the inference engine, in bf16.
        if args.impl == "fc":
            weights = dict(fc.full_weights(policy, dtype=torch.bfloat16))
        else:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
            weights = {k: cast(torch.Tensor, v).to(torch.bfloat16) for k, v in full.items()}
        engine.load_state_dict(weights)
        expected = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).to(torch.bfloat16)
            for k, v in policy.state_dict().items()
        }
        results["engine_equal"].append(all(torch.equal(engine.state_dict()[k], v) for k, v in expected.items()))
        if args.impl == "fc":  # the engine would run now: the policy and its optimizer leave the device
            fc.move_to_host(policy, optimizer)
            fc.move_to_device(policy)
        totals = torch.tensor([loss.item(), reward.mean().item()])
        dist.all_reduce(totals)
        results["loss"].append(round(totals[0].item() / world, 6))
        results["reward"].append(round(totals[1].item() / world, 6))
        if rank == 0 and not args.json:
            print(f"iteration {iteration}: loss {results['loss'][-1]:.6f}, reward {results['reward'][-1]:.4f}")
    if rank == 0 and args.json:
        sys.stdout.write("RESULT " + json.dumps(results) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
