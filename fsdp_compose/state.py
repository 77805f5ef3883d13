"""A unit's state: what one ``fully_shard`` call attached (``ShardState``) and the root's step's record of it.

``fully_shard`` attaches one ``ShardState`` to the module instance (an attribute; no class swap, no registry): the
modules, the unit (its parameters, unit.py, and its gradients, grads.py), the settings the ``fc.set_*`` functions
change. What one step did with the unit so far lives apart, in its ``UnitStepRecord``: the unit's own part of each
step (``begin_step``, ``open_for_forward``, the calls, ``close_opening``, ``end_backward``) is written by the methods
here, which the hooks and the step call; what one backward knows of it is set when the walk is built (step.py) and
moved on by the walk (backward.py). The settings outlive steps, the record is forgotten by each new one. A
``ForwardCall`` is the record of one forward call: which autograd nodes its backward runs.

This module is below the step: the hooks (hooks.py) make the root's ``step.StepContext`` at lazy init and keep it
on every state (``ShardState.step``) for the hooks to find; nothing here calls it. What a gather needs of the step
comes down as arguments (``start_gather``'s ``after_writes``) or is set at lazy init (``gather_stream``).
"""

from __future__ import annotations

import copy
import logging
import weakref
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from torch.autograd.graph import Node
from torch.distributed.device_mesh import DeviceMesh

from .collectives import wait_for_compute
from .grads import UnitGradients, gradient_node
from .policies import MixedPrecisionPolicy, PrefetchPoint
from .unit import UnitParams, UnitState

if TYPE_CHECKING:
    from .host_copy import HostCopies
    from .step import StepContext

logger = logging.getLogger(__name__)

__all__ = [
    "STATE_ATTR",
    "ForwardCall",
    "GradientAccumulation",
    "ShardState",
    "UnitStepRecord",
    "check_between_steps",
    "reshards_after_forward",
    "states_under",
]

GradientAccumulation = Literal["unsharded", "sharded"]

# Name of the instance attribute holding the state. A constant name, not a registry: the state lives and dies with
# the module (and is copied with it by copy.deepcopy).
STATE_ATTR = "_fsdp_compose_state"


def reshards_after_forward(setting: bool | int | None, *, is_root: bool) -> bool:
    """``reshard_after_forward`` as it acts: unset, every unit but the root frees its parameters after forward (the
    root's are needed first in backward)."""
    return (not is_root) if setting is None else bool(setting)


def states_under(module: nn.Module) -> list[ShardState]:
    """Every state on ``module`` and its submodules, in pre-order, each once (a list-form state appears once), each
    followed by its siblings (the parameters of one ``fully_shard`` call on other meshes)."""
    seen: set[int] = set()
    found = []
    for sub in module.modules():
        state = sub.__dict__.get(STATE_ATTR)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            found += state.members
    return found


def check_between_steps(states: list[ShardState], function: str) -> None:
    """Raise before any collective where a unit of ``states`` is inside a forward or a backward (``function``: the
    call that needs the units between steps, named in the error)."""
    for state in states:
        if state.record.active or (state.step is not None and state.step.backward is not None):
            raise RuntimeError(
                f"{function}: unit {state.params.owner_name} is inside a forward or a backward; call it between steps"
            )


class ForwardCall:
    """One forward call of one of a unit's modules whose outputs need gradients: what its backward will run.

    It holds the autograd nodes the unit added around the call weakly (a forward nobody runs backward for frees
    its graph as usual): ``pre``, one per output that needs grad (its backward is the unit's pre-backward), and
    ``post``, one per input that needs grad (once the last of them this backward runs has run, the unit's backward
    for this call is done). Autograd tells, at the start of a backward, whether it will run each of them: that is
    how a rank knows which units a backward uses before it uses them.

    One node per tensor, not one over all of them: a node with several outputs runs when any of them gets a gradient
    and hands zeros for the others. An output the loss ignores (or an input the unit ignores) would then feed zero
    gradients into the unit (or into what made the input), and autograd would count the parameters there as getting
    gradients (the backward's agreement): they must keep ``.grad = None``, as in single-process training.
    """

    __slots__ = ("always", "anchor", "grad_enabled", "inputs", "post", "posts_left", "pre", "seq")

    def __init__(self, seq: int = 0) -> None:
        self.seq = seq  # the root's count of calls in this step when this one began: forward order
        self.pre: list[weakref.ref[Node]] = []
        self.post: list[weakref.ref[Node]] = []
        # Input nodes still to run in this backward (set when the backward begins; the last one ends the call)
        self.posts_left = 0
        self.always = False  # no node to ask (outputs under a torch.func transform): taken as run by a backward
        # A call under no_grad on inputs that need grad: a reentrant activation checkpoint's forward, whose backward
        # recomputes it inside the backward (see ``UnitStepRecord.recomputes_due``). Its inputs, weakly.
        self.inputs: list[weakref.ref[torch.Tensor]] | None = None
        # Such a call whose inputs were made under no_grad too (inside the checkpoint's region): the root's call it
        # ran in, whose backward is the one that recomputes it.
        self.anchor: ForwardCall | None = None
        self.grad_enabled = torch.is_grad_enabled()

    def alive(self) -> bool:
        if self.anchor is not None:
            return self.anchor.alive()
        if self.inputs is not None:
            return any(ref() is not None for ref in self.inputs)
        return self.always or any(ref() is not None for ref in self.pre)

    def runs_in_this_backward(self, running: object = None) -> bool:
        """``running``: the node whose backward is running now (autograd does not count a backward's own root
        node among those it will execute). A recomputed call runs if the gradient of one of its inputs is computed
        (autograd cannot see inside the checkpoint before it recomputes)."""
        if self.always:
            return True
        if self.anchor is not None:
            return self.anchor.runs_in_this_backward(running)
        will_run = torch._C._will_engine_execute_node
        if self.inputs is not None:
            for input_ref in self.inputs:
                tensor = input_ref()
                input_node = None if tensor is None else gradient_node(tensor)
                if input_node is not None and (input_node is running or will_run(input_node)):
                    return True
            return False
        for ref in self.pre:  # the output nodes still alive (their graphs may run)
            node = ref()
            if node is not None and (node is running or will_run(node)):
                return True
        return False

    def outputs_pending(self) -> bool:
        """Does an output of this call still await its backward? A backward that used some outputs only (``o1``'s
        now, ``o2``'s in a later backward) leaves the call to the later one."""
        for ref in self.pre:
            node = ref()
            if node is not None and not getattr(node, "ran", False):
                return True
        return False

    def post_backward_runs(self) -> bool:
        """Will this backward end the call (run an input node)? Counts the input nodes it runs (``posts_left``)."""
        if self.inputs is not None:
            return True  # its recompute wraps the inputs it runs on
        will_run = torch._C._will_engine_execute_node
        runs = 0
        for ref in self.post:
            node = ref()
            if node is not None and will_run(node):
                runs += 1
        self.posts_left = runs
        return runs > 0


class UnitStepRecord:
    """What the root's step did with one unit so far: its forward's calls and graphs and its openings (written by
    ``ShardState``'s methods), and this backward's facts (set by ``StepContext._build_walk``, moved on by the walk).

    A step spans a forward and the backward(s) of its calls: a forward while a backward is pending keeps the
    pending ``entries`` and forgets only the forward's counts (``forget_forward``). Forgotten in place, never replaced:
    a root's pre-forward holds its record across ``begin_forward``, which may abandon the last step."""

    def __init__(self) -> None:
        # Full parameters kept across the last (no-sync) backward by reshard_after_backward=False.
        self.kept_unsharded = False
        self.recomputes_due = 0  # calls this backward recomputes (set by the step when it begins)
        self.forget_step()
        self.forget_backward()

    def forget_step(self) -> None:
        """Forget this step's forward: entries, open calls, casts."""
        self.entries: list[ForwardCall] = []  # forward calls whose backward has not run yet
        # Forward calls a backward of this step already ran: a backward through a retained graph
        # (``retain_graph=True``) runs them again, so the next backward asks autograd about them too.
        self.ran: list[ForwardCall] = []
        self.forget_forward()

    def forget_forward(self) -> None:
        self.active = 0  # calls of this unit's modules inside their forward right now
        self.entered = False  # gathered for forward in this root forward (or entered: see StepContext.reset)
        self.opened = False  # gathered for forward; closes when every module ran (or at the root's end of forward)
        self.opening_needs_backward = False  # some call of the current opening returned outputs that need grad
        self.pending_modules: set[int] = set()  # list form: modules not yet run in the current opening
        self.calls: dict[int, list[ForwardCall]] = {}  # module id -> entries of calls between pre- and post-forward
        self.full_precision_now = False
        self.incoming_dtype: dict[int, torch.dtype] = {}  # module id -> dtype its inputs had before the cast

    def forget_backward(self, wait_after: int = 0) -> None:
        """The running backward's facts about the unit: set by the step when the backward begins (for every unit of
        the root, ``step._build_walk``), then moved on by its walk (backward.py)."""
        self.position: int | None = None  # its step on the program's gather path; None: no part in this backward
        self.reached_here = False  # this rank's backward runs the unit
        self.calls_here = 0  # calls of it this backward runs here
        self.awaiting = 0  # post-backward hooks still to fire here (-1: only the final callback knows)
        # The gather position the cursor must have passed before a wait for its reduction may block (``make_room``)
        self.wait_after = wait_after
        self.gathered = False  # its backward all-gather was issued (by the cursor or a prefetch)
        self.done = False  # finished here: gradients staged or accumulated
        self.freed_early = 0  # bytes of its full parameters freed early
        # Its implicit prefetch, held back (``backward_prefetch_point`` midway or after): issued once
        # ``held_until_freed`` bytes of its full parameters are freed early (None: at its end), at its end at the latest
        self.held_prefetch: list[ShardState] = []
        self.held_until_freed: int | None = None
        self.landing: list[ShardState] = []  # what it prefetched midway: their all-gathers land at its end


class ShardState:
    """Everything one ``fully_shard`` call attached: its modules, its unit (``params`` and ``grads``), its settings;
    the step's record of it. Changes to the parameters that the gradients must follow (a cast, a trainability
    change, a tie moving out) go through here, the owner of both."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        params: UnitParams,
        mesh: DeviceMesh,
        device: torch.device,
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        auto_refresh_trainable: bool,
    ) -> None:
        self.modules = modules
        self.params = params
        self.grads = UnitGradients(params.reduce_spec(), params.shards.params)
        self.mesh = mesh
        self.device = device
        self.mp_policy = mp_policy
        self.auto_refresh_trainable = auto_refresh_trainable
        # Settings (changed through the fc.set_* functions).
        # None: decided at lazy init (the root keeps); an int k: keep 1/k per rank (see UnitParams.reshard_to_group)
        self.reshard_after_forward_setting = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.gradient_accumulation: GradientAccumulation = "unsharded"
        self.requires_all_reduce = True  # HSDP: all-reduce over replicas after the reduce-scatter
        self.full_precision_in_eval = False
        self.collective_checks = False  # fc.set_collective_checks: any unit under a root turns them on for it
        self.max_reduce_inputs = 1  # set_reduce_scatter_max_input_buffers: read on the root
        # Prefetch targets set with fc.set_modules_to_*_prefetch (None: implicit, from the declared schedule).
        self.forward_prefetch: list[ShardState] | None = None
        self.backward_prefetch: list[ShardState] | None = None
        self.backward_prefetch_point: PrefetchPoint = "midway"  # fc.set_backward_prefetch_point
        # FSDP2's set_unshard_in_backward(False): no backward all-gather (an embedding's backward reads no weight); a
        # backward that does read one is refused at the pre-backward (hooks.check_backward_reads_none_of).
        self.unshard_in_backward = True
        # Set at lazy init.
        self.root: ShardState | None = None
        self.step: StepContext | None = None  # the root's step, on every state under it (read by the hooks only)
        # The root's side stream for the all-gather copy-in (None on a CPU device)
        self.gather_stream: torch.Stream | None = None
        self.record = UnitStepRecord()
        self.host: HostCopies | None = None  # fc.move_to_host: its storages are in host memory, no forward until back
        # A mesh per parameter (``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult``): the parameters of
        # this call on other data-parallel meshes, each group a unit of its own on the same modules, right after this
        # one in every order (``states_under``). Only this state is on the modules; its hooks run every member's part.
        self.members: list[ShardState] = [self]  # this unit, then its siblings: what its hooks run (``add_siblings``)
        self.mesh_label = ""  # a sibling's: names its mesh beside the modules' paths (``program.unit_names``)

    @property
    def siblings(self) -> list[ShardState]:
        return self.members[1:]

    def add_siblings(self, siblings: list[ShardState]) -> None:
        self.members = [self, *siblings]

    # ------------------------------------------------------------------ root and settings as they act
    @property
    def reshard_after_forward(self) -> bool:
        return reshards_after_forward(self.reshard_after_forward_setting, is_root=self.root is self)

    @property
    def reduces_now(self) -> bool:
        """Reduce in this backward: when syncing, and on every micro-batch in sharded accumulation mode."""
        return self.requires_gradient_sync or self.gradient_accumulation == "sharded"

    @property
    def gradients_final(self) -> bool:
        """This backward delivers final gradients (an optimizer step may follow): synced, and all-reduced over
        replicas where there are any."""
        replicas = self.params.dp.replicate_group is not None
        return self.requires_gradient_sync and (self.requires_all_reduce or not replicas)

    # ------------------------------------------------------------------ gathering
    def compute_dtype(self, module: nn.Module) -> torch.dtype:
        """The dtype ``module`` computes in now: the policy's ``param_dtype``, else the parameters' own dtype (also
        in eval under ``full_precision_in_eval``)."""
        own = self.params.shards.dtype
        if self.full_precision_in_eval and not module.training:
            return own
        return self.mp_policy.param_dtype or own

    def start_gather(self, *, async_op: bool, dtype: torch.dtype | None = None, after_writes: bool = False) -> None:
        """Issue this unit's all-gather in its compute dtype if it needs one (or is gathered in another dtype).

        ``dtype``: the compute dtype of the module being entered (default: the unit's first module's);
        ``after_writes``: outside the root's forward and backward, where the compute stream may have written the
        shards since the step's start ordered the side stream after it."""
        if dtype is None:
            dtype = self.compute_dtype(self.modules[0])
        params = self.params
        if params.state is not UnitState.SHARDED and params.compute_dtype != dtype:
            params.reshard()  # e.g. prefetched in fp32 by an eval forward: its backward needs the bf16 tensors
        changed = params.state is UnitState.SHARDED and self.params_changed()
        if changed:
            self.adopt_changes()  # changed since the step began: a gather outside the root's forward
        if params.needs_gather or params.parked is not None:  # parked: taken back (no collective) unless stale
            # On the side stream, which waited for the compute stream at the step's start: again where the shards
            # may have been written since.
            stream = self.gather_stream
            if stream is not None and (changed or after_writes):
                wait_for_compute(stream, params.device)
            params.start(dtype, async_op=async_op, stream=stream)

    def gather_now(self, *, after_writes: bool = False) -> None:
        self.start_gather(async_op=False, after_writes=after_writes)
        self.params.finish()

    def params_changed(self) -> bool:
        """Did the user change a parameter of this unit since the last step: replace or cast it (the module holds
        another object, or the sharded parameter no longer views the unit's flat buffer), flip its
        ``requires_grad``, or attach FSDP2's all-gather hooks? One identity pass over the parameters at every step
        start; what a change means is ``adopt_changes`` and ``refresh_trainable``."""
        shards = self.params.shards
        return shards.defer_hookless or not shards.unchanged(gathered=self.params.state is not UnitState.SHARDED)

    def adopt_changes(self) -> None:
        """Pick up parameters replaced or cast since the last gather (``UnitParams.adopt_if_changed``); a cast
        rebuilds the gradient side in the new dtype."""
        before = self.params.shards.dtype
        self.params.adopt_if_changed()
        if self.params.shards.dtype != before:
            if self.grads.has_pending():
                raise RuntimeError(
                    f"the parameters of {self.params.owner_name} were cast from {before} to "
                    f"{self.params.shards.dtype} while no-sync gradients are pending; cast the model between "
                    "optimizer steps"
                )
            self.grads = self.grads.rebuilt(self.params.reduce_spec(), self.params.shards.params)

    def refresh_trainable(self) -> bool:
        """Catch up with ``requires_grad`` changes (``UnitParams.apply_trainability``) and lay the gradient side out
        for them. Returns whether anything changed."""
        params = self.params
        if not params.trainability_changed():
            return False
        if self.grads.has_pending():
            self.grads.refresh(params.shards.params)  # raises: gradients from no-sync micro-batches would be lost
        params.apply_trainability()
        self.grads.refresh(params.shards.params)
        spec = params.reduce_spec()
        if spec != self.grads.spec:  # a unit of several dtypes: which are trainable decides the reduce dtype
            self.grads = self.grads.rebuilt(spec, params.shards.params)
        return True

    def release(self, original: nn.Parameter) -> list[tuple[nn.Module, str]]:
        """Stop managing the parameter that replaced ``original``: it moves to an enclosing unit (a tie). Returns the
        (module, attribute) pairs that held it."""
        if self.params.state is not UnitState.SHARDED or self.grads.has_pending():
            raise RuntimeError(f"cannot move a tied parameter out of {self.params.owner_name} while it is in use")
        owners = self.params.shards.release(original).owners
        self.grads.refresh(self.params.shards.params)
        return owners

    # ------------------------------------------------------------------ the unit's part of the step
    # Called by the root's step (step.py) and the module hooks (hooks.py); each writes the unit's record and decides
    # the unit's reshard for its reason.
    def begin_step(self, *, continuing: bool) -> None:
        """The root's pre-forward: anything left gathered is freed (a prefetch nobody used, parameters kept after a
        forward, a group block), the same on every rank whatever its garbage collector did with old graphs, unless
        kept by policy (``kept_unsharded``, parked), or by ``fc.unshard`` (``explicit``); then pick up the user's
        changes.
        ``continuing``: a forward while this step's backward is pending keeps the pending entries."""
        self.grads.drop_if_user_zeroed()
        if not (self.params.explicit or self.record.kept_unsharded or self.params.parked is not None):
            self.params.reshard()
        if continuing:
            self.record.forget_forward()
        else:
            self.record.forget_step()
        if self.params_changed():
            self.adopt_changes()  # e.g. model.to(dtype) since the last step: its dtype is the compute dtype now
            if self.auto_refresh_trainable and self.refresh_trainable():
                logger.debug("trainability of %s changed: refreshed", self.params.owner_name)

    def open_for_forward(self, module: nn.Module, compute_dtype: torch.dtype, *, after_writes: bool) -> None:
        """Gather the unit for forward (a no-op when it is gathered already) for a call of ``module``
        (``after_writes``: see ``start_gather``)."""
        params, record = self.params, self.record
        record.full_precision_now = self.full_precision_in_eval and not module.training
        # Kept unsharded since an in-place update: gather again (start_gather does so for another precision too).
        if params.state is UnitState.UNSHARDED and params.is_stale():
            params.reshard()
        params.explicit = False  # an fc.unshard issued before this forward is consumed here
        record.kept_unsharded = False
        self.start_gather(async_op=False, dtype=compute_dtype, after_writes=after_writes)
        params.finish()
        self.grads.accumulating = not self.reduces_now  # after the gather: a cast adopted there rebuilt the grads
        self.grads.input.note_accumulators()
        record.opened = record.entered = True
        record.opening_needs_backward = False
        record.pending_modules = set(map(id, self.modules))

    def enter_call(self, module: nn.Module, entry: ForwardCall) -> None:
        """A call of ``module`` began (the unit is open for it): count it and keep its entry until its post-forward."""
        record = self.record
        record.pending_modules.discard(id(module))
        record.active += 1
        record.calls.setdefault(id(module), []).append(entry)

    def leave_call(self, module: nn.Module) -> ForwardCall | None:
        """The post-forward of a call of ``module``: its entry (None where its pre-forward did not run)."""
        record = self.record
        calls = record.calls.get(id(module))
        if not calls or record.active == 0:
            return None
        record.active -= 1
        return calls.pop()

    def expect_backward(self, entry: ForwardCall) -> None:
        """The call's outputs need grad: a backward will use the unit for it."""
        self.record.entries.append(entry)
        self.record.opening_needs_backward = True

    def close_if_done(self) -> None:
        """No call of the unit is running and every module of its opening ran: it closes."""
        if self.record.active == 0 and not self.record.pending_modules:
            self.close_opening()

    def enter_recompute(self, module: nn.Module) -> bool:
        """A forward inside a backward (an activation checkpoint's recompute) computes as the original call did: a
        full-precision eval forward since must not leave its precision to it, whose outputs would then differ in
        dtype. Returns whether it is a reentrant checkpoint's recompute, whose own backward ends the call's."""
        record = self.record
        record.full_precision_now = self.full_precision_in_eval and not module.training
        if record.recomputes_due and torch.is_grad_enabled():
            record.recomputes_due -= 1
            return True
        return False

    def close_opening(self) -> None:
        """The unit's current opening for forward ends (every module of it ran, or the root's forward ended): reshard
        per ``reshard_after_forward``.

        Where no backward can follow (``generate``'s decoding forwards, an evaluation) every unit reshards, but one
        set to keep its parameters (``reshard_after_forward=False`` given, not the root's default) parks them
        (``UnitParams.park``): the module holds its sharded parameters again, and the next forward takes the full
        ones back without an all-gather unless the shards changed in place since (an optimizer step, a load).
        torch's ``fully_shard`` keeps such a unit gathered and never gathers it again: stale weights after an
        optimizer step."""
        record = self.record
        if not record.opened:
            return
        record.opened = False
        record.pending_modules = set()
        if record.opening_needs_backward:
            if not self.reshard_after_forward:
                return  # kept for its backward
            if self.params.post_forward is not None:
                self.params.reshard_to_group()
            else:
                self.params.reshard()
        elif self.reshard_after_forward_setting is not None and not self.reshard_after_forward:
            self.params.park()
        else:
            self.params.reshard()

    def keep_for_next_forward(self) -> None:
        """A unit still gathered by a forward whose backward has not run yet stays gathered through the next root
        forward (a pipeline stage's next micro-batch), as FSDP2 keeps it: that forward would free and gather it
        again."""
        if self.record.entries and self.params.state is UnitState.UNSHARDED:
            self.record.kept_unsharded = True

    def end_backward(self, consumed: set[int]) -> None:
        """The final callback, for a unit that took part: settle its gradients, reshard (or keep), and move the calls
        this backward ran (``consumed``) out of the pending entries."""
        grads, params, record = self.grads, self.params, self.record
        grads.delivery.settle()  # the one point where the host waits for device-to-host copies of gradients
        if grads.has_pending():  # held past this backward (no-sync): ``.grad`` tells if the user drops them
            grads.delivery.mark_held()
        # Full parameters stay across a backward only where asked and no optimizer step can follow it: a step's
        # update through ``.data`` would bump no version counter to tell they are stale.
        keep = not self.reshard_after_backward and not self.gradients_final
        if not keep:
            params.reshard()
        params.finish()  # a prefetch never needed here
        record.kept_unsharded = keep and params.state is UnitState.UNSHARDED
        # The calls this backward ran are consumed; calls it did not run wait for a later backward (a chunked loss
        # runs the head's backward once per chunk, then the body's).
        finished = [e for e in record.entries if id(e) in consumed and not e.outputs_pending()]
        record.ran += finished
        record.entries = [e for e in record.entries if e not in finished]
        params.shards.replaced.arm()  # an optimizer built before fully_shard fails at its step

    def forget_step(self) -> None:
        """The step is over without its final callback (it raised, or ``fc.reset_step``): sharded, nothing kept."""
        self.params.reshard()
        self.record.forget_step()
        self.record.kept_unsharded = False

    def __repr__(self) -> str:
        modules = ", ".join(type(m).__name__ for m in self.modules)
        root = None if self.root is None else self.root is self  # None: decided at the first forward
        phase = "forward" if self.record.active else "awaiting_backward" if self.record.entries else "idle"
        return f"ShardState([{modules}], root={root}, phase={phase}, params={self.params!r})"

    # ------------------------------------------------------------------ copy.deepcopy
    def __deepcopy__(self, memo: dict[int, Any]) -> ShardState:
        if self.host is not None:
            raise RuntimeError(
                f"copy.deepcopy of a module whose unit {self.params.owner_name} is in host memory (fc.move_to_host); "
                "call fc.move_to_device(model) first"
            )
        new = object.__new__(ShardState)
        memo[id(self)] = new
        new.__dict__.update(self.__dict__)
        new.params = self.params.copy_for(memo)
        new.grads = UnitGradients(new.params.reduce_spec(), new.params.shards.params)
        new.grads.take_settings(self.grads)
        new.modules = tuple(copy.deepcopy(m, memo) for m in self.modules)
        new.add_siblings([copy.deepcopy(sibling, memo) for sibling in self.siblings])
        new.forward_prefetch = copy.deepcopy(self.forward_prefetch, memo)
        new.backward_prefetch = copy.deepcopy(self.backward_prefetch, memo)
        new.root = None
        new.step = None
        new.gather_stream = None
        new.host = None
        new.record = UnitStepRecord()
        return new
