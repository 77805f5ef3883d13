"""Collectives are seen by code that patches ``torch.distributed``, and ``fc.CollectiveRecorder`` records them.

Torch's FSDP2 tests (``common_fsdp.patch_all_gather`` / ``patch_reduce_scatter`` / ``patch_all_reduce``) replace
``torch.distributed``'s functions to count or check collectives; fsdp_compose looks the functions up at every call,
so such a replacement sees every collective of a step, as it does under torch's ``fully_shard``. The tests train the
same model with both libraries in one process under the same patching, and compare the calls counted and the
parameters after the steps; torch's deprecated names are never called by fsdp_compose (no ``FutureWarning``).
"""

from __future__ import annotations

import copy
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

import fsdp_compose as fc
from examples.gpt_model import GPT, GPTConfig, loss_fn, synthetic_batch
from tests.dist_utils import full_value, local_batch, mesh_1d, mesh_nd

CFG = GPTConfig(vocab_size=32, seq_len=8, dim=16, n_layers=2, n_heads=2)
NEW_NAMES = ("all_gather_single", "reduce_scatter_single", "all_reduce")  # torch 2.13's, as common_fsdp patches
OLD_NAMES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")  # the names before torch 2.13
STEPS = 2


def _mesh(ws: int, kind: str) -> DeviceMesh:
    return mesh_1d(ws) if kind == "fsdp" else mesh_nd((2, ws // 2), ("replicate", "shard"))


def _sharded(impl: str, mesh: DeviceMesh, model: GPT) -> GPT:
    shard = fc.fully_shard if impl == "fc" else torch_fully_shard
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


@contextmanager
def _patched(names: tuple[str, ...], counts: Counter[str]) -> Iterator[None]:
    """What torch's common_fsdp.patch_* do: replace the functions on ``torch.distributed``, restore them after."""
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor", kwargs.get("output")))
            integer = isinstance(tensor, torch.Tensor) and not tensor.is_floating_point()
            counts[f"{name} (integer)" if integer else name] += 1
            return original(*args, **kwargs)

        return wrapper

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _train(model: GPT, rank: int, ws: int, counts: Counter[str], names: tuple[str, ...]) -> None:
    """``STEPS`` steps, forward and backward under the patching; every rank (HSDP too) has its own slice."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        inputs, targets = synthetic_batch(CFG, 2 * ws, step=step)
        with _patched(names, counts):
            loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws)).backward()
        opt.step()
        opt.zero_grad()


def _side_by_side(rank: int, ws: int, kind: str, names: tuple[str, ...]) -> dict[str, Any]:
    mesh = _mesh(ws, kind)
    torch.manual_seed(0)
    reference = GPT(CFG)
    counts: dict[str, Counter[str]] = {}
    models: dict[str, GPT] = {}
    deprecated: list[str] = []
    for impl in ("torch", "fc"):
        counts[impl] = Counter()
        models[impl] = _sharded(impl, mesh, copy.deepcopy(reference))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _train(models[impl], rank, ws, counts[impl], names)
        if impl == "fc":
            deprecated = [str(w.message) for w in seen if issubclass(w.category, FutureWarning)]
    torch_params = dict(models["torch"].named_parameters())
    diff = max(
        (full_value(p.detach()) - full_value(torch_params[name].detach())).abs().max().item()
        for name, p in models["fc"].named_parameters()
    )
    return {"torch": dict(counts["torch"]), "fc": dict(counts["fc"]), "diff": diff, "deprecated": deprecated}


def _agreements(counts: dict[str, int]) -> tuple[dict[str, int], int]:
    """The counts without fsdp_compose's per-backward agreement and closing word (all-reduces of a few integers over
    the root's data-parallel ranks: which units take part, did a rank abandon it), and how many of those there were."""
    agreements = counts.get("all_reduce (integer)", 0)
    return {name: n for name, n in counts.items() if name != "all_reduce (integer)"}, agreements


@pytest.mark.parametrize(("ws", "kind"), [(1, "fsdp"), (2, "fsdp"), (4, "fsdp"), (4, "hsdp")])
def test_patched_torch_distributed_sees_every_collective(run_dist, ws: int, kind: str) -> None:
    """Under the same patching, fsdp_compose's step calls the patched functions as often as torch's fully_shard for
    every all-gather, reduce-scatter and gradient all-reduce; on top, two small integer all-reduces per backward
    (the agreement and the closing word; torch has none)."""
    for result in run_dist(ws, _side_by_side, kind, NEW_NAMES):
        fc_counts, agreements = _agreements(result["fc"])
        assert fc_counts == result["torch"], result
        if ws == 1:  # neither library communicates on a group of one
            assert result["fc"] == {}
        else:
            assert fc_counts["all_gather_single"] > 0 and fc_counts["reduce_scatter_single"] > 0
            assert agreements == 2 * STEPS  # the agreement and the closing word, over the flattened mesh
        assert fc_counts.get("all_reduce", 0) == (STEPS * (CFG.n_layers + 1) if kind == "hsdp" else 0)
        assert result["diff"] <= 1e-5
        assert result["deprecated"] == []


def test_patching_the_older_names_is_seen_too(run_dist) -> None:
    """Replacing only ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` (what FSDP2's tests did before torch
    2.13) is seen by fsdp_compose as well; torch 2.13's own fully_shard calls the new names, so it sees none of
    them there."""
    new = run_dist(2, _side_by_side, "fsdp", NEW_NAMES)[0]
    old = run_dist(2, _side_by_side, "fsdp", OLD_NAMES)[0]
    assert old["fc"]["all_gather_into_tensor"] == new["fc"]["all_gather_single"] > 0  # both seen, as often
    assert old["fc"]["reduce_scatter_tensor"] == new["fc"]["reduce_scatter_single"] > 0
    assert old["diff"] <= 1e-5
    if hasattr(dist, "all_gather_single"):
        assert "all_gather_into_tensor" not in old["torch"]


# ---------------------------------------------------------------------------------- the recorder itself
def _recorded(rank: int, ws: int, kind: str) -> dict[str, Any]:
    mesh = _mesh(ws, kind)
    torch.manual_seed(0)
    reference = GPT(CFG)
    originals = {name: getattr(dist, name) for name in (*NEW_NAMES, *OLD_NAMES, "broadcast")}
    functional_originals = {name: getattr(funcol, name) for name in ("all_gather_single", "all_reduce")}
    result: dict[str, Any] = {}
    for impl in ("torch", "fc"):
        model = _sharded(impl, mesh, copy.deepcopy(reference))
        inputs, targets = synthetic_batch(CFG, 2 * ws, step=0)
        with fc.CollectiveRecorder() as outer:
            with outer.labelled("forward"):
                loss = loss_fn(model(local_batch(inputs, rank, ws)), local_batch(targets, rank, ws))
            with fc.CollectiveRecorder() as inner, outer.labelled("backward"):
                loss.backward()
        fsdp = [r for r in outer.records if r.dtype.is_floating_point]  # fc's integer agreement left out
        result[impl] = {
            "counts": dict(Counter(r.kind for r in fsdp)),
            "labels": dict(Counter((r.label, r.kind) for r in fsdp)),
            "agreements": [(r.kind, r.dtype, r.nbytes) for r in outer.records if not r.dtype.is_floating_point],
            "inner": [(r.kind, r.group, r.nbytes) for r in inner.records],
            "outer_backward": [(r.kind, r.group, r.nbytes) for r in outer.records if r.label == "backward"],
            "summary": outer.summary(),
            "sizes": sorted({(r.kind, r.group_size) for r in outer.records}),
            "dtypes": sorted({str(r.dtype) for r in outer.records}),
        }
    result["restored"] = all(getattr(dist, n) is f for n, f in originals.items()) and all(
        getattr(funcol, n) is f for n, f in functional_originals.items()
    )
    full = torch.arange(4.0 * ws).reshape(2 * ws, 2)
    sharded = distribute_tensor(full, mesh_1d(ws), [Shard(0)])
    with fc.CollectiveRecorder() as functional:
        gathered = sharded.full_tensor()
    result["functional"] = [(r.kind, r.nbytes, r.functional, r.group_size) for r in functional.records]
    result["gathered_ok"] = torch.equal(gathered, full)
    return result


@pytest.mark.parametrize(("ws", "kind"), [(2, "fsdp"), (4, "hsdp")])
def test_recorder_counts_a_step_of_either_library(run_dist, ws: int, kind: str) -> None:
    shard_size = ws if kind == "fsdp" else ws // 2
    for result in run_dist(ws, _recorded, kind):
        fc_rec, torch_rec = result["fc"], result["torch"]
        assert fc_rec["counts"] == torch_rec["counts"]
        assert fc_rec["labels"] == torch_rec["labels"]
        assert fc_rec["counts"]["all_gather"] > 0 and fc_rec["counts"]["reduce_scatter"] == CFG.n_layers + 1
        assert fc_rec["counts"].get("all_reduce", 0) == (CFG.n_layers + 1 if kind == "hsdp" else 0)
        assert (("all_gather", shard_size) in fc_rec["sizes"]) and (("reduce_scatter", shard_size) in fc_rec["sizes"])
        assert set(fc_rec["dtypes"]) <= {"torch.float32", "torch.int64"} and torch_rec["dtypes"] == ["torch.float32"]
        assert torch_rec["agreements"] == [] and all(nbytes <= 1024 for _, _, nbytes in fc_rec["agreements"])
        for rec in (fc_rec, torch_rec):
            assert rec["inner"] == rec["outer_backward"]  # nested recorders both see every call
        assert result["restored"]
        assert result["functional"] == [("all_gather", 4 * ws * 4, True, ws)]
        assert result["gathered_ok"]
