"""A sharded model and its optimizers off the accelerator between phases, and back: ``fc.move_to_host`` and
``fc.move_to_device``.

An RL loop hands the accelerator to an inference engine between training steps. Rebinding ``param.data`` to a CPU
tensor (what RL stacks do by hand) breaks the views a unit's flat shard storage is made of and the optimizer's
references. Here the tensors stay the same objects: every storage the model and the optimizers hold (the unit's flat
shards, which the parameters view, kept-whole parameters, gradients, held accumulation buffers, buffers, optimizer
state) is copied into host memory (pinned where the device is an accelerator) and then resized to zero bytes on the
device, as the units free full parameters; moving back resizes each storage and copies the bytes back. Bit-exact,
and what held a parameter or its optimizer state (an optimizer, a learning-rate scheduler, a hook) still does.

While moved, each unit of the model refuses a forward with an error naming ``fc.move_to_device``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .state import check_between_steps, states_under

if TYPE_CHECKING:
    from .state import ShardState

__all__ = ["HostCopies", "move_to_device", "move_to_host"]


@dataclass
class HostCopies:
    """The storages a ``move_to_host`` emptied on the device, each with its bytes in host memory."""

    storages: list[tuple[torch.UntypedStorage, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(host.numel() for _, host in self.storages)


def move_to_host(module: nn.Module, *optimizers: torch.optim.Optimizer) -> HostCopies:
    """Move every storage of the sharded ``module`` and of ``optimizers`` to host memory, leaving zero bytes of them
    on the device; the tensors stay the same objects. Between steps only (a unit gathered by ``fc.unshard`` or kept
    after forward is resharded first); ``fc.move_to_device`` with the same optimizers brings them back."""
    states = _between_steps(module, "move_to_host")
    for index, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"fc.move_to_host: optimizers[{index}] must be a torch.optim.Optimizer, got {optimizer!r}")
    if any(state.host is not None for state in states):
        raise RuntimeError(f"fc.move_to_host: this {type(module).__name__} is on the host already")
    for state in states:
        state.params.reshard()
    tensors = _tensors_of(module, states, optimizers)
    seen: set[int] = set()
    moving: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type != "cpu")
        host.copy_(_bytes_of(storage), non_blocking=True)
        moving.append((storage, host))
    _synchronize(moving)
    for storage, _ in moving:
        storage.resize_(0)
    copies = HostCopies(moving)
    for state in states:
        state.host = copies
    return copies


def move_to_device(module: nn.Module) -> None:
    """Bring back what ``fc.move_to_host`` moved (the model's storages and its optimizers'), bit-exact, into the same
    tensors."""
    states = _between_steps(module, "move_to_device")
    copies = states[0].host
    if copies is None or any(state.host is not copies for state in states):
        raise RuntimeError(
            f"fc.move_to_device: this {type(module).__name__} is not on the host (fc.move_to_host moves it there)"
        )
    for storage, host in copies.storages:
        storage.resize_(host.numel())
        _bytes_of(storage).copy_(host, non_blocking=True)
    _synchronize(copies.storages)  # the pinned host buffers go once the copies are done
    for state in states:
        state.host = None


def _between_steps(module: nn.Module, function: str) -> list[ShardState]:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fc.{function}: expected an nn.Module, got {type(module).__name__}")
    states = states_under(module)
    if not states:
        raise ValueError(f"fc.{function}: no module under this {type(module).__name__} is sharded")
    check_between_steps(states, f"fc.{function}")
    return states


def _tensors_of(
    module: nn.Module, states: list[ShardState], optimizers: tuple[torch.optim.Optimizer, ...]
) -> list[torch.Tensor]:
    """Every tensor whose storage belongs to the model or the optimizers (their storages are what moves)."""
    found: list[torch.Tensor] = []
    for state in states:
        if state.params.shards.protocol:
            raise NotImplementedError(
                f"fc.move_to_host: unit {state.params.owner_name} has parameters using FSDP2's all-gather hooks "
                f"({state.params.shards.protocol[0].fqn}): their storage is the tensor subclass's own"
            )
        found += state.grads.held_tensors()
    for tensor in [*module.parameters(), *module.buffers()]:
        found.append(tensor)
        if tensor.grad is not None:
            found.append(tensor.grad)
    for optimizer in optimizers:
        for per_param in optimizer.state.values():
            found += [value for value in per_param.values() if isinstance(value, torch.Tensor)]
    return [t.to_local() if isinstance(t, DTensor) else t for t in found]


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _synchronize(moving: list[tuple[torch.UntypedStorage, torch.Tensor]]) -> None:
    devices = {storage.device for storage, _ in moving if storage.device.type != "cpu"}
    for device in devices:
        torch.accelerator.synchronize(device)
