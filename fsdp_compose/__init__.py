"""fsdp_compose: fully-sharded data parallel that attaches to modules instead of wrapping them.

``fc.fully_shard(module, mesh=...)`` shards parameters over data-parallel ranks as DTensors and adds hooks; the
module keeps its class. See docs/design.md for one training step through the code.
"""

from .compat import check_torch_version

check_torch_version()  # before anything that needs the newer torch APIs

from .agreement import StepAbandoned  # noqa: E402
from .api import (  # noqa: E402
    UnshardHandle,
    get_state,
    is_fully_sharded,
    no_sync,
    refresh_trainable,
    register_forward_method,
    reset_step,
    reshard,
    set_backward_prefetch_point,
    set_backward_prefetch_post,
    set_collective_checks,
    set_full_precision_in_eval,
    set_gradient_accumulation,
    set_gradient_divide_factor,
    set_modules_to_backward_prefetch,
    set_modules_to_forward_prefetch,
    set_optimizer_in_backward,
    set_requires_all_reduce,
    set_requires_gradient_sync,
    set_reshard_after_backward,
    set_reshard_after_forward,
    unshard,
)
from .clip import clip_grad_norm_  # noqa: E402
from .description import (  # noqa: E402
    ParamDescription,
    UnitDescription,
    describe,
    describe_schedule,
    describe_units,
    print_description,
)
from .extensions import CastAllGather, Int8AllGather, ShardExtensions  # noqa: E402
from .host_copy import HostCopies, move_to_device, move_to_host  # noqa: E402
from .init import fully_shard  # noqa: E402
from .integrations.fsdp2 import FSDP2_METHOD_NAMES, bind_fsdp2_methods, has_fsdp2_methods, share_comm_ctx  # noqa: E402
from .integrations.ports import ported  # noqa: E402
from .policies import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy  # noqa: E402
from .recorder import CollectiveRecord, CollectiveRecorder  # noqa: E402
from .state_dict import full_state_dict, full_weights, load_full_state_dict  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "FSDP2_METHOD_NAMES",
    "CPUOffloadPolicy",
    "CastAllGather",
    "CollectiveRecord",
    "CollectiveRecorder",
    "DataParallelMeshDims",
    "HostCopies",
    "Int8AllGather",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ParamDescription",
    "ShardExtensions",
    "StepAbandoned",
    "UnitDescription",
    "UnshardHandle",
    "bind_fsdp2_methods",
    "clip_grad_norm_",
    "describe",
    "describe_schedule",
    "describe_units",
    "full_state_dict",
    "full_weights",
    "fully_shard",
    "get_state",
    "has_fsdp2_methods",
    "is_fully_sharded",
    "load_full_state_dict",
    "move_to_device",
    "move_to_host",
    "no_sync",
    "ported",
    "print_description",
    "refresh_trainable",
    "register_forward_method",
    "reset_step",
    "reshard",
    "set_backward_prefetch_point",
    "set_backward_prefetch_post",
    "set_collective_checks",
    "set_full_precision_in_eval",
    "set_gradient_accumulation",
    "set_gradient_divide_factor",
    "set_modules_to_backward_prefetch",
    "set_modules_to_forward_prefetch",
    "set_optimizer_in_backward",
    "set_requires_all_reduce",
    "set_requires_gradient_sync",
    "set_reshard_after_backward",
    "set_reshard_after_forward",
    "share_comm_ctx",
    "unshard",
]
