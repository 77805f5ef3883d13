"""Run under ``torchrun --nproc_per_node 2`` in a folder holding ``tests/assets/{tokenizer,c4_test}``: torchtitan
0.3's real trainer (``torchtitan.train.main``, unchanged: its config, model, parallelize function, chunked loss and
loop) on CPU gloo ranks. ``argv[1]`` picks the FSDP implementation; the remaining arguments go to torchtitan.

Variants: ``torch`` (torch's ``fully_shard``), ``fc`` (the documented port, docs/integrations.md "torchtitan"), and
``fc_skip_<line>`` (the port without one of its lines, to measure what that line does).

The port is applied as a source patch: the import hook below loads ``torchtitan.distributed.fsdp`` and
``torchtitan.components.loss`` with the port's lines replaced, each old text required to occur exactly once, so the
modules run as if the files had been edited. The four CPU patches torchtitan needs for any FSDP implementation
(``../shared/data/torchtitan-assets/README.md``) are applied in-process to both implementations.

Observation only, no change of behaviour: the trainer's ``train_step`` runs under a collective counter, its
``MetricsProcessor.log`` is recorded (global loss and grad norm), and ``Trainer.close`` gathers every rank's record
(and the chunked loss's chunk count) to rank 0, which prints one ``RESULT`` JSON line.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_compose as fc
from tests.integration.counting import totals

# The documented port (docs/integrations.md, "torchtitan"), by module and line: the (old text, new text) edits.
PORT: dict[str, dict[str, list[tuple[str, str]]]] = {
    "torchtitan.distributed.fsdp": {
        "import": [
            (
                "    fully_shard,\n    MixedPrecisionPolicy,\n)\n",
                "    MixedPrecisionPolicy,\n)\nimport functools\nimport fsdp_compose as fc\n"
                "fully_shard = functools.partial(fc.fully_shard, fsdp2_methods=True)\n",
            )
        ],
        "division_guard": [
            (
                "        if isinstance(module, FSDPModule):\n            module.set_gradient_divide_factor(1.0)\n",
                "        if isinstance(module, FSDPModule) or fc.has_fsdp2_methods(module):\n"
                "            module.set_gradient_divide_factor(1.0)\n",
            )
        ],
        "symm_mem_guard": [
            (
                "        if isinstance(module, FSDPModule):\n"
                "            module.set_force_sum_reduction_for_comms(True)\n",
                "        if isinstance(module, FSDPModule) or fc.has_fsdp2_methods(module):\n"
                "            module.set_force_sum_reduction_for_comms(True)\n",
            )
        ],
    },
    "torchtitan.components.loss": {
        "chunked_loss_guard": [
            (
                "        from torch.distributed._composable.fsdp import FSDPModule\n",
                "        from torch.distributed._composable.fsdp import FSDPModule\n"
                "        import fsdp_compose as fc\n",
            ),
            (
                "        fsdp_enabled = isinstance(lm_head, FSDPModule)\n",
                "        fsdp_enabled = isinstance(lm_head, FSDPModule) or fc.has_fsdp2_methods(lm_head)\n",
            ),
        ],
    },
}


class _PatchedSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Loads the named modules from their files with text replacements applied (each old text exactly once)."""

    def __init__(self, patches: dict[str, list[tuple[str, str]]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if name not in self.patches:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        assert spec is not None and spec.origin is not None, name
        return importlib.util.spec_from_file_location(name, spec.origin, loader=self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        assert module.__spec__ is not None and module.__spec__.origin is not None
        origin = module.__spec__.origin
        with open(origin) as f:
            source = f.read()
        for old, new in self.patches[module.__name__]:
            if source.count(old) != 1:
                raise RuntimeError(f"port line not found exactly once in {origin}: {old!r}")
            source = source.replace(old, new)
        exec(compile(source, origin, "exec"), module.__dict__)


def install_port(skip: str | None) -> list[str]:
    """Installs the port (without the line named ``skip``); returns the names of the lines applied."""
    if skip is not None and not any(skip in lines for lines in PORT.values()):
        raise ValueError(f"no port line named {skip!r}")
    patches = {
        module: [e for name, edits in lines.items() if name != skip for e in edits] for module, lines in PORT.items()
    }
    assert not any(module in sys.modules for module in patches), "install the port before importing torchtitan"
    sys.meta_path.insert(0, _PatchedSource(patches))
    return [name for lines in PORT.values() for name in lines if name != skip]


class _CpuDeviceModule(types.ModuleType):
    """``torch.cpu`` with the memory-statistics functions torchtitan's metrics call on a device module."""

    def __init__(self) -> None:
        super().__init__("torchtitan_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, device: Any = None) -> str:
        return "cpu"

    def get_device_properties(self, device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=1)

    def memory_stats(self, device: Any = None) -> dict[str, int]:
        return {}

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        return None

    def empty_cache(self) -> None:
        return None


def _flex_as_dense_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    score_mod: Any,
    block_mask: Any,
    scale: float | None,
    enable_gqa: bool,
    return_aux: Any,
    kernel_options: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """FlexAttention's math with the block mask evaluated densely: SDPA (FlexAttention has no CPU backward)."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None and not return_aux.lse, "CPU patch: only mask_mod attention"
    batch, heads, q_len, kv_len = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = create_mask(block_mask.mask_mod, batch, heads, q_len, kv_len, device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, AuxOutput()


def apply_cpu_patches() -> None:
    """The four CPU patches (torchtitan-assets/README.md); must run before the rest of torchtitan is imported."""
    kernels = "torchtitan.distributed.minimal_async_ep.kernels"  # 0: imports triton, absent from a CPU install
    stub = types.ModuleType(kernels)
    stub.__getattr__ = lambda name: None  # type: ignore[method-assign]
    sys.modules.setdefault(kernels, stub)
    import torchtitan.tools.utils as utils

    for name in ("torchtitan.components.metrics", "torchtitan.distributed.utils", "torchtitan.trainer"):
        assert name not in sys.modules, f"{name} imported before the CPU patch"
    utils.device_type, utils.device_module = "cpu", _CpuDeviceModule()  # 1: the device (no "cuda" fallback)
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(_flex_as_dense_sdpa)  # type: ignore[assignment]  # 2
    dist_utils.set_pg_timeouts = lambda *args, **kwargs: None  # 3: the CPU build has no dist.set_timeout


def force_sum_reduction_for_torch() -> None:
    """CPU patch 4 (torch's ``fully_shard`` only): gloo rejects the PREMUL_SUM of ``set_gradient_divide_factor``."""
    import torchtitan.distributed.fsdp as fsdp

    original = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model: torch.nn.Module) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def observe(records: list[dict[str, Any]]) -> None:
    """Records each step's collectives (train_step under a counter) and the trainer's logged loss and grad norm;
    ``Trainer.close`` sends every rank's records to rank 0, which prints them."""
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer

    train_step, log, close = Trainer.train_step, MetricsProcessor.log, Trainer.close

    def counted_train_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        with fc.CollectiveRecorder() as counter:
            out = train_step(self, *args, **kwargs)
        records.append({"collectives": totals(counter)})
        return out

    def recorded_log(self: Any, step: int, loss: float, max_loss: float, grad_norm: float, *a: Any, **k: Any) -> Any:
        records.append({"step": step, "loss": loss, "grad_norm": grad_norm})
        return log(self, step, loss, max_loss, grad_norm, *a, **k)

    def gathering_close(self: Any) -> None:
        records.append({"loss_chunks": getattr(self.loss_fn, "num_chunks", None)})
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, records)
        if dist.get_rank() == 0:
            sys.stdout.write("RESULT " + json.dumps(gathered) + "\n")
            sys.stdout.flush()
        close(self)

    Trainer.train_step, MetricsProcessor.log, Trainer.close = (  # type: ignore[method-assign]
        counted_train_step,
        recorded_log,
        gathering_close,
    )


def main() -> None:
    variant, torchtitan_args = sys.argv[1], sys.argv[2:]
    if variant != "torch":
        skip = variant.removeprefix("fc_skip_") if variant.startswith("fc_skip_") else None
        assert variant == "fc" or skip, variant
        applied = install_port(skip)
        sys.stderr.write(f"fsdp_compose port lines applied: {applied}\n")
    apply_cpu_patches()
    if variant == "torch":
        force_sum_reduction_for_torch()
    records: list[dict[str, Any]] = []
    observe(records)
    import torchtitan.train

    sys.argv = ["torchtitan.train", *torchtitan_args]
    torchtitan.train.main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
