"""One measured training step of a sharded model: the same code for the planner (fake process group, fake tensors)
and for a real run (gloo, NCCL), so their figures can be compared one to one.

:func:`measure_step` builds the model from a :class:`PlanConfig` (tensor parallelism first, then ``fc.fully_shard``
on every block and the root), runs ``warmup_steps`` steps (lazy initialization, optimizer state), then one step
under a :class:`~fsdp_compose.plan.live_bytes.LiveBytesCounter` with phases ``forward`` (model and loss),
``backward`` and ``optimizer`` (step, then ``zero_grad(set_to_none=True)``), counting its collectives with
:class:`fsdp_compose.CollectiveRecorder` (the recorder the tests and benchmarks use).
Storages are labelled by what they are: known objects before the step (sharded parameters, optimizer state), the
full parameters a unit registers (seen by a forward pre-hook that runs after fsdp_compose's), the buffers each
collective reads or fills, and the gradients of full parameters; the rest is activations and temporaries.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils.hooks import RemovableHandle

import fsdp_compose as fc
from fsdp_compose.agreement import agreement_group
from fsdp_compose.description import step_schedule
from fsdp_compose.meshes import REDUCE_SCATTER_GROUP_DESC, DataParallelMesh
from fsdp_compose.recorder import CollectiveRecord, CollectiveRecorder
from fsdp_compose.state import states_under

from .live_bytes import DEFAULT_LABEL, LiveBytesCounter, live_storage_keys, storages_of, tensors_since
from .models import ModelSpec, load_model_spec

__all__ = ["MeshSetup", "PlanConfig", "StepRecord", "build_mesh", "measure_step", "measure_steps"]

SHARDED_PARAMS = "sharded parameters"
SHARDED_GRADS = "sharded gradients"
OPTIMIZER_STATE = "optimizer state"
GATHERED = "gathered parameters"
UNSHARDED_GRADS = "unsharded gradients"
ALL_GATHER = "all-gather buffers"
REDUCE_SCATTER_IN = "reduce-scatter input"
REDUCE_SCATTER_OUT = "reduce-scatter output"
ALL_REDUCE = "all-reduce buffers"
BATCH = "batch"
CATEGORIES = (
    SHARDED_PARAMS,
    SHARDED_GRADS,
    OPTIMIZER_STATE,
    GATHERED,
    ALL_GATHER,
    UNSHARDED_GRADS,
    REDUCE_SCATTER_IN,
    REDUCE_SCATTER_OUT,
    ALL_REDUCE,
    DEFAULT_LABEL,
    BATCH,
)
PHASES = ("forward", "backward", "optimizer")


def moves_activations(kind: str, group: str) -> bool:
    """Collectives that are not FSDP's: tensor parallel's redistributions, expert parallel's all-to-alls (over the
    ``ep`` group, which under ``ep == shard`` is the shard dim's group)."""
    return group == "tp" or kind == "all_to_all"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("adamw", "sgd", "sgd-momentum", "none")


@dataclass(frozen=True)
class PlanConfig:
    """What to build and how to train it. ``world_size = replicate x shard x tp``.

    ``replicate > 1``: HSDP (``(replicate, shard)`` mesh). ``tp > 1``: the model's tensor-parallel plan on the last
    mesh dimension, FSDP over the others. ``ep > 1``: the model's expert-parallel plan over groups of ``ep``
    consecutive ranks of the shard dim, the experts sharded over the other ``shard / ep`` ranks (``efsdp``; with
    HSDP replicated as the dense weights are), torchtitan's layout. ``reshard_after_forward`` applies to the
    blocks; the root keeps fsdp_compose's default (kept gathered). ``foreach``: the optimizer's multi-tensor
    implementation (torch's default on CUDA; on CPU torch defaults to the per-parameter loop). ``batch_size`` and
    ``seq_len`` are per data-parallel rank; ``seq_len=None`` takes the model's own ``seq_len`` (else 2048).
    ``rank``: which rank to simulate.
    ``warmup_steps``: steps before the measured one (default: see :attr:`warmup`).
    """

    model: str = "gpt"
    model_args: dict[str, Any] = field(default_factory=dict)
    world_size: int = 8
    replicate: int = 1
    tp: int = 1
    ep: int = 1
    rank: int = 0
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    optimizer: str = "adamw"
    foreach: bool = False
    reshard_after_forward: bool | int = True
    batch_size: int = 1
    seq_len: int | None = None
    activation_checkpointing: bool = False
    warmup_steps: int | None = None

    @property
    def shard(self) -> int:
        return self.world_size // (self.replicate * self.tp)

    @property
    def expert_shard(self) -> int:
        """Ranks an expert's weights are sharded over (``efsdp``): the shard dim's, less the ``ep`` ones."""
        return self.shard // self.ep

    def validate(self) -> None:
        if self.world_size < 1 or self.replicate < 1 or self.tp < 1 or self.ep < 1:
            raise ValueError("world_size, replicate, tp and ep must be positive")
        if self.shard % self.ep:
            raise ValueError(f"ep {self.ep} does not divide the shard dim's {self.shard} ranks")
        if self.ep > 1 and self.tp > 1:
            raise ValueError("the planner does not combine ep with tp (experts split by tensor parallel); use one")
        if self.world_size % (self.replicate * self.tp):
            raise ValueError(
                f"world size {self.world_size} is not divisible by replicate x tp = {self.replicate * self.tp}"
            )
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        for dtype in (self.param_dtype, self.reduce_dtype):
            if dtype is not None and dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; one of {sorted(DTYPES)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; one of {OPTIMIZERS}")
        if self.warmup_steps is not None and self.warmup_steps < 1:
            raise ValueError("warmup_steps must be at least 1 (lazy initialization and optimizer state)")

    @property
    def warmup(self) -> int:
        """Steps before the measured one: 1 (lazy initialization, optimizer state), 2 for SGD with momentum, whose
        first step creates the momentum buffer by a copy and only the second one runs the steady-state update."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 2 if self.optimizer == "sgd-momentum" else 1

    def mesh_dims(self) -> dict[str, int]:
        dims = {"replicate": self.replicate} if self.replicate > 1 else {}
        dims["shard"] = self.shard
        if self.tp > 1:
            dims["tp"] = self.tp
        return dims

    def mesh_name(self) -> str:
        name = " x ".join(f"{name} {size}" for name, size in self.mesh_dims().items())
        return f"{name} (efsdp {self.expert_shard} x ep {self.ep})" if self.ep > 1 else name


@dataclass
class MeshSetup:
    """The meshes of a :class:`PlanConfig`. Under expert parallel, ``experts`` is ``dp_mesh``'s shard dim unflattened
    into ``(efsdp, ep)`` (with ``replicate`` in front for HSDP): ``expert_dp_mesh`` (the experts' data-parallel mesh)
    and ``ep_mesh`` are its slices."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh | None
    group_labels: dict[str, str]
    ep_mesh: DeviceMesh | None = None
    expert_dp_mesh: DeviceMesh | None = None


def build_mesh(config: PlanConfig, device_type: str = "cpu", mesh: DeviceMesh | None = None) -> MeshSetup:
    """The mesh of ``config`` (built over the default process group, or ``mesh`` when given: its shape and
    dimension names must be :meth:`PlanConfig.mesh_dims`'s), and the name of each dimension's process group."""
    config.validate()
    dims = config.mesh_dims()
    names = tuple(dims)
    if mesh is None:
        mesh = init_device_mesh(device_type, tuple(dims.values()), mesh_dim_names=names)
    elif tuple(mesh.mesh_dim_names or ()) != names or tuple(mesh.shape) != tuple(dims.values()):
        raise ValueError(f"mesh {mesh} does not match the configuration's {dims}")
    dp_names = tuple(name for name in names if name != "tp")
    dp_mesh = mesh[dp_names] if len(dp_names) > 1 else mesh[dp_names[0]]
    tp_mesh = mesh["tp"] if "tp" in dims else None
    labels = {str(mesh.get_group(name).group_name): name for name in names}
    # fsdp_compose reduce-scatters over a group of the shard dim's ranks of its own (meshes.reduce_scatter_group)
    labels[REDUCE_SCATTER_GROUP_DESC] = dp_names[-1]
    setting = config.reshard_after_forward
    post_forward = not isinstance(setting, bool) and 1 < setting < config.shard
    _make_groups(dp_mesh, setting if post_forward else True, mesh.device_type)
    setup = MeshSetup(mesh, dp_mesh, tp_mesh, labels)
    if config.ep > 1:
        _expert_meshes(setup, config)
    return setup


def _expert_meshes(setup: MeshSetup, config: PlanConfig) -> None:
    """Unflatten the shard dim into ``(efsdp, ep)``, name their groups, and have fsdp_compose make the groups and
    the combined mesh it needs for experts on their own mesh now, outside ``FakeTensorMode`` (see _make_groups)."""
    dp = setup.dp_mesh
    names = ("efsdp", "ep")
    experts = dp._unflatten(dp.ndim - 1, (config.expert_shard, config.ep), names)
    setup.ep_mesh = experts["ep"]
    setup.expert_dp_mesh = experts[("replicate", "efsdp")] if config.replicate > 1 else experts["efsdp"]
    for name in names:  # a group of the shard dim's ranks (ep == shard) keeps its name
        setup.group_labels.setdefault(str(experts.get_group(name).group_name), name)
    module = nn.Module()
    with torch.device(dp.device_type):
        module.register_parameter(
            "w", nn.Parameter(distribute_tensor(torch.zeros(config.ep, 1), setup.ep_mesh, [Shard(0)]))
        )
        fc.fully_shard(module, mesh=dp, shard_placement_fn=expert_placement(setup, {"w"}, module))


def expert_placement(
    setup: MeshSetup, expert_names: set[str], model: nn.Module
) -> Callable[[nn.Parameter], ShardPlacementResult | None]:
    """``shard_placement_fn`` putting the parameters named ``expert_names`` (paths under ``model``) on the experts'
    data-parallel mesh: ``Shard(0)`` (whole experts) where each ep rank holds at least as many experts as that mesh
    shards over, else ``Shard(1)`` (torchtitan's rule); the other parameters are left to ``fully_shard``."""
    mesh = setup.expert_dp_mesh
    assert mesh is not None
    if mesh.ndim == 2:
        info: FSDPMeshInfo = HSDPMeshInfo(mesh=mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        info = FSDPMeshInfo(mesh=mesh, shard_mesh_dim=0)
    shards = mesh.size(mesh.ndim - 1)
    experts = {id(param) for name, param in model.named_parameters() if name in expert_names}

    def placement(param: nn.Parameter) -> ShardPlacementResult | None:
        if id(param) not in experts:
            return None
        local = param.to_local() if isinstance(param, DTensor) else param
        return ShardPlacementResult(placement=Shard(0 if local.shape[0] >= shards else 1), mesh_info=info)

    return placement


def _make_groups(dp_mesh: DeviceMesh, setting: bool | int, device_type: str) -> None:
    """Have fsdp_compose create the process groups it cuts from ``dp_mesh`` now, outside ``FakeTensorMode``.

    fully_shard makes the reduce-scatter group and the groups of ``reshard_after_forward=k`` from the mesh's rank
    tensor (``DeviceMesh._unflatten`` and friends, which cannot run under FakeTensorMode) and caches them on the mesh
    object for every later unit (docs/design.md); a root's lazy init flattens a 2-D data-parallel mesh for the
    step's agreement, cached by the mesh too. Sharding a one-element module here and asking for the agreement's group
    fill those caches, so the model's units, sharded and run under FakeTensorMode, reuse them.
    """
    with torch.device(device_type):
        fc.fully_shard(nn.Linear(1, 1, bias=False), mesh=dp_mesh, reshard_after_forward=setting)
    agreement_group(DataParallelMesh.of(dp_mesh))


@dataclass
class Setup:
    spec: ModelSpec
    optimizer: torch.optim.Optimizer | None
    inputs: torch.Tensor
    targets: torch.Tensor
    units: dict[str, nn.Module]  # name -> sharded module (blocks first, then "root")
    unit_params: dict[str, list[ParamInfo]]  # name -> what fully_shard got (TP-local shapes), before sharding
    seq_len: int
    optimizer_shapes: list[tuple[int, ...]]  # trainable parameters in the optimizer's order, as fully_shard got them
    expert_names: set[str] = field(default_factory=set)  # parameters on the experts' mesh (ModelSpec.ep_plan's)


def _local_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple((param.to_local() if isinstance(param, DTensor) else param).shape)


@dataclass(frozen=True)
class ParamInfo:
    """A parameter as ``fully_shard`` receives it: the shape it shards (the TP- or EP-local shape), and for an
    expert (on the experts' data-parallel mesh) the dim it is sharded on."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    expert: bool = False
    shard_dim: int = 0


def unit_params(
    units: list[tuple[str, nn.Module]], expert_shard_dims: dict[int, int] | None = None
) -> dict[str, list[ParamInfo]]:
    """Each unit's parameters in sharding order (inner units first; a parameter belongs to the first unit that has
    it, as ``fully_shard`` assigns them), described by their local tensor. ``expert_shard_dims``: id of each expert
    parameter -> the dim it is sharded on."""
    experts = expert_shard_dims or {}
    owned: set[int] = set()
    result: dict[str, list[ParamInfo]] = {}
    for name, module in units:
        infos = []
        for param in module.parameters():
            if id(param) in owned:
                continue
            owned.add(id(param))
            local = param.to_local() if isinstance(param, DTensor) else param
            dim = experts.get(id(param))
            info = ParamInfo(_local_shape(param), local.dtype, param.requires_grad, dim is not None, dim or 0)
            infos.append(info)
        result[name] = infos
    return result


def _make_optimizer(kind: str, params: list[nn.Parameter], foreach: bool) -> torch.optim.Optimizer | None:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, foreach=foreach)
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach)
    return None


def build(config: PlanConfig, mesh: MeshSetup) -> Setup:
    """The model of ``config`` with tensor parallelism (if any), sharded block by block and then at the root."""
    spec = load_model_spec(config.model, config.model_args, activation_checkpointing=config.activation_checkpointing)
    model = spec.model
    if mesh.tp_mesh is not None:
        if spec.tp_plan is None:
            raise ValueError(f"model {config.model!r} has no tensor-parallel plan; give its ModelSpec a tp_plan")
        spec.tp_plan(model, mesh.tp_mesh)
    placement = None
    expert_names: set[str] = set()
    expert_dims: dict[int, int] = {}
    if mesh.ep_mesh is not None:
        if spec.ep_plan is None:
            raise ValueError(f"model {config.model!r} has no expert-parallel plan; give its ModelSpec an ep_plan")
        expert_names = set(spec.ep_plan(model, mesh.ep_mesh))
        placement = expert_placement(mesh, expert_names, model)
        for param in model.parameters():
            chosen = placement(param)
            if chosen is not None and chosen.placement is not None:
                expert_dims[id(param)] = chosen.placement.dim
    dtype = {name: DTYPES[value] for name, value in (("p", config.param_dtype), ("r", config.reduce_dtype)) if value}
    policy = fc.MixedPrecisionPolicy(param_dtype=dtype.get("p"), reduce_dtype=dtype.get("r"))
    names = {id(module): name for name, module in model.named_modules()}
    infos = unit_params([(names[id(unit)], unit) for unit in spec.units] + [("root", model)], expert_dims)
    order = [_local_shape(p) for p in model.parameters() if p.requires_grad]
    units: dict[str, nn.Module] = {}
    kwargs: dict[str, Any] = {"mp_policy": policy, "shard_placement_fn": placement}
    for unit in spec.units:
        fc.fully_shard(unit, mesh=mesh.dp_mesh, reshard_after_forward=config.reshard_after_forward, **kwargs)
        if expert_names:  # an expert's gradient sums every rank's tokens: divided as the dense ones, not by efsdp
            fc.set_gradient_divide_factor(unit, float(config.replicate * config.shard))
        units[names[id(unit)]] = unit
    fc.fully_shard(model, mesh=mesh.dp_mesh, **kwargs)
    units["root"] = model
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device=mesh.mesh.device_type)
    optimizer = _make_optimizer(config.optimizer, [p for p in model.parameters() if p.requires_grad], config.foreach)
    seq_len = config.seq_len or int(spec.description.get("seq_len", 2048))
    inputs, targets = spec.make_batch(config.batch_size, seq_len)
    return Setup(spec, optimizer, inputs, targets, units, infos, seq_len, order, expert_names)


def _own_params(unit: nn.Module, others: set[int]) -> Iterator[torch.Tensor]:
    """The tensors registered as parameters on ``unit`` and its submodules, skipping other units' subtrees."""
    stack = [unit]
    while stack:
        module = stack.pop()
        yield from (p for p in module._parameters.values() if p is not None)
        stack.extend(child for child in module.children() if id(child) not in others)


class UnitWatcher:
    """Forward pre-hooks (after fsdp_compose's) that note each unit's full parameters and their storages."""

    def __init__(self, units: dict[str, nn.Module]) -> None:
        self.counter: LiveBytesCounter | None = None
        self.storages: dict[int, tuple[weakref.ref[torch.UntypedStorage], str]] = {}
        self.params: dict[int, weakref.ref[torch.Tensor]] = {}
        ids = {id(module) for module in units.values()}
        self._handles: list[RemovableHandle] = []
        for name, module in units.items():
            hook = self._hook(name, module, ids - {id(module)})
            self._handles.append(module.register_forward_pre_hook(hook))

    def _hook(self, name: str, unit: nn.Module, others: set[int]) -> Any:
        def pre_forward(module: nn.Module, args: Any) -> None:
            for param in _own_params(unit, others):
                if isinstance(param, nn.Parameter) and _is_sharded(param):
                    continue  # not gathered (kept sharded, or this unit is resharded)
                self.params.setdefault(id(param), weakref.ref(param))
                for st in storages_of(param):
                    self.storages.setdefault(st._cdata, (weakref.ref(st), name))
                    if self.counter is not None:
                        self.counter.watch([st])
                        self.counter.label([st], f"{GATHERED} [{name}]")

        return pre_forward

    def label_known(self, counter: LiveBytesCounter) -> None:
        self.counter = counter
        for ref, name in self.storages.values():
            st = ref()
            if st is not None:
                counter.watch([st])  # fsdp_compose frees and re-grows them with UntypedStorage.resize_
                counter.label([st], f"{GATHERED} [{name}]")

    def label_grads(self) -> None:
        counter = self.counter
        if counter is None or counter.phase != "backward":
            return
        for ref in self.params.values():
            param = ref()
            if param is not None and param.grad is not None:
                counter.label([param.grad], UNSHARDED_GRADS)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self.counter = None


def _is_sharded(param: nn.Parameter) -> bool:
    """A parameter registered as fsdp_compose's sharded DTensor (its mesh has the dense or the experts' shard dim)."""
    if not isinstance(param, DTensor):
        return False
    names = param.device_mesh.mesh_dim_names or ()
    return "shard" in names or "efsdp" in names


def _distinct_bytes(tensors: Sequence[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        for st in storages_of(tensor):
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def _local_bytes(tensors: Sequence[torch.Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        total += local.numel() * local.element_size()
    return total


def _optimizer_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    if optimizer is None:
        return []
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@dataclass
class StepRecord:
    """What one rank holds and moves in the measured step. Bytes are storage bytes (padding included)."""

    config: dict[str, Any]
    model: dict[str, Any]  # the model's description (a preset's config fields)
    mesh: dict[str, int]
    seq_len: int
    parameters: int
    units: int
    sharded_param_bytes: int
    sharded_param_local_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    baseline_bytes: int
    peaks: dict[str, int]
    peak_ops: dict[str, str]
    breakdown: dict[str, dict[str, int]]
    gathered_at_peak: dict[str, dict[str, int]]
    collectives: dict[str, dict[str, dict[str, int]]]
    backend_temporaries_bytes: int
    ops: int
    sharding_propagations: int  # DTensor sharding-propagation cache misses in the measured step (see _notes)
    schedule: dict[str, Any] = field(default_factory=dict)  # the engine's declared schedule: see schedule_record
    collective_sequence: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, group, bytes), in order
    meshes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per data-parallel mesh: see _per_mesh
    unit_params: dict[str, list[ParamInfo]] = field(default_factory=dict, repr=False)
    optimizer_shapes: list[tuple[int, ...]] = field(default_factory=list, repr=False)

    @property
    def peak_bytes(self) -> int:
        return max(self.peaks.values())

    @property
    def collective_bytes(self) -> int:
        return sum(g["bytes"] for groups in self.collectives.values() for g in groups.values())

    def collective_calls(self) -> int:
        return sum(g["calls"] for groups in self.collectives.values() for g in groups.values())

    def fsdp_collectives(self) -> dict[str, dict[str, dict[str, int]]]:
        """:attr:`collectives` without those that move activations (:func:`moves_activations`)."""
        found = {}
        for kind, groups in self.collectives.items():
            kept = {name: g for name, g in groups.items() if not moves_activations(kind, name)}
            if kept:
                found[kind] = kept
        return found

    @property
    def fsdp_collective_bytes(self) -> int:
        return sum(g["bytes"] for groups in self.fsdp_collectives().values() for g in groups.values())

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (without ``unit_params``)."""
        result = asdict(self)
        del result["unit_params"], result["optimizer_shapes"]
        return result


def _roll_up(labels: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    categories: dict[str, int] = {}
    gathered: dict[str, int] = {}
    for name, nbytes in labels.items():
        if name.startswith(GATHERED):
            gathered[name[len(GATHERED) + 2 : -1]] = nbytes
            name = GATHERED
        categories[name] = categories.get(name, 0) + nbytes
    ordered = {name: categories[name] for name in CATEGORIES if categories.get(name)}
    ordered.update({name: n for name, n in categories.items() if name not in ordered and n})
    return ordered, gathered


def schedule_record(model: nn.Module, units: dict[str, nn.Module]) -> dict[str, Any]:
    """The engine's declared schedule of the sharded root ``model`` (``fsdp_compose.program.StepSchedule``, built by
    the function ``fc.describe_schedule`` uses) as data, each unit named as in ``units`` (its key: ``"root"``,
    ``"blocks.3"``): ``units`` in registration order, each with its class names, whether it is the root, the
    collectives it issues in a step and whether it frees its full parameters after forward (also at one rank);
    ``gather_order`` (backward all-gathers) and ``reduce_order``."""
    planner_names = {id(module): name for name, module in units.items()}
    states = states_under(model)
    names = {}
    for state in states:
        found = [planner_names[id(m)] for m in state.modules if id(m) in planner_names]
        name = found[0] if found else state.params.owner_name
        names[id(state)] = f"{name} {state.mesh_label}" if state.mesh_label else name
    schedule = step_schedule(model, names)
    named = {id(u.state): u.name for u in schedule.units}
    return {
        "units": [
            {
                "name": u.name,
                "root": u.is_root,
                "classes": [type(m).__name__ for m in u.state.modules],
                "collectives": u.collectives(),
                "reshards_after_forward": u.state.reshard_after_forward,
            }
            for u in schedule.units
        ],
        "gather_order": [named[id(state)] for state in schedule.gather_order],
        "reduce_order": [named[id(state)] for state in schedule.reduce_order],
    }


class _Step:
    """Runs the training step; labels the buffers each collective reads or fills."""

    def __init__(
        self, setup: Setup, counter: LiveBytesCounter | None, settle: Callable[[], object] | None = None
    ) -> None:
        self.setup, self.counter = setup, counter
        # Called between backward and the optimizer step on real process groups: gloo drops a finished
        # collective's tensors on its worker thread after the wait has returned, so without a blocking call here
        # buffers of the last reductions were sometimes still alive when the optimizer step started and were counted
        # there (seen: +26% of a tiny model's optimizer phase, 1 step in 15).
        self.settle = settle
        self.grad_bytes = self.expert_grad_bytes = 0

    def on_collective(
        self, record: CollectiveRecord, inputs: tuple[torch.Tensor, ...], outputs: tuple[torch.Tensor, ...]
    ) -> None:
        """A :class:`CollectiveRecorder` observer: name the buffers of an FSDP collective."""
        if self.counter is None or moves_activations(record.kind, record.group):
            return
        if record.kind == "all_gather":
            self.counter.label(outputs + inputs, ALL_GATHER)
        elif record.kind == "reduce_scatter":
            self.counter.label(inputs, REDUCE_SCATTER_IN)
            self.counter.label(outputs, REDUCE_SCATTER_OUT)
        elif record.kind == "all_reduce":
            self.counter.label(outputs, ALL_REDUCE)

    def phase(self, name: str) -> None:
        if self.counter is not None:
            self.counter.set_phase(name)

    def run(self) -> None:
        setup = self.setup
        self.phase("forward")
        loss = setup.spec.loss(setup.spec.model(setup.inputs), setup.targets)
        self.phase("backward")
        loss.backward()
        del loss
        grads = {name: p.grad for name, p in setup.spec.model.named_parameters() if p.grad is not None}
        self.grad_bytes = _distinct_bytes(list(grads.values()))
        experts = [grad for name, grad in grads.items() if name in setup.expert_names]
        self.expert_grad_bytes = _distinct_bytes(experts)
        del grads, experts
        if self.settle is not None:
            self.settle()
        self.phase("optimizer")
        if setup.optimizer is not None:
            setup.optimizer.step()
            setup.optimizer.zero_grad(set_to_none=True)
        else:
            for p in setup.spec.model.parameters():
                p.grad = None


def _per_mesh(
    config: PlanConfig, setup: Setup, step: _Step, collectives: dict[str, dict[str, dict[str, int]]]
) -> dict[str, dict[str, Any]]:
    """What this rank holds and moves per data-parallel mesh (``"dense"``; ``"experts"`` under expert parallel):
    its dims, the parameters on it (global count), their sharded bytes, gradients and optimizer state, and the
    all-gather and reduce-scatter bytes over its shard group (an HSDP all-reduce goes over the replicate group, which
    both meshes share: see the collectives by group)."""
    mesh_dims = {"dense": config.mesh_dims()}
    if config.ep > 1:
        replicate = {"replicate": config.replicate} if config.replicate > 1 else {}
        mesh_dims["experts"] = {**replicate, "efsdp": config.expert_shard, "ep": config.ep}
    on_mesh: dict[str, list[torch.Tensor]] = {mesh_name: [] for mesh_name in mesh_dims}
    for name, param in setup.spec.model.named_parameters():
        on_mesh["experts" if name in setup.expert_names else "dense"].append(param)
    shard_dims = {"dense": "shard", "experts": "efsdp"}
    state = setup.optimizer.state if setup.optimizer is not None else {}
    result = {}
    for mesh_name, params in on_mesh.items():
        optimizer = [v for p in params for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
        shard_dim = shard_dims[mesh_name]
        result[mesh_name] = {
            "dims": mesh_dims[mesh_name],
            "parameters": sum(p.numel() for p in params),
            "sharded_param_bytes": _distinct_bytes(params),
            "grad_bytes": step.expert_grad_bytes
            if mesh_name == "experts"
            else step.grad_bytes - step.expert_grad_bytes,
            "optimizer_bytes": _distinct_bytes(optimizer),
            **{
                kind: collectives.get(kind, {}).get(shard_dim, {}).get("bytes", 0)
                for kind in ("all_gather", "reduce_scatter")
            },
        }
    return result


def _sharding_cache_misses() -> int:
    """DTensor's sharding-propagation cache misses so far (its C++ and Python caches; 0 where torch does not say)."""
    misses = 0
    stats = getattr(torch._C, "_get_DTensor_sharding_propagator_cache_stats", None)
    if stats is not None:
        misses += int(stats()[1])
    cache = getattr(DTensor._op_dispatcher.sharding_propagator, "propagate_op_sharding", None)
    info = getattr(cache, "cache_info", None)
    if info is not None:
        misses += int(info().misses)
    return misses


def measure_step(
    config: PlanConfig, mesh: MeshSetup, *, fake: bool = False, refresh: Literal["all", "watched"] = "watched"
) -> StepRecord:
    """Build, warm up and measure one step of ``config`` on ``mesh`` (this process is one rank).

    ``fake``: the process runs under ``FakeTensorMode`` (its storages are meta storages; see :mod:`.simulate`).
    Storages first seen as op inputs that nobody registered are a backend's own temporaries (gloo's copy of a
    reduce-scatter input): they are left out of the peak and reported as ``backend_temporaries_bytes``.
    ``refresh``: see :class:`LiveBytesCounter` (``"all"`` re-reads every storage after every op: slower, a check).
    """
    return measure_steps(config, mesh, steps=1, fake=fake, refresh=refresh)[0]


def measure_steps(
    config: PlanConfig,
    mesh: MeshSetup,
    *,
    steps: int,
    fake: bool = False,
    refresh: Literal["all", "watched"] = "watched",
) -> list[StepRecord]:
    """:func:`measure_step` for ``steps`` consecutive steps of one model, one record each.

    Why more than one: on gloo a finished collective's tensors are let go by the backend's worker thread, after
    ``Work.wait`` has returned, so a real step's phase peak can come out higher than the same step with the release
    at the wait (what the planner's fake collectives do). The lag only ever adds bytes: the lowest of a few steps
    is the figure to compare with the planner, the highest bounds the lag.
    """
    if steps < 1:
        raise ValueError(f"measure_steps: steps must be at least 1, got {steps}")
    snapshot = live_storage_keys(fake=fake)
    setup = build(config, mesh)
    watcher = UnitWatcher(setup.units)
    records = []
    try:
        for _ in range(config.warmup):
            _Step(setup, None).run()
        for _ in range(steps):
            records.append(_measure_one(config, setup, mesh, watcher, snapshot, fake=fake, refresh=refresh))
    finally:
        watcher.remove()
    return records


def _measure_one(
    config: PlanConfig,
    setup: Setup,
    mesh: MeshSetup,
    watcher: UnitWatcher,
    snapshot: dict[int, torch.UntypedStorage],
    *,
    fake: bool,
    refresh: Literal["all", "watched"],
) -> StepRecord:
    counter = LiveBytesCounter(unseen="ignore", see_through_subclasses=True, refresh=refresh)
    counter.register(tensors_since(snapshot, fake=fake))
    model = setup.spec.model
    params = list(model.parameters())
    counter.label(params, SHARDED_PARAMS, replace=True)
    counter.label([p.grad for p in params if p.grad is not None], SHARDED_GRADS, replace=True)
    counter.label(_optimizer_tensors(setup.optimizer), OPTIMIZER_STATE, replace=True)
    counter.label([setup.inputs, setup.targets], BATCH)
    watcher.label_known(counter)
    step = _Step(setup, counter, settle=None if fake else dist.barrier)
    # reshard_after_forward=k gathers within groups cut at fully_shard: named by what they are, not by the
    # creation-order number torch gives them (which differs between a simulated and a real run)
    labels = dict(mesh.group_labels)
    for state in states_under(model):
        group = state.params.post_forward
        if group is not None:
            labels[group.group.group_name] = f"post_forward({group.size})"
        # reduce-scatters go over a group of the shard dim's ranks of fsdp_compose's own: named as that dim
        shard_dim = (state.params.dp.mesh.mesh_dim_names or ("shard",))[-1]
        labels.setdefault(str(state.params.reduce_group.group_name), shard_dim)
        replicas = state.params.dp.replica_reduce_group
        if replicas is not None:
            labels.setdefault(str(replicas.group_name), "replicate")
    recorder = CollectiveRecorder(group_labels=labels, observer=step.on_collective)
    counter.on_new_peak = watcher.label_grads
    misses = _sharding_cache_misses()
    with counter, recorder:
        step.run()
    counter.close()
    misses = _sharding_cache_misses() - misses
    summary = recorder.summary()
    schedule = schedule_record(model, setup.units)
    breakdown: dict[str, dict[str, int]] = {}
    gathered: dict[str, dict[str, int]] = {}
    for phase in PHASES:
        breakdown[phase], gathered[phase] = _roll_up(counter.breakdown(phase))
    return StepRecord(
        config=asdict(config),
        model=dict(setup.spec.description),
        mesh=config.mesh_dims(),
        seq_len=setup.seq_len,
        parameters=sum(p.numel() for p in params),
        units=len(setup.units),
        sharded_param_bytes=_distinct_bytes(params),
        sharded_param_local_bytes=_local_bytes(params),
        grad_bytes=step.grad_bytes,
        optimizer_bytes=_distinct_bytes(_optimizer_tensors(setup.optimizer)),
        baseline_bytes=counter.baseline_bytes,
        peaks={phase: counter.phase_peaks.get(phase, 0) for phase in PHASES},
        peak_ops={phase: counter.phase_peak_op.get(phase, "") for phase in PHASES},
        breakdown=breakdown,
        gathered_at_peak=gathered,
        collectives=summary,
        backend_temporaries_bytes=counter.ignored_peak_bytes,
        ops=counter.ops,
        sharding_propagations=misses,
        schedule=schedule,
        collective_sequence=[(r.kind, r.group, r.nbytes) for r in recorder.records],
        meshes=_per_mesh(config, setup, step, summary),
        unit_params=setup.unit_params,
        optimizer_shapes=setup.optimizer_shapes,
    )
