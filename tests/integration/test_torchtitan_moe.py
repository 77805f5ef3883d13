"""torchtitan 0.3's MoE models, shrunk, sharded by torchtitan's own ``ParallelDims`` and the model spec's
parallelize function, on CPU gloo ranks: torch's ``fully_shard`` against ``fc.fully_shard`` swapped in
(docs/integrations.md, "torchtitan"). Two models (``MODELS``), through the same machinery:
- Qwen3 MoE (``debugmodel_moe``): 2 MoE layers, GQA attention; ``parallelize_qwen3`` (``model.parallelize`` for
  expert parallel, then ``apply_fsdp_to_decoder``).
- DeepSeek-V3 (``debugmodel``): 2 layers, the first with a dense feed-forward, the second a MoE with 2 shared
  experts; MLA attention (low-rank query and key-value, ranks 16; query/key heads of 16 + 8 rotary dims, value heads
  of 16; YaRN ``ComplexRoPE``); ``parallelize_deepseekv3`` (``model.parallelize`` for expert parallel, then
  ``apply_fsdp_to_mtp_decoder``, which is ``apply_fsdp_to_decoder`` with any MTP layers put in ``model.layers`` for
  the call; none here: MTP is off in torchtitan's model registry by default, and its list output needs ``MTPLoss``).

What it proves, per setting (both models: FSDP only on 2 ranks; expert parallel ep=2 on 2 and on 4 ranks. Qwen3
only: 2 experts on 4 ranks with ep=2, where torchtitan shards the experts on ``Shard(1)``; 2 experts on 4 ranks
without EP, ``Shard(1)`` through a plain placement): 3 AdamW steps of torchtitan's optimizer container
(``default_adamw``) with its MoE load-balancing hook (``register_moe_load_balancing_hook``, both model specs'
``post_optimizer_build_fn``: an optimizer pre-step hook updating each MoE layer's ``expert_bias_E`` from
``tokens_per_expert_E``) and torchtitan's ``clip_grad_norm_`` (``ep_enabled`` as the trainer passes it) give
fsdp_compose the losses, grad norms and expert biases of torch (rel 1e-5), with no more all-gathers, reduce-scatters
or all-to-alls per step. Under EP, ``apply_fsdp_to_decoder`` gives ``fully_shard`` a ``shard_placement_fn``
returning FSDP2's ``ShardPlacementResult`` (experts on the ``efsdp`` mesh, the rest on ``fsdp``, both split from
torchtitan's one world mesh) and sets explicit forward/backward prefetching (FSDP2 methods, bound by
``fsdp2_methods=True``); the test checks which placement torchtitan asked for, and that the experts' sharded
parameters have torch's mesh, placements and local shape.

Backend: ``spmd_backend="partial_dtensor"``. torchtitan 0.3's default, ``"spmd_types"``, fails with torch 2.13's
own ``fully_shard`` before any step (it passes ``dp_mesh_dims`` with plain-tensor parameters: "When dp_mesh_dims is
provided, all parameters must be DTensors"). ``"full_dtensor"`` (``dp_mesh_dims`` on the full SPMD meshes, and a
``ShardPlacementResult`` whose mesh info carries its own SPMD mesh and dims) runs with both, expert parallel 2 on 2
and 4 ranks, both models: ``test_full_dtensor_expert_parallel`` (torch's numbers equal to its ``partial_dtensor`` run,
fsdp_compose equal to torch's).

Patches, kept apart and counted:
- CPU patches, applied to both implementations (torchtitan targets GPUs): (1) the stub for the Triton kernels module
  of torchtitan's expert-parallel dispatcher (test_torchtitan.py); (2) causal SDPA in place of FlexAttention, whose
  backward does not run on CPU (test_torchtitan.py's, under FlexAttention's own argument names ``q_BLNH``...: under
  expert parallel ``model.parallelize`` wraps it in a local-map region keyed by them);
  (3) ``"cpu"`` for the device of ``ParallelDims``' meshes (its module bound ``device_type``, ``"cuda"`` without an
  accelerator); (4) torch's only: ``set_force_sum_reduction_for_comms(True)``, since gloo has no PREMUL_SUM.
  DeepSeek-V3 needs none more: its MLA calls the same FlexAttention module (patch 2 honours the ``scale`` it passes,
  ``qk_head_dim ** -0.5`` times YaRN's ``mscale ** 2``; SDPA takes value heads narrower than the query/key's).
- fsdp_compose changes (test_torchtitan.py's two): (1) the import of ``fully_shard`` in ``torchtitan.distributed.fsdp``
  (with ``fsdp2_methods=True``); (2) the ``isinstance(module, FSDPModule)`` guard of
  ``disable_fsdp_gradient_division``. torchtitan's two other ``FSDPModule`` checks are not on this path
  (``ChunkedLossWrapper``: the loss here is plain cross-entropy; ``enable_fsdp_symm_mem``: CUDA only).
- Observation only, both implementations: torchtitan's dispatcher bound functional ``all_to_all_single`` at import;
  during the counted forward+backward it looks it up per call, so ``fc.CollectiveRecorder`` sees the forward's
  all-to-alls (3 per MoE layer under EP: token counts, dispatch, combine; those of their backward run inside
  autograd, seen by neither count). ``fully_shard`` is wrapped to record the ``shard_placement_fn`` answers.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compose as fc
from tests.integration.test_torchtitan import _cpu_patches, _fsdp_compose_patches

pytest.importorskip("torchtitan")

STEPS = 3
BATCH, SEQ, VOCAB = 8, 16, 256  # global batch; each data-parallel rank (all ranks: EP borrows them) gets BATCH // ws
DIM, N_LAYERS, HIDDEN, HEAD_DIM = 64, 2, 32, 16
COUNTED = ("all_gather", "reduce_scatter", "all_to_all")


class Setting(NamedTuple):
    world_size: int
    ep: int
    experts: int
    top_k: int
    expert_placement: str  # what torchtitan's shard_placement_fn returns for an expert weight ("" for none called)


SETTINGS = {
    "fsdp-2ranks": Setting(2, 1, 4, 2, ""),
    "ep2-2ranks": Setting(2, 2, 4, 2, "S(0) on ('efsdp',)"),
    "ep2-4ranks": Setting(4, 2, 4, 2, "S(0) on ('efsdp',)"),
    # efsdp (2) x ep (2) > 2 experts: torchtitan shards each rank's one expert on dim 1 over efsdp
    "ep2-4ranks-shard1": Setting(4, 2, 2, 1, "S(1) on ('efsdp',)"),
    # fsdp (4) > 2 experts without EP: Shard(1) as a plain placement on the one mesh
    "fsdp-4ranks-shard1": Setting(4, 1, 2, 1, "S(1)"),
}

_DIMS: dict[tuple[Any, ...], Any] = {}  # torchtitan's ParallelDims and its meshes, for the life of a worker process


def _parallel_dims(ws: int, ep: int, backend: str) -> Any:
    """torchtitan's ``ParallelDims`` (every mesh split from one world mesh), built once per worker: each
    ``build_mesh`` makes new process groups."""
    from torchtitan.distributed import parallel_dims

    key = (ws, ep, backend)
    if key not in _DIMS:
        dims = parallel_dims.ParallelDims(
            dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=ep, world_size=ws, spmd_backend=backend
        )
        original = parallel_dims.device_type
        parallel_dims.device_type = "cpu"  # CPU patch 3
        try:
            dims.build_mesh()
        finally:
            parallel_dims.device_type = original
        _DIMS[key] = dims
    return _DIMS[key]


def _qwen3_config(experts: int, top_k: int) -> Any:
    """torchtitan's ``debugmodel_moe`` (``models/qwen3/__init__.py``), shrunk: 2 layers, dim 64, hidden 32."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import (
        _EMBEDDING_INIT,
        _LINEAR_INIT,
        Qwen3Model,
        _build_qwen3_moe_layers,
        _qwen3_norm,
    )

    return Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=_qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=4,
            n_kv_heads=2,
            head_dim=HEAD_DIM,
            moe_hidden_dim=HIDDEN,
            num_experts=experts,
            top_k=top_k,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1000000.0),
        ),
    )


def _deepseek_v3_config(experts: int, top_k: int) -> Any:
    """torchtitan's DeepSeek-V3 ``debugmodel`` (``models/deepseek_v3/__init__.py``), shrunk: 2 layers (one dense,
    one MoE with 2 shared experts), dim 64, MLA with a low-rank query (rank 16, as the 236B/671B flavors) and
    key-value rank 16, head dims 16 (nope) + 8 (rope) and 16 (value), its YaRN RoPE; no MTP layers (its default)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    rope_dim = 8
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_dsv3_layers(
            n_layers=N_LAYERS,
            n_dense_layers=1,
            dim=DIM,
            n_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=HEAD_DIM,
            qk_rope_head_dim=rope_dim,
            v_head_dim=HEAD_DIM,
            mscale=0.70,
            dense_hidden_dim=2 * DIM,
            moe_hidden_dim=HIDDEN,
            num_experts=experts,
            num_shared_experts=2,
            router_top_k=top_k,
            router_score_func="softmax",
            attn_backend="flex",
            moe_comm_backend="standard",
            non_blocking_capacity_factor=None,
            rope=ComplexRoPE.Config(
                dim=rope_dim,
                max_seq_len=SEQ,
                theta=10000.0,
                scaling="yarn",
                rope_factor=40.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_seq_len=4096,
            ),
        ),
    )


class Model(NamedTuple):
    config: Callable[[int, int], Any]  # (experts, top_k) -> the model's config
    parallelize: str  # the model spec's parallelize_fn, in torchtitan.models.<kind>
    moe_layers: int  # of N_LAYERS
    settings: tuple[str, ...]  # of SETTINGS


MODELS = {
    "qwen3": Model(_qwen3_config, "parallelize_qwen3", N_LAYERS, tuple(SETTINGS)),
    "deepseek_v3": Model(_deepseek_v3_config, "parallelize_deepseekv3", 1, ("fsdp-2ranks", "ep2-2ranks", "ep2-4ranks")),
}


def _cases(*names: str) -> list[Any]:
    """(model kind, setting name) for each model's settings, or those of them in ``names``."""
    return [
        pytest.param(kind, name, id=f"{kind}-{name}")
        for kind, model in MODELS.items()
        for name in model.settings
        if not names or name in names
    ]


@contextlib.contextmanager
def _all_to_all_seen() -> Iterator[None]:
    """Observation only: the dispatcher's ``all_to_all_single`` looked up per call, so a recorder sees it."""
    from torchtitan.models.common import token_dispatcher

    original = token_dispatcher.all_to_all_single
    token_dispatcher.all_to_all_single = lambda *args, **kwargs: funcol.all_to_all_single(*args, **kwargs)
    try:
        yield
    finally:
        token_dispatcher.all_to_all_single = original


def _describe(result: Any) -> str:
    if type(result).__name__ == "ShardPlacementResult":
        return f"{result.placement} on {result.mesh_info.mesh.mesh_dim_names}"
    return str(result)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _moe_layers(model: nn.Module) -> list[nn.Module]:
    """The blocks with a MoE (DeepSeek-V3's first ones have a dense feed-forward), as torchtitan's hook finds them."""
    return [layer for layer in model.layers.values() if getattr(layer, "moe_enabled", False)]


def _expert_layout(model: nn.Module) -> list[tuple[Any, ...]]:
    """Mesh, placements and local shape of each MoE layer's expert weights after sharding."""
    layout = []
    for layer in _moe_layers(model):
        for name, param in layer.moe.routed_experts.inner_experts.named_parameters():
            placements = tuple(str(p) for p in param.placements) if hasattr(param, "placements") else ()
            mesh = param.device_mesh.mesh_dim_names if hasattr(param, "device_mesh") else None
            layout.append((name, mesh, placements, tuple(getattr(param, "_local_tensor", param).shape)))
    return layout


def _parallelize(model: nn.Module, kind: str, variant: str, dims: Any, parallelism: Any, placements: set[str]) -> None:
    """``kind``'s parallelize function (``parallelize_qwen3``, ``parallelize_deepseekv3``), with ``variant``'s
    ``fully_shard`` in ``torchtitan.distributed.fsdp``."""
    import importlib

    import torchtitan.distributed.fsdp as fsdp_module
    from torchtitan.config import CompileConfig, TrainingConfig

    parallelize = getattr(importlib.import_module(f"torchtitan.models.{kind}"), MODELS[kind].parallelize)

    original = (fsdp_module.fully_shard, fsdp_module.disable_fsdp_gradient_division)
    try:
        if variant == "fc":
            _fsdp_compose_patches(fsdp_module, guard=True)
        shard = fsdp_module.fully_shard

        def recording(module: Any, **kwargs: Any) -> Any:  # observation only
            fn = kwargs.get("shard_placement_fn")
            if fn is not None:

                def observed(param: nn.Parameter) -> Any:
                    result = fn(param)
                    placements.add(_describe(result))
                    return result

                kwargs["shard_placement_fn"] = observed
            return shard(module, **kwargs)

        fsdp_module.fully_shard = recording
        parallelize(
            model,
            parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param="float32", seq_len=SEQ),
            parallelism=parallelism,
            compile_config=CompileConfig(),
            ac_config=None,
            dump_folder="",
        )
        if variant == "torch":  # CPU patch 4
            for module in model.modules():
                if isinstance(module, fsdp_module.FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
    finally:
        fsdp_module.fully_shard, fsdp_module.disable_fsdp_gradient_division = original


def _train(rank: int, ws: int, variant: str, kind: str, setting: Setting, backend: str) -> dict[str, Any]:
    _cpu_patches()
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.optimizer import default_adamw, register_moe_load_balancing_hook
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(expert_parallel_degree=setting.ep, spmd_backend=backend)
    config = MODELS[kind].config(setting.experts, setting.top_k)
    config.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))  # the sharding configs
    dims = _parallel_dims(ws, setting.ep, backend)
    placements: set[str] = set()
    backend_before = dist_utils.get_spmd_backend()
    dist_utils.set_spmd_backend(backend)  # as the trainer does: the dispatcher reads it per call
    try:
        torch.manual_seed(0)
        model = config.build()
        model.init_states()
        _parallelize(model, kind, variant, dims, parallelism, placements)
        layout = _expert_layout(model)
        optimizers = default_adamw(lr=1e-3).build(model_parts=[model])
        register_moe_load_balancing_hook(optimizers, [model], dims)  # the model spec's post_optimizer_build_fn
        losses, norms, counts, biases = [], [], [], []
        positions = torch.arange(SEQ).repeat(BATCH // ws, 1)
        for step in range(STEPS):
            optimizers.zero_grad()
            gen = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).chunk(ws)[rank]
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            kwargs: dict[str, Any] = {"positions": positions}
            if backend == "full_dtensor":  # as the trainer's post_dataloading_process
                from torchtitan.distributed import full_dtensor

                inputs, _, kwargs = full_dtensor.parallelize_inputs(dims, inputs, labels, kwargs)
            with _all_to_all_seen(), fc.CollectiveRecorder() as recorder:
                logits = model(inputs, **kwargs)
                if hasattr(logits, "to_local"):
                    logits = logits.to_local()
                # torchtitan's loss: local sum over tokens / global token count; the gradient reduction sums
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (BATCH * SEQ)
                loss.backward()
            counts.append({kind: recorder.counts()[kind] for kind in COUNTED})
            norm = dist_utils.clip_grad_norm_(
                list(model.parameters()), 1.0, foreach=True, pp_mesh=None, ep_enabled=dims.ep_enabled
            )
            norms.append(float(_full(norm)))
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
            optimizers.step()  # the load-balancing hook runs first
            biases.append([_full(layer.moe.expert_bias_E).tolist() for layer in _moe_layers(model)])
    finally:
        dist_utils.set_spmd_backend(backend_before)
    return {
        "loss": losses,
        "grad_norm": norms,
        "counts": counts,
        "bias": biases,
        "placements": sorted(placements),
        "experts": layout,
    }


def _check(torch_run: dict[str, Any], fc_run: dict[str, Any]) -> None:
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
    assert fc_run["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-5)
    for fc_biases, torch_biases in zip(fc_run["bias"], torch_run["bias"], strict=True):
        for fc_bias, torch_bias in zip(fc_biases, torch_biases, strict=True):
            assert fc_bias == pytest.approx(torch_bias, rel=1e-5, abs=1e-9)
    for fc_counts, torch_counts in zip(fc_run["counts"], torch_run["counts"], strict=True):
        for kind in COUNTED:
            assert fc_counts[kind] <= torch_counts[kind], (kind, fc_run["counts"], torch_run["counts"])
    assert fc_run["placements"] == torch_run["placements"]
    assert fc_run["experts"] == torch_run["experts"]


@pytest.mark.parametrize(("kind", "name"), _cases())
def test_moe_matches_torch_fully_shard(run_dist, kind: str, name: str) -> None:
    setting = SETTINGS[name]
    torch_run = run_dist(setting.world_size, _train, "torch", kind, setting, "partial_dtensor")[0]
    fc_run = run_dist(setting.world_size, _train, "fc", kind, setting, "partial_dtensor")[0]
    _check(torch_run, fc_run)
    if setting.expert_placement:
        assert setting.expert_placement in torch_run["placements"], torch_run["placements"]
    else:
        assert torch_run["placements"] == []
    assert len(fc_run["bias"][0]) == MODELS[kind].moe_layers
    assert any(bias != 0.0 for biases in fc_run["bias"] for layer in biases for bias in layer)  # the hook ran
    if setting.ep > 1:
        assert all(counts["all_to_all"] == 3 * MODELS[kind].moe_layers for counts in fc_run["counts"])


@pytest.mark.parametrize(("kind", "name"), _cases("ep2-2ranks", "ep2-4ranks"))
def test_full_dtensor_expert_parallel(run_dist, kind: str, name: str) -> None:
    """torchtitan's ``full_dtensor`` backend: ``dp_mesh_dims`` (the full SPMD meshes) and a ``ShardPlacementResult``
    per parameter whose mesh info carries its own SPMD mesh and dims."""
    setting = SETTINGS[name]
    torch_run = run_dist(setting.world_size, _train, "torch", kind, setting, "full_dtensor")[0]
    partial = run_dist(setting.world_size, _train, "torch", kind, setting, "partial_dtensor")[0]
    assert torch_run["loss"] == pytest.approx(partial["loss"], rel=1e-5)  # torch's: the same training either way
    assert torch_run["grad_norm"] == pytest.approx(partial["grad_norm"], rel=1e-5)
    fc_run = run_dist(setting.world_size, _train, "fc", kind, setting, "full_dtensor")[0]
    _check(torch_run, fc_run)
