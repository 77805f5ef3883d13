"""torchtitan 0.3's llama3 debug model sharded by torchtitan's own ``apply_fsdp_to_decoder``, on 2 CPU gloo ranks:
torch's ``fully_shard`` against ``fc.fully_shard`` swapped in (docs/integrations.md, "torchtitan").

Patches, kept apart and counted:
- CPU patches, applied to both implementations (torchtitan targets GPUs): (1) a stub for the Triton kernels module
  of torchtitan's expert-parallel dispatcher, imported at model import; (2) causal SDPA in place of FlexAttention,
  whose backward does not run on CPU; (3) torch's only: ``set_force_sum_reduction_for_comms(True)``, since gloo has
  no PREMUL_SUM, which FSDP2's divide factor uses (fsdp_compose always sums and divides locally).
- fsdp_compose changes: (1) the import of ``fully_shard`` in ``torchtitan.distributed.fsdp`` (with
  ``fsdp2_methods=True``); (2) the ``isinstance(module, FSDPModule)`` guard of ``disable_fsdp_gradient_division``
  (``or fc.has_fsdp2_methods(module)``). Without (2) the guard silently skips ``set_gradient_divide_factor(1.0)``:
  gradients are averaged instead of summed, and the grad norm is exactly halved; the test shows both.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compose as fc
from tests.dist_utils import mesh_nd

pytest.importorskip("torchtitan")

STEPS = 3
BATCH, SEQ, VOCAB = 4, 32, 2048


def _cpu_patches() -> Any:
    """The two CPU patches (both implementations); returns torchtitan's llama3 package."""
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"
    if kernels not in sys.modules:  # CPU patch 1: the module imports triton, absent on CPU
        stub = types.ModuleType(kernels)
        stub.__getattr__ = lambda name: None  # type: ignore[method-assign]
        sys.modules[kernels] = stub
    from torchtitan.models.common import attention

    # FlexAttention's own argument names: expert parallel wraps it in a local-map region keyed by them
    def sdpa(
        self: Any, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q_BLNH.transpose(1, 2),
            k_BLNH.transpose(1, 2),
            v_BLNH.transpose(1, 2),
            is_causal=True,
            scale=kwargs.get("scale"),
            enable_gqa=kwargs.get("enable_gqa", False),
        )
        return out.transpose(1, 2)

    attention.FlexAttention.forward = sdpa  # CPU patch 2: FlexAttention has no CPU backward
    import torchtitan.models.llama3 as llama3

    return llama3


def _fsdp_compose_patches(fsdp_module: Any, guard: bool) -> None:
    """The fsdp_compose changes to torchtitan/distributed/fsdp.py (docs/integrations.md shows them as a diff)."""
    fsdp_module.fully_shard = functools.partial(fc.fully_shard, fsdp2_methods=True)  # change 1: the import
    if guard:

        def disable_fsdp_gradient_division(model: nn.Module) -> None:  # change 2: the guard
            for module in model.modules():
                if isinstance(module, fsdp_module.FSDPModule) or fc.has_fsdp2_methods(module):
                    module.set_gradient_divide_factor(1.0)

        fsdp_module.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _train(rank: int, ws: int, variant: str) -> dict[str, Any]:
    llama3 = _cpu_patches()
    import torchtitan.distributed.fsdp as fsdp_module

    original = (fsdp_module.fully_shard, fsdp_module.disable_fsdp_gradient_division)
    try:
        if variant != "torch":
            _fsdp_compose_patches(fsdp_module, guard=variant == "fc")
        torch.manual_seed(0)
        model = llama3._debugmodel("flex").build()
        model.init_states()
        mesh = mesh_nd((ws,), ("fsdp",))
        fsdp_module.apply_fsdp_to_decoder(
            model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
        )
        fsdp_module.disable_fsdp_gradient_division(model)  # torchtitan scales by the global token count itself
        if variant == "torch":  # CPU patch 3 (torch only): gloo has no PREMUL_SUM, which the divide factor uses
            for module in model.modules():
                if isinstance(module, fsdp_module.FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)
    finally:
        fsdp_module.fully_shard, fsdp_module.disable_fsdp_gradient_division = original
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms, reduce_scatters = [], [], []
    positions = torch.arange(SEQ).repeat(BATCH // ws, 1)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen).chunk(ws)[rank]
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with fc.CollectiveRecorder() as counter:
            logits = model(inputs, positions=positions)
            # torchtitan's loss: local sum over tokens / global token count; the gradient reduction sums
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / (BATCH * SEQ)
            loss.backward()
        reduce_scatters.append(counter.counts()["reduce_scatter"])
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
    return {"loss": losses, "grad_norm": norms, "reduce_scatters": reduce_scatters}


def test_llama3_debug_model_matches_torch_fully_shard(run_dist) -> None:
    torch_run = run_dist(2, _train, "torch")[0]
    fc_run = run_dist(2, _train, "fc")[0]
    unguarded = run_dist(2, _train, "fc_without_guard_patch")[0]
    assert fc_run["loss"] == pytest.approx(torch_run["loss"], rel=1e-5)
    assert fc_run["grad_norm"] == pytest.approx(torch_run["grad_norm"], rel=1e-5)
    assert fc_run["reduce_scatters"] == torch_run["reduce_scatters"]
    # The silent difference the guard patch removes: averaged instead of summed, grad norm exactly halved.
    assert unguarded["grad_norm"][0] == pytest.approx(torch_run["grad_norm"][0] / 2, rel=1e-5)
