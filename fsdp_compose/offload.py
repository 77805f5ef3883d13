"""Where one unit computes and where its shards live, and the only places data crosses between the two.

Without offload both are the mesh's device and every helper here is a no-op. Under ``CPUOffloadPolicy`` the unit's
``flat`` buffer (and so the sharded parameters, which are views into it), its kept-whole parameters and its sharded
gradients live in host memory, where the optimizer steps. Data crosses in exactly two directions::

    to_compute / copy_to_compute   host -> device, before the all-gather (and for kept-whole parameters)
    to_shard / to_host             device -> host, after the reduce-scatter (asynchronous, then an event)

Every transfer of a unit goes through these helpers, so what moves where is visible in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .policies import CPUOffloadPolicy, OffloadPolicy

__all__ = ["UnitDevices", "check_offload_policy", "collective_device"]


def collective_device(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor``'s collectives run: a DTensor's mesh device (its local shard is in host memory under CPU
    offload), or a plain tensor's own device."""
    return torch.device(tensor.device_mesh.device_type) if isinstance(tensor, DTensor) else tensor.device


def check_offload_policy(offload_policy: object, mesh: DeviceMesh, owner_name: str) -> None:
    """Raise a clear error for an offload policy this unit cannot use (before anything is touched)."""
    if not isinstance(offload_policy, OffloadPolicy):  # torch's policies were converted by policies.as_offload_policy
        raise TypeError(
            f"offload_policy of fully_shard on {owner_name} must be an fsdp_compose.OffloadPolicy or "
            f"CPUOffloadPolicy, got {type(offload_policy).__module__}.{type(offload_policy).__name__}"
        )
    if not isinstance(offload_policy, CPUOffloadPolicy):
        return
    if not isinstance(offload_policy.pin_memory, bool):
        raise TypeError(
            f"CPUOffloadPolicy.pin_memory of fully_shard on {owner_name} must be a bool, "
            f"got {offload_policy.pin_memory!r}"
        )
    if mesh.device_type == "meta":
        raise ValueError(
            f"fully_shard on {owner_name} with CPUOffloadPolicy needs a mesh on a real device to compute on, got a "
            "'meta' mesh; build the mesh on the compute device (e.g. init_device_mesh(\"cuda\", ...)) — parameters "
            "may still be on meta"
        )


@dataclass(frozen=True)
class UnitDevices:
    """The compute device (the mesh's) and the device shards and sharded gradients live on."""

    compute: torch.device
    shard: torch.device
    offloaded: bool
    pin_memory: bool  # page-locked host memory: faster transfers, and host -> device copies can run asynchronously

    @classmethod
    def of(cls, policy: OffloadPolicy, compute: torch.device) -> UnitDevices:
        if not isinstance(policy, CPUOffloadPolicy):
            return cls(compute, compute, offloaded=False, pin_memory=False)
        # Page-locking is a service of an accelerator's driver: a CPU-only run keeps ordinary host memory.
        return cls(compute, torch.device("cpu"), offloaded=True, pin_memory=policy.pin_memory and compute.type != "cpu")

    # ------------------------------------------------------------------ storage on the shard device
    def new_flat(self, numel: int, dtype: torch.dtype, *, meta: bool) -> torch.Tensor:
        """A zeroed flat shard buffer (on 'meta' while the module is not materialized yet)."""
        if meta:
            return torch.zeros(numel, dtype=dtype, device="meta")
        return torch.zeros(numel, dtype=dtype, device=self.shard, pin_memory=self.pin_memory)

    def place(self, value: torch.Tensor, *, meta: bool) -> torch.Tensor:
        """A copy of ``value`` on the shard device: the local tensor of a kept-whole parameter."""
        if meta:
            return value.detach().to("meta", copy=True)
        local = torch.empty(value.shape, dtype=value.dtype, device=self.shard, pin_memory=self.pin_memory)
        local.copy_(value.detach())
        return local

    # ------------------------------------------------------------------ host -> device
    def to_compute(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The all-gather input: ``flat`` in ``dtype`` on the compute device.

        Offloaded, always a new tensor, also where both devices are the CPU: the path is then the same as with an
        accelerator. Copied in the stored dtype and cast on the device, so the host does no arithmetic and a pinned
        source stays an asynchronous copy. In training it has completed before the optimizer writes ``flat``: the
        end of backward waits for an event recorded after the ``to_shard`` copies, which come later on the same
        stream.
        """
        if self.offloaded:
            flat = flat.to(self.compute, non_blocking=self.pin_memory, copy=True)
        return flat if flat.dtype == dtype else flat.to(dtype)

    def copy_to_compute(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Fill ``dst`` (compute device) from ``src``, e.g. a kept-whole parameter's full tensor from its shard.

        Offloaded with another dtype, ``src`` crosses in its own dtype and is cast on the device: a copy that casts
        from host memory would convert on the host, into pageable memory, and so block.
        """
        if self.offloaded and dst.dtype != src.dtype:
            src = src.to(self.compute, non_blocking=self.pin_memory, copy=True)
        dst.copy_(src, non_blocking=self.pin_memory)

    # ------------------------------------------------------------------ device -> host
    def to_shard(self, reduced: torch.Tensor) -> torch.Tensor:
        """The reduce-scatter output on the shard device, where the sharded ``.grad`` lives.

        Asynchronous where it can be (pinned memory): the caller records an event after it and waits for that event
        before the host reads the values (``UnitGradients.settle``, at the end of backward). One copy per unit, of
        the whole reduced shard.
        """
        if not self.offloaded:
            return reduced
        host = torch.empty(reduced.shape, dtype=reduced.dtype, device=self.shard, pin_memory=self.pin_memory)
        host.copy_(reduced, non_blocking=self.pin_memory)
        return host

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy of ``tensor`` in host memory, asynchronous from an accelerator (read it after an event)."""
        return tensor.to("cpu", non_blocking=tensor.device.type != "cpu", copy=True)
