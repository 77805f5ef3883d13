"""Run under ``torchrun --nproc_per_node 2``: the HF ``Trainer`` with ``fsdp="full_shard"`` and
``fsdp_config={"fsdp_version": 2}`` (accelerate's FSDP2 plugin shards the model: each ``LlamaDecoderLayer``, the
embedding, the final norm with ``lm_head``, the root) on a tiny randomly initialized Llama built from a config in code,
gradient accumulation 2, 3 optimizer steps; then ``model.generate`` after training. Prints one JSON line (rank 0).

``argv[1]``: ``torch`` (torch's ``fully_shard``), ``fc`` (``Trainer`` built and trained under
``fc.ported("transformers")``), ``fc_accelerate_port`` (under ``fc.ported("accelerate")`` only: the ``Trainer``'s
``register_fsdp_forward_method(model, "generate")`` then does nothing)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import Dataset
from transformers import LlamaForCausalLM, Trainer, TrainingArguments

import fsdp_compose as fc
from tests.integration.counting import totals
from tests.integration.cpu_fsdp import enable_fsdp_plugin_on_cpu
from tests.integration.launch import finish_rank
from tests.integration.tiny_llama import tiny_llama_config

VARIANT = sys.argv[1]


class Tokens(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


class CountingTrainer(Trainer):
    """Counts the collectives of each optimizer step (the ``Trainer``'s own loop runs unchanged)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts: list[dict[str, int]] = []
        self.step_done = True

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.step_done:
            self.counts.append({})
        with fc.CollectiveRecorder() as counter:
            loss = super().training_step(*args, **kwargs)
        for key, value in totals(counter).items():
            self.counts[-1][key] = self.counts[-1].get(key, 0) + value
        self.step_done = self.accelerator.sync_gradients  # the micro-batch that ends an optimizer step
        return loss


enable_fsdp_plugin_on_cpu()
dist.init_process_group("gloo")
torch.manual_seed(0)
config = tiny_llama_config()
model = LlamaForCausalLM(config)
args = TrainingArguments(
    output_dir="/tmp/fc-hf-trainer-fsdp2",
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    max_steps=3,
    learning_rate=1e-2,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    logging_steps=1,
    seed=0,
    dataloader_num_workers=0,
    disable_tqdm=True,
    fsdp="full_shard",
    fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
)
ports = {
    "torch": contextlib.nullcontext(),
    "fc": fc.ported("transformers"),
    "fc_accelerate_port": fc.ported("accelerate"),
}
with ports[VARIANT]:
    trainer = CountingTrainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
model = trainer.model
losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
params = [p.full_tensor().flatten()[:8].tolist() for p in model.parameters()]
# generate after training (outside the port): the Trainer registered it for its FSDP model
registered = "generate" in vars(model)  # both libraries register it as an instance attribute
prompt = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(99))
with fc.CollectiveRecorder() as generate_counter:
    generated = model.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
finish_rank(
    {
        "loss": losses,
        "counts": trainer.counts,
        "params": params,
        "generate_registered": registered,
        "generated": generated,
        "generate_all_gathers": generate_counter.counts()["all_gather"],
        "sharded_by": "torch" if isinstance(model, FSDPModule) else "fc" if fc.is_fully_sharded(model) else "none",
    }
)
