"""``fc.ported(...)``: the documented port of a named trainer, applied for the duration of a ``with`` block.

docs/integrations.md lists, per trainer, the lines of the trainer's own source that must change for it to run on
fsdp_compose: where it calls torch's ``fully_shard`` and where an ``isinstance(m, FSDPModule)`` guard would skip a
call. ``with fc.ported("accelerate"):`` makes exactly those changes in memory, as attribute replacements on the
trainer's (and torch's) modules, and undoes them on exit, in reverse order, also when the block raises. Nothing is
left behind: after the block every replaced attribute is the original object again.

While the block runs the replacements are visible to every thread of the process (they are module attributes);
entering a port whose attributes are already replaced by an enclosing ``ported`` block is refused rather than
stacked. Each replacement keeps the trainer's behaviour for modules fsdp_compose did not shard.

Ports (each tested through the trainer's own entry point in tests/integration/):

- ``"accelerate"``: ``torch.distributed.fsdp.fully_shard`` (imported by accelerate's ``fsdp2_prepare_model`` when it
  runs) is ``fc.fully_shard(..., fsdp2_methods=True)``; ``fsdp2_prepare_model`` returns a model fsdp_compose already
  sharded unchanged (its "already sharded" guard, ``isinstance(model, FSDPModule)``).
- ``"transformers"``: the accelerate port (the ``Trainer`` prepares through it with ``fsdp_version: 2``), plus
  ``torch.distributed.fsdp.register_fsdp_forward_method``, which the ``Trainer`` calls for ``generate`` and which is a
  no-op for a module that is not a torch ``FSDPModule``, calls ``fc.register_forward_method`` for a sharded one; and
  the ``fully_shard`` name ``transformers.distributed.fsdp`` imported from torch, so ``from_pretrained(...,
  distributed_config=DistributedConfig(...))`` shards with fsdp_compose.
  (The ``Trainer``'s ``is_fsdp_managed_module`` needs nothing: it reads the attribute ``fully_shard`` sets.)
- ``"lightning"``: ``_FSDPNoSync._set_requires_grad_sync`` (Fabric's ``no_backward_sync``) also sets
  ``requires_gradient_sync`` on fsdp_compose's units.
- ``"olmo_core"`` (AI2's OLMo-core 3.0): the ``fully_shard`` name bound in ``olmo_core.nn.transformer.model``
  (``Transformer.apply_fsdp``: embeddings, LM head, root) and ``olmo_core.nn.transformer.block`` (each block's
  ``apply_fsdp``) is ``fc.fully_shard(..., fsdp2_methods=True)``; the ``FSDPModule`` name those guards read in
  ``olmo_core.nn.transformer.model`` (``apply_fsdp``'s LM-head prefetch) and
  ``olmo_core.train.train_module.transformer.train_module`` (``_train_microbatch_context``: ``set_is_last_backward``
  and, for HSDP, the all-reduce deferred to the last micro-batch) also recognises a module fsdp_compose sharded.
  MoE experts (``olmo_core.nn.moe``) and pipeline stages keep torch's ``fully_shard``: not ported.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import api
from ..init import fully_shard as _fully_shard
from ..state import states_under
from . import fsdp2

__all__ = ["PORTS", "ported"]


# ---------------------------------------------------------------------- the replacements
def _fully_shard_with_methods(*args: Any, **kwargs: Any) -> Any:
    """torch's ``fully_shard`` name inside a port: fsdp_compose's, with FSDP2's methods bound (trainers call them)."""
    kwargs.setdefault("fsdp2_methods", True)
    return _fully_shard(*args, **kwargs)


_fully_shard_with_methods.__fsdp_compose_port__ = True  # type: ignore[attr-defined]


def _sharded_by_fsdp_compose(module: Any) -> bool:
    if not isinstance(module, nn.Module):
        return False
    inner = getattr(module, "_orig_mod", None)  # torch.compile's wrapper, as accelerate's own guard unwraps it
    return api.is_fully_sharded(module) or (isinstance(inner, nn.Module) and api.is_fully_sharded(inner))


def _prepare_model(original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    @functools.wraps(original)
    def fsdp2_prepare_model(accelerator: Any, model: nn.Module) -> nn.Module:
        if _sharded_by_fsdp_compose(model):  # accelerate: `isinstance(model, FSDPModule)` -> return model
            return model
        return original(accelerator, model)

    return fsdp2_prepare_model


def _register_forward_method(original: Callable[[nn.Module, str], None]) -> Callable[[nn.Module, str], None]:
    @functools.wraps(original)
    def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
        if not isinstance(module, FSDPModule) and api.is_fully_sharded(module):
            api.register_forward_method(module, method_name)
        else:
            original(module, method_name)

    return register_fsdp_forward_method


class _FSDPModuleGuardMeta(type):
    """``isinstance(m, <the class>)`` is torch's ``isinstance(m, FSDPModule)`` or fsdp_compose's FSDP2-methods check."""

    _torch_class: type

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, cls._torch_class) or fsdp2.has_fsdp2_methods(instance)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, cls._torch_class)


def _fsdp_module_guard(original: type) -> type:
    """The ``FSDPModule`` name in a module whose ``isinstance(m, FSDPModule)`` guards precede FSDP2 method calls:
    OLMo-core reads it only in such guards and in ``typing.cast`` (a no-op at runtime), so replacing the name is the
    one-line guard edit ``isinstance(m, FSDPModule) or fc.has_fsdp2_methods(m)`` for every guard of that module."""
    return _FSDPModuleGuardMeta(original.__name__, (), {"_torch_class": original, "__module__": original.__module__})


def _lightning_no_sync(original: Callable[[Any, bool], None]) -> Callable[[Any, bool], None]:
    @functools.wraps(original)
    def _set_requires_grad_sync(self: Any, requires_grad_sync: bool) -> None:
        original(self, requires_grad_sync)  # torch's FSDPModules under the module
        for state in states_under(self._module):  # and fsdp_compose's units, each on its own (recurse=False)
            api.set_requires_gradient_sync(state.modules[0], requires_grad_sync, recurse=False)
            api.set_requires_all_reduce(state.modules[0], requires_grad_sync, recurse=False)

    return _set_requires_grad_sync


# (module, attribute path, make the replacement from the original). The module is imported when the port is entered.
_Patch = tuple[str, str, Callable[[Any], Any]]

_ACCELERATE: tuple[_Patch, ...] = (
    ("torch.distributed.fsdp", "fully_shard", lambda original: _fully_shard_with_methods),
    ("accelerate.accelerator", "fsdp2_prepare_model", _prepare_model),
)

PORTS: dict[str, tuple[_Patch, ...]] = {
    "accelerate": _ACCELERATE,
    "transformers": (
        *_ACCELERATE,
        ("torch.distributed.fsdp", "register_fsdp_forward_method", _register_forward_method),
        # transformers' own FSDP2 (from_pretrained(..., distributed_config=...)) bound torch's name at its import
        ("transformers.distributed.fsdp", "fully_shard", lambda original: _fully_shard_with_methods),
    ),
    "lightning": (
        ("lightning.fabric.strategies.model_parallel", "_FSDPNoSync._set_requires_grad_sync", _lightning_no_sync),
    ),
    # Each OLMo-core module imported its names from torch at import time (`from torch.distributed.fsdp import ...`):
    # the port replaces those module globals, not torch's.
    "olmo_core": (
        ("olmo_core.nn.transformer.model", "fully_shard", lambda original: _fully_shard_with_methods),
        ("olmo_core.nn.transformer.block", "fully_shard", lambda original: _fully_shard_with_methods),
        ("olmo_core.nn.transformer.model", "FSDPModule", _fsdp_module_guard),
        ("olmo_core.train.train_module.transformer.train_module", "FSDPModule", _fsdp_module_guard),
    ),
}


def _owner(module_name: str, path: str) -> tuple[Any, str]:
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner, name


@contextlib.contextmanager
def ported(*trainers: str) -> Iterator[None]:
    """Apply the documented port of each named trainer (``"accelerate"``, ``"transformers"``, ``"lightning"``,
    ``"olmo_core"``) for the duration of the block; every replaced attribute is restored on exit (see the module
    docstring)::

        with fc.ported("transformers"):
            trainer.train()        # Trainer(..., fsdp="full_shard", fsdp_config={"fsdp_version": 2})
        model.generate(...)        # registered by the Trainer through the port; stays registered (per instance)
    """
    unknown = [name for name in trainers if name not in PORTS]
    if not trainers or unknown:
        raise ValueError(f"fc.ported: expected one or more of {sorted(PORTS)}, got {list(trainers)!r}")
    patches: list[_Patch] = []
    for name in dict.fromkeys(trainers):
        patches += [patch for patch in PORTS[name] if patch[:2] not in {p[:2] for p in patches}]
    # Resolve everything (imports, originals) before replacing anything: a missing package fails with no change.
    resolved = []
    for module_name, path, make in patches:
        owner, name = _owner(module_name, path)
        original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        if getattr(original, "__fsdp_compose_port__", False):
            raise RuntimeError(f"fc.ported: {module_name}.{path} is already replaced by an enclosing fc.ported block")
        replacement = make(original)
        if replacement is not _fully_shard_with_methods:
            replacement.__fsdp_compose_port__ = True
        resolved.append((owner, name, original, replacement))
    applied = []
    try:
        for owner, name, original, replacement in resolved:
            setattr(owner, name, replacement)
            applied.append((owner, name, original))
        yield
    finally:
        for owner, name, original in reversed(applied):
            setattr(owner, name, original)
