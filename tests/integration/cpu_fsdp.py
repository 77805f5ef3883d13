"""accelerate enables its FSDP plugin on accelerators only (``AcceleratorState`` leaves a CPU run ``MULTI_CPU``).
The integration scripts call ``enable_fsdp_plugin_on_cpu()`` before building an ``Accelerator`` (or a ``Trainer``),
for both libraries alike, so the FSDP2 plugin path runs on CPU/gloo."""

from __future__ import annotations

from typing import Any

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType


def enable_fsdp_plugin_on_cpu() -> None:
    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)  # later AcceleratorState() calls pass none
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    AcceleratorState.__init__ = init  # type: ignore[method-assign]
