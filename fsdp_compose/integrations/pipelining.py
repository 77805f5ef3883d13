"""``torch.distributed.pipelining`` over stages sharded by fsdp_compose: one import line changes.

Pipelining treats a stage whose module is a torch ``FSDPModule`` specially (stage.py): every micro-batch's backward
runs without gradient sync and keeps the full parameters (``set_requires_gradient_sync(False)``,
``set_reshard_after_backward(False)``), and after the last one ``perform_reduce_grad`` reaches into FSDP2's private
state to run each parameter group's post-backward (one reduce-scatter per unit per step). Those branches are guarded
by ``isinstance(submod, FSDPModule)``, which is False for a module fsdp_compose sharded: without this class every
micro-batch reduce-scatters (same numbers, the reduction work times the number of micro-batches), and making the
guard pass fails in ``fully_shard.state(module)``.

``PipelineStage`` here is torch's ``PipelineStage`` with those three points answered through fsdp_compose's public
functions, for every unit under the stage's module:

- a micro-batch's backward (``backward_maybe_with_nosync``): sync and reshard after backward are off except on the
  stage's last micro-batch (the schedule says which), so gradients accumulate unsharded and that backward reduces
  them, one reduce-scatter per unit, as FSDP2's post-backward in ``perform_reduce_grad`` does;
- ``perform_reduce_grad``: only the gradient scaling is left (the reduction already happened);
- the cleanup after the first step's metadata inference: every unit resharded, its gradients dropped.

Stages whose module holds no fsdp_compose unit behave exactly as torch's class. Split backward (the zero-bubble
schedules' separate input and weight passes) is refused: a unit's post-backward runs when its inputs' gradients
exist, before the weight pass.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage as _TorchPipelineStage

from ..api import set_requires_all_reduce, set_requires_gradient_sync, set_reshard_after_backward
from ..state import states_under

__all__ = ["PipelineStage"]


class PipelineStage(_TorchPipelineStage):
    """torch's ``PipelineStage`` for a stage module sharded by ``fc.fully_shard`` (same constructor).

    Replace ``from torch.distributed.pipelining import PipelineStage`` by
    ``from fsdp_compose.integrations.pipelining import PipelineStage``; the schedules (``ScheduleGPipe``,
    ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...) are torch's, unchanged.
    """

    def _uses_fsdp_compose(self) -> bool:
        return bool(states_under(self.submod))

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        # A unit still gathered from an earlier micro-batch's forward whose backward has not run yet (the stage's
        # root, kept by reshard_after_forward=False) stays gathered for this forward, as FSDP2 keeps it: a new root
        # forward would otherwise free it and gather it again. Every dp rank of the stage ran the same micro-batches.
        for state in states_under(self.submod):
            state.keep_for_next_forward()
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(
        self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True, last_backward: bool = False
    ) -> None:
        if not full_backward and self._uses_fsdp_compose():
            raise NotImplementedError(
                f"fsdp_compose.integrations.pipelining.PipelineStage (stage {self.stage_index}): this schedule splits "
                "backward into an input pass and a weight pass (zero bubble); an fsdp_compose unit reduces its "
                "gradients and frees its full parameters when its inputs' gradients exist, before the weight pass. "
                "Use a schedule with full backward (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B)"
            )
        super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    def backward_maybe_with_nosync(
        self, backward_type: str, bwd_kwargs: dict[str, Any], last_backward: bool = False
    ) -> tuple[tuple[torch.Tensor | None, ...], list[dict[str, Any]] | None]:
        if self._uses_fsdp_compose():
            # FSDP2's branch turns sync off on every micro-batch and reduces in perform_reduce_grad; here the last
            # micro-batch's backward reduces (one reduce-scatter per unit): the same reduction of the same sums.
            set_requires_gradient_sync(self.submod, last_backward)
            set_requires_all_reduce(self.submod, last_backward)
            set_reshard_after_backward(self.submod, last_backward)
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

    def _post_metadata_inference_cleanup(self) -> None:
        super()._post_metadata_inference_cleanup()
        # The metadata inference ran a real forward and backward: free what it gathered, drop what it reduced.
        for state in states_under(self.submod):
            state.params.reshard()
        if self._uses_fsdp_compose():
            for param in self.submod.parameters():
                param.grad = None
