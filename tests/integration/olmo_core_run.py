"""Run under ``torchrun --nproc_per_node 2``: AI2's OLMo-core 3.0 through its own entry points on CPU gloo ranks:
``TransformerConfig.olmo2_14M`` (2 layers) built on the meta device, ``TransformerTrainModuleConfig`` with its
data-parallel config (``fsdp``, or ``hsdp`` on a 2x1 mesh: 2 replicas of 1 shard), AdamW with a cosine schedule and
grad clipping, ``NumpyFSLDatasetConfig`` / ``NumpyDataLoaderConfig`` over synthetic token files, and the real
``Trainer``: 3 steps of 2 micro-batches and its checkpoint at step 3 (phase ``train``); then, in a new process
(OLMo-core builds one world mesh per process), the same configuration in the same folder resumes from that
checkpoint for steps 4 and 5 (phase ``resume``).

``argv``: variant, data-parallel type (``fsdp`` / ``hsdp``), phase, working folder. Variants: ``torch`` (torch's
``fully_shard``, OLMo-core unchanged), ``fc`` (everything inside ``fc.ported("olmo_core")``, docs/integrations.md
"OLMo-core"), ``fc_skip_train_module_guard`` (the port with the train module's ``FSDPModule`` name put back: what
that guard does).

CPU settings, all configuration (no OLMo-core source is changed): ``device="cpu"``, the ``gloo`` backend, no
compile, no float8, the default (SDPA) attention; bookkeeping and checkpoints synchronous (OLMo-core makes both
asynchronous on a CPU-capable backend, in threads whose collectives would land in whichever step they overlap).

Observation only: the train module's ``train_batch`` and ``optim_step`` run under a collective counter (the
trainer's dry-run batch is counted apart), a callback records each step's logged CE loss and total grad norm; every
rank's records are gathered to rank 0, which prints one ``RESULT`` JSON line.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import fsdp_compose as fc
from tests.integration.counting import totals
from tests.integration.launch import finish_rank

VOCAB = 256  # olmo2_14M's embedding rows: the tokenizer's vocab padded to a multiple of 128
SEQ = 64
MICRO_BATCHES = 2  # per rank and step: one sequence each
STEPS, RESUMED_STEPS = 3, 5
TOKENS = 64 * 1024  # 1024 sequences: more than the 5 steps x 4 sequences the runs read


def write_tokens(folder: Path) -> list[str]:
    """Synthetic documents as OLMo-core's numpy token files (raw uint16, as the Dolma toolkit writes them)."""
    path = folder / "tokens.npy"
    if dist.get_rank() == 0 and not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(0)
        tokens = rng.integers(2, VOCAB - 1, size=TOKENS, dtype=np.uint16)
        tokens[rng.integers(0, TOKENS, size=TOKENS // 200)] = 0  # end-of-document tokens
        mm = np.memmap(path, dtype=np.uint16, mode="w+", shape=(TOKENS,))
        mm[:] = tokens
        mm.flush()
    dist.barrier()
    return [str(path)]


def build_trainer(workdir: Path, dp: str, steps: int, records: list[dict[str, Any]]) -> Any:
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, CosWithWarmup, OptimGroupOverride
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, CheckpointerCallback
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerTrainModuleConfig

    class RecordMetrics(Callback):
        """The trainer's logged (rank-reduced) metrics of each step."""

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            if "train/CE loss" in metrics:  # the trainer also logs other metrics (its checkpoint's) apart
                records.append(
                    {"step": step, "loss": metrics["train/CE loss"], "grad_norm": metrics["optim/total grad norm"]}
                )

    tokenizer = TokenizerConfig(vocab_size=VOCAB - 1, eos_token_id=0, pad_token_id=1)
    model_config = TransformerConfig.olmo2_14M(vocab_size=tokenizer.padded_vocab_size(), n_layers=2)
    # HSDP: 2 replicas of (world size / 2) shards, with OLMo-core's forward prefetch (the LM-head guard's path).
    hsdp: dict[str, Any] = {}
    if dp == "hsdp":
        hsdp = {"num_replicas": 2, "shard_degree": dist.get_world_size() // 2, "prefetch_factor": 1}
    train_module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=SEQ,
        max_sequence_length=SEQ,
        optim=AdamWConfig(
            lr=4e-3,
            weight_decay=0.1,
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})],
        ),
        max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup=2, t_max=RESUMED_STEPS),
        dp_config=TransformerDataParallelConfig(name=DataParallelType(dp), **hsdp),
    )
    dataset = NumpyFSLDatasetConfig(
        paths=write_tokens(workdir / "data"),
        sequence_length=SEQ,
        tokenizer=tokenizer,
        work_dir=str(workdir / "dataset-work"),
    ).build()
    model = model_config.build(init_device="meta")
    train_module = train_module_config.build(model, device=torch.device("cpu"))
    data_loader = NumpyDataLoaderConfig(
        global_batch_size=SEQ * MICRO_BATCHES * dist.get_world_size(), seed=34521, num_workers=0
    ).build(dataset, dp_process_group=train_module.dp_process_group)
    trainer = TrainerConfig(
        save_folder=str(workdir / "checkpoints"),
        device="cpu",
        max_duration=Duration.steps(steps),
        metrics_collect_interval=1,
        async_bookkeeping=False,
        callbacks={
            "checkpointer": CheckpointerCallback(save_interval=1000, save_async=False, pre_train_checkpoint=False),
            "record_metrics": RecordMetrics(),
        },
    ).build(train_module, data_loader)
    count_collectives(train_module, records)
    records.append({"lm_head_prefetched": lm_head_prefetched(train_module.model)})
    return trainer


def lm_head_prefetched(model: Any) -> bool:
    """Whether the last block's forward prefetches the LM head (``Transformer.apply_fsdp`` sets it with a
    ``prefetch_factor``, behind its ``isinstance(self.lm_head, FSDPModule)`` guard)."""
    from torch.distributed.fsdp import FSDPModule

    last = list(model.blocks.values())[-1]
    if isinstance(last, FSDPModule):
        targets = last._get_fsdp_state()._states_to_forward_prefetch
        return any(model.lm_head in t._modules for t in targets)
    state = fc.get_state(last)
    assert state is not None
    return any(model.lm_head in t.modules for t in state.forward_prefetch or [])


def counts(counter: fc.CollectiveRecorder) -> dict[str, int]:
    """Calls and bytes per kind, and the all-reduces of integer tensors apart: fsdp_compose's agreement on each
    backward's schedule across ranks (a few int64 per group); gradients, grad norm and metrics are floating point."""
    integer = [r for r in counter.records if r.kind == "all_reduce" and not r.dtype.is_floating_point]
    return {**totals(counter), "all_reduce_integer": len(integer)}


def count_collectives(train_module: Any, records: list[dict[str, Any]]) -> None:
    """Each ``train_batch`` (forward and backward of the step's micro-batches) and ``optim_step`` (grad norm,
    clipping, AdamW) under a collective counter, one record each (this instance only)."""
    train_batch, optim_step = train_module.train_batch, train_module.optim_step

    def counted_train_batch(batch: dict[str, Any], dry_run: bool = False) -> None:
        with fc.CollectiveRecorder() as counter:
            train_batch(batch, dry_run=dry_run)
        records.append({"dry_run" if dry_run else "train_batch": counts(counter)})

    def counted_optim_step() -> None:
        with fc.CollectiveRecorder() as counter:
            optim_step()
        records.append({"optim_step": counts(counter)})

    train_module.train_batch, train_module.optim_step = counted_train_batch, counted_optim_step


def main() -> None:
    variant, dp, phase, workdir = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
    assert variant in ("torch", "fc", "fc_skip_train_module_guard") and dp in ("fsdp", "hsdp"), sys.argv
    assert phase in ("train", "resume"), phase
    from olmo_core.train import prepare_training_environment

    prepare_training_environment(seed=42, backend="gloo", shared_filesystem=True)
    records: list[dict[str, Any]] = []
    port = contextlib.nullcontext() if variant == "torch" else fc.ported("olmo_core")
    with port:
        if variant == "fc_skip_train_module_guard":
            # Inside the block the port's replacement is put back to torch's class; the port restores the same
            # object on exit.
            import olmo_core.train.train_module.transformer.train_module as train_module_source
            from torch.distributed.fsdp import FSDPModule

            train_module_source.FSDPModule = FSDPModule  # type: ignore[attr-defined]
        # "resume": the same folder, run to step 5: the trainer loads the step-3 checkpoint (model, optimizer,
        # scheduler, data loader position) from its save folder.
        build_trainer(workdir, dp, STEPS if phase == "train" else RESUMED_STEPS, records).fit()
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    finish_rank({"ranks": gathered, "checkpoint": str(workdir / "checkpoints" / f"step{STEPS}")})


if __name__ == "__main__":
    main()
