"""Memory and communication planner: runs fsdp_compose's own training step for one rank of an N-rank job in this
process, on torch's fake process group under ``FakeTensorMode``, and reports what that rank holds and moves.

    import fsdp_compose.plan as fp

    result = fp.plan(fp.PlanConfig(model="llama-70b", world_size=1024, param_dtype="bf16", reduce_dtype="fp32"))
    print(fp.render(result))

or ``python -m fsdp_compose.plan --model llama-70b --world-size 1024``. See docs/planner.md for the model of memory
behind the figures and how they compare with real runs.
"""

from .analytic import StateBytes, min_collective_bytes, sharded_state, zero3_floor
from .live_bytes import LiveBytesCounter, live_storage_keys, storages_of, tensors_since
from .models import PRESETS, GPTConfig, LlamaConfig, ModelSpec, load_model_spec
from .peak_model import PeakModel, peak_model
from .planner import PlanResult, parse_mesh, plan, sweep
from .report import fmt_bytes, render, render_sweep
from .step import MeshSetup, PlanConfig, StepRecord, build_mesh, measure_step

__all__ = [
    "PRESETS",
    "GPTConfig",
    "LiveBytesCounter",
    "LlamaConfig",
    "MeshSetup",
    "ModelSpec",
    "PeakModel",
    "PlanConfig",
    "PlanResult",
    "StateBytes",
    "StepRecord",
    "build_mesh",
    "fmt_bytes",
    "live_storage_keys",
    "load_model_spec",
    "measure_step",
    "min_collective_bytes",
    "parse_mesh",
    "peak_model",
    "plan",
    "render",
    "render_sweep",
    "sharded_state",
    "storages_of",
    "sweep",
    "tensors_since",
    "zero3_floor",
]
