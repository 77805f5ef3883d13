"""``fc.ported(...)``: each port replaces exactly its attributes for the ``with`` block and restores the very same
objects on exit (also when the block raises); a nested port of the same attributes is refused; the replacements act
on fsdp_compose's modules and leave everything else to the trainer's original code. The ports' effect on training
is measured through each trainer's own entry point in tests/integration/ (test_accelerate.py,
test_hf_trainer_fsdp2.py, test_hf_trainer.py, test_lightning.py)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import fsdp_compose as fc
from fsdp_compose.integrations.ports import PORTS
from fsdp_compose.state import states_under
from tests.dist_utils import mesh_1d


def _current(module_name: str, path: str) -> Any:
    owner: Any = importlib.import_module(module_name)
    *parents, name = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    return owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)


def _needs(port: str) -> None:
    for module_name, _, _ in PORTS[port]:
        pytest.importorskip(module_name.split(".")[0])
        pytest.importorskip(module_name)


@pytest.mark.parametrize("port", sorted(PORTS))
def test_a_port_replaces_its_attributes_and_restores_the_same_objects(port: str) -> None:
    _needs(port)
    before = {(m, p): _current(m, p) for m, p, _ in PORTS[port]}
    with pytest.raises(KeyError), fc.ported(port):
        for (module_name, path), original in before.items():
            assert _current(module_name, path) is not original, path
        raise KeyError("the block raises")
    for (module_name, path), original in before.items():
        assert _current(module_name, path) is original, path


def test_nested_ports_of_the_same_attributes_are_refused_and_the_outer_one_is_restored() -> None:
    _needs("transformers")
    original = torch_fsdp.fully_shard
    with fc.ported("transformers"):
        with pytest.raises(RuntimeError, match="already replaced"), fc.ported("accelerate"):
            pass
        assert torch_fsdp.fully_shard is not original
    assert torch_fsdp.fully_shard is original


def test_unknown_names_are_refused_before_anything_changes() -> None:
    original = torch_fsdp.fully_shard
    for names in [(), ("acelerate",), ("accelerate", "deepspeed")]:
        with pytest.raises(ValueError, match="expected one or more of"), fc.ported(*names):
            pass
        assert torch_fsdp.fully_shard is original


class Net(nn.Sequential):
    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self[1](self[0](x))  # the root's own layer used outside forward: needs the registration


def _replacements(rank: int, ws: int) -> dict[str, Any]:
    """What the replaced names do on a module fsdp_compose sharded, and on one it did not."""
    from accelerate.accelerator import fsdp2_prepare_model
    from lightning.fabric.strategies.model_parallel import _FSDPNoSync

    mesh = mesh_1d(ws)
    torch.manual_seed(0)
    plain = Net(nn.Linear(4, 4), nn.Linear(4, 4))
    sharded = copy.deepcopy(plain)
    fc.fully_shard(sharded[0], mesh=mesh)
    fc.fully_shard(sharded, mesh=mesh)
    out: dict[str, Any] = {}
    with fc.ported("transformers", "lightning"):
        by_name = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)  # what accelerate gets from torch's name
        out["fully_shard"] = fc.is_fully_sharded(by_name) and fc.has_fsdp2_methods(by_name)
        import accelerate.accelerator

        out["prepare_returns_it"] = accelerate.accelerator.fsdp2_prepare_model(None, sharded) is sharded
        torch_fsdp.register_fsdp_forward_method(sharded, "generate")
        torch_fsdp.register_fsdp_forward_method(plain, "generate")  # torch's no-op for a module nobody sharded
        out["registered"] = ["generate" in vars(sharded), "generate" in vars(plain)]
        from transformers.trainer import is_fsdp_managed_module

        out["managed"] = [is_fsdp_managed_module(sharded), is_fsdp_managed_module(plain)]
        with _FSDPNoSync(module=sharded, enabled=True):
            out["sync_inside"] = [s.requires_gradient_sync for s in states_under(sharded)]
        out["sync_after"] = [s.requires_gradient_sync for s in states_under(sharded)]
    out["prepare_restored"] = accelerate.accelerator.fsdp2_prepare_model is fsdp2_prepare_model
    x = torch.randn(2, 4)
    with torch.no_grad():
        out["generate"] = (sharded.generate(x) - plain.generate(x)).abs().max().item()  # registered: runs
    return out


def test_the_replacements_act_on_fsdp_compose_modules_only(run_dist) -> None:
    for name in ("accelerate", "transformers", "lightning"):
        _needs(name)
    for out in run_dist(2, _replacements):
        assert out["fully_shard"] and out["prepare_returns_it"] and out["prepare_restored"]
        assert out["registered"] == [True, False]
        assert out["managed"] == [True, False]
        assert out["sync_inside"] == [False, False] and out["sync_after"] == [True, True]
        assert out["generate"] == 0.0


def _olmo_core_guards(rank: int, ws: int) -> dict[str, Any]:
    """OLMo-core's ``fully_shard`` and ``FSDPModule`` names inside the port, on modules each library sharded."""
    import olmo_core.nn.transformer.block as block
    import olmo_core.nn.transformer.model as model
    import olmo_core.train.train_module.transformer.train_module as train_module

    mesh = mesh_1d(ws)
    torch.manual_seed(0)
    theirs = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    bare = fc.fully_shard(nn.Linear(4, 4), mesh=mesh)  # no FSDP2 methods: a guard calling them must skip it
    plain = nn.Linear(4, 4)
    out: dict[str, Any] = {}
    with fc.ported("olmo_core"):
        ours = [model.fully_shard(nn.Linear(4, 4), mesh=mesh), block.fully_shard(nn.Linear(4, 4), mesh=mesh)]
        out["sharded"] = [fc.is_fully_sharded(m) and fc.has_fsdp2_methods(m) for m in ours]
        for name, source in (("model", model), ("train_module", train_module)):
            out[name] = [isinstance(m, source.FSDPModule) for m in (*ours, theirs, bare, plain, None)]
            out[f"{name}_subclass"] = [issubclass(type(m), source.FSDPModule) for m in (theirs, plain)]
    return out


def test_the_olmo_core_port_shards_with_methods_and_its_guards_recognise_them(run_dist) -> None:
    _needs("olmo_core")
    for out in run_dist(2, _olmo_core_guards):
        assert out["sharded"] == [True, True]
        for name in ("model", "train_module"):
            assert out[name] == [True, True, True, False, False, False], name  # torch's answer for the others
            assert out[f"{name}_subclass"] == [True, False], name


def test_the_docs_olmo_core_diff_removes_lines_of_the_installed_source() -> None:
    """docs/integrations.md's OLMo-core diff (what the port does, as source edits) against OLMo-core's installed
    files: every removed line is there, and the diff changes as many lines as the port replaces attributes."""
    _needs("olmo_core")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    section = (root / "docs" / "integrations.md").read_text().split("## OLMo-core", 1)[1]
    diff = section.split("```diff\n", 1)[1].split("```", 1)[0].splitlines()
    package = Path(importlib.import_module("olmo_core").__file__).parent  # type: ignore[arg-type]
    removed: list[tuple[str, str]] = []
    current = ""
    for line in diff:
        if line.startswith("--- "):
            current = line.removeprefix("--- a/src/olmo_core/")
        elif line.startswith("-"):
            removed.append((current, line[1:]))
    assert len(removed) == len(PORTS["olmo_core"])
    for path, line in removed:
        assert (package / path).read_text().splitlines().count(line) == 1, (path, line)
