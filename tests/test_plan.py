"""The planner (``fsdp_compose.plan``): simulated ranks against real gloo runs, the closed-form state and peak
model, and the CLI.

The planner runs in this (pytest) process on torch's fake process group; the real runs use the gloo pools. Both
measure with the same harness (``measure_step``), so any difference comes from the simulation itself.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import DataDependentOutputException

import fsdp_compose.plan as fp
from fsdp_compose.plan.__main__ import main as plan_cli
from fsdp_compose.plan.analytic import segment_numel, sharded_state
from fsdp_compose.plan.models import GPT, GPTConfig
from fsdp_compose.plan.simulate import fake_process_group, fake_tensors
from fsdp_compose.plan.step import ParamInfo, PlanConfig, build_mesh, measure_step, measure_steps
from tests.dist_utils import mesh_nd

SMALL_GPT = {"dim": 24, "n_heads": 2, "vocab_size": 61, "n_layers": 2, "seq_len": 11}
SMALL_MOE = {"dim": 24, "n_heads": 2, "n_kv_heads": 1, "vocab_size": 61, "n_layers": 2, "expert_ffn_dim": 16}


# gloo's worker thread lets go of a finished collective's tensors after Work.wait has returned, so a real phase peak
# can only come out above the same step with the release at the wait (the planner's model): seen up to +27% of a
# tiny model's forward, 1 step in 8 at 4 ranks on 2 cores. The lowest of a few steps is compared with the plan.
GLOO_STEPS = 3


def _gloo_steps(rank: int, world_size: int, config: PlanConfig) -> list[dict[str, Any]]:
    """``GLOO_STEPS`` measured steps on this gloo rank (the mesh is cached per worker, as the other tests do)."""
    dims = config.mesh_dims()
    mesh = mesh_nd(tuple(dims.values()), tuple(dims))
    records = measure_steps(replace(config, rank=rank), build_mesh(config, mesh=mesh), steps=GLOO_STEPS)
    return [record.as_dict() for record in records]


PARITY = {
    "1d-2": PlanConfig(model="gpt", model_args=SMALL_GPT, world_size=2, batch_size=2),
    "1d-4-bf16-sgd-reshard2": PlanConfig(
        model="gpt",
        model_args=SMALL_GPT,
        world_size=4,
        batch_size=2,
        optimizer="sgd-momentum",
        param_dtype="bf16",
        reduce_dtype="fp32",
        reshard_after_forward=2,
    ),
    "hsdp-2x2": PlanConfig(model="gpt", model_args=SMALL_GPT, world_size=4, replicate=2, batch_size=2),
    "tp-2x2": PlanConfig(model="gpt", model_args=SMALL_GPT, world_size=4, tp=2, batch_size=2),
    # experts on their own mesh: whole experts (Shard(0)) over efsdp 2; 2 experts, one per ep rank (Shard(1))
    "moe-ep2-4": PlanConfig(model="moe", model_args=SMALL_MOE, world_size=4, ep=2, batch_size=2, seq_len=11),
    "moe-ep2-4-shard1": PlanConfig(
        model="moe", model_args={**SMALL_MOE, "num_experts": 2}, world_size=4, ep=2, batch_size=2, seq_len=11
    ),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_planner_matches_gloo_run(run_dist: Any, name: str) -> None:
    config = PARITY[name]
    real = run_dist(config.world_size, _gloo_steps, config)
    ranks = (0, config.world_size - 1) if name.startswith("1d-4") else (0,)
    planned_peaks = []
    for rank in ranks:
        planned = fp.plan(replace(config, rank=rank)).record
        planned_peaks.append(planned.peak_bytes)
        for phase in planned.peaks:
            lowest = min(step["peaks"][phase] for step in real[rank])
            # 10%: the planner's fake collectives complete at once; on gloo a reduce-scatter still running when the
            # next unit's gradients are staged keeps its input alive a little longer (seen: +6.7% in one phase of
            # the 2x2 TP case on a loaded machine; exact when quiet)
            assert planned.peaks[phase] == pytest.approx(lowest, rel=0.10), (rank, phase)
        for measured in real[rank]:
            assert planned.collectives.keys() == measured["collectives"].keys()
            for kind, groups in measured["collectives"].items():
                assert planned.collectives[kind].keys() == groups.keys(), kind
                for group, figures in groups.items():
                    assert planned.collectives[kind][group]["calls"] == figures["calls"], (kind, group)
                    assert planned.collectives[kind][group]["bytes"] == pytest.approx(figures["bytes"], rel=0.05)
            for field in ("sharded_param_bytes", "grad_bytes", "optimizer_bytes"):
                assert getattr(planned, field) == measured[field], field
            assert planned.meshes == measured["meshes"]
    # rank 0 holds the most rows (torch.chunk): the planner's default rank bounds every rank's peak. Within 15%, not
    # 5%: a reduce-scatter's input is freed as soon as it has completed, which on a loaded machine can be one unit
    # later on one rank than on another (seen: +10% on one rank of the 2x2 HSDP case, whose unit buffers are large
    # next to its small model)
    lowest_step_peaks = [min(max(step["peaks"].values()) for step in steps) for steps in real]
    assert max(lowest_step_peaks) <= planned_peaks[0] * 1.15


def test_watched_refresh_equals_full_refresh() -> None:
    """The planner re-reads only the storages that can change size outside ops; re-reading all gives the same."""
    config = PlanConfig(model="gpt", model_args={**SMALL_GPT, "n_layers": 1}, world_size=16, batch_size=2)
    records = []
    for refresh in ("all", "watched"):
        with fake_process_group(config.world_size):
            mesh = build_mesh(config)
            with fake_tensors():
                records.append(measure_step(config, mesh, fake=True, refresh=refresh))  # type: ignore[arg-type]
    assert records[0].peaks == records[1].peaks
    assert records[0].breakdown == records[1].breakdown


# ---------------------------------------------------------------------- closed forms
def _chunk_rows(dim0: int, world_size: int, rank: int) -> int:
    chunks = torch.empty(dim0, 0).chunk(world_size)  # torch.chunk's own split (may give fewer chunks)
    return chunks[rank].shape[0] if rank < len(chunks) else 0


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.lists(st.integers(1, 70), min_size=1, max_size=3), min_size=1, max_size=6),
    world_size=st.integers(1, 1024),
    data=st.data(),
)
def test_state_formula_is_torch_chunk_padded(shapes: list[list[int]], world_size: int, data: Any) -> None:
    """Parameters: every rank's rows padded to ceil(dim0 / W); optimizer state: the rank's real torch.chunk rows."""
    rank = data.draw(st.integers(0, world_size - 1))
    infos = [ParamInfo(tuple(shape), torch.float32, True) for shape in shapes]
    state = sharded_state({"u": infos}, PlanConfig(world_size=world_size, rank=rank))
    rest = [math.prod(shape[1:]) for shape in shapes]
    assert state.params == sum(-(-s[0] // world_size) * r * 4 for s, r in zip(shapes, rest, strict=True))
    assert state.grads == state.params  # the reduce-scatter output: no "had a gradient" flags (none 0-dim here)
    local = sum(_chunk_rows(s[0], world_size, rank) * r for s, r in zip(shapes, rest, strict=True))
    assert state.optimizer == 2 * 4 * local + 4 * len(shapes)  # AdamW: exp_avg, exp_avg_sq, step


gpt_shapes = st.fixed_dictionaries(
    {
        "n_heads": st.integers(1, 4),
        "head_dim": st.integers(1, 12).map(lambda x: 2 * x),
        "vocab_size": st.integers(3, 600),
        "n_layers": st.integers(1, 2),
        "seq_len": st.integers(2, 24),
        "mlp_ratio": st.sampled_from([1, 2, 4]),
    }
)


def test_simulated_rows_keep_their_values_when_moved_or_joined() -> None:
    """The engine reads rows of Python numbers back on the host: built with ``torch.tensor``, moved to the mesh's
    device (``_to_copy``) and joined into one read (``cat``). Under the planner's fake tensors each step keeps the
    values, so ``tolist()`` gives the row this rank made; any other fake tensor still has no data."""
    with fake_tensors():
        first = torch.tensor([3, -1, 7], dtype=torch.int64)
        moved = first.to(torch.int32)
        joined = torch.cat((first, torch.tensor([5], dtype=torch.int64)))
        assert moved.tolist() == [3, -1, 7]
        assert joined.tolist() == [3, -1, 7, 5]
        with pytest.raises(DataDependentOutputException):
            torch.cat((first, torch.empty(2, dtype=torch.int64))).tolist()


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=gpt_shapes,
    world_size=st.sampled_from([8, 12, 64, 100, 256, 1000, 1024]),
    batch=st.integers(1, 3),
    optimizer=st.sampled_from(["adamw", "sgd", "sgd-momentum"]),
)
# Found by hypothesis: the backward peak at the root's reduce-scatter staging, with the block's input still alive (on
# CPU the window's wait comes after the filling; the model waited before it and came out 5% low).
@example(
    shape={"n_heads": 2, "head_dim": 2, "vocab_size": 83, "n_layers": 1, "seq_len": 2, "mlp_ratio": 1},
    world_size=8,
    batch=1,
    optimizer="adamw",
)
def test_simulated_ranks_match_analytic_model(
    shape: dict[str, int], world_size: int, batch: int, optimizer: str
) -> None:
    """8..1024 ranks: sharded state exactly the padded torch.chunk formula, peaks within 5% of the analytic model
    (docs/planner.md), all-gather and reduce-scatter bytes the minimum (no "had a gradient" flags: every parameter
    gets a gradient)."""
    args = {k: v for k, v in shape.items() if k != "head_dim"}
    args["dim"] = shape["n_heads"] * shape["head_dim"]
    config = PlanConfig(model="gpt", model_args=args, world_size=world_size, batch_size=batch, optimizer=optimizer)
    result = fp.plan(config)
    record = result.record
    with torch.device("meta"):
        model = GPT(GPTConfig(**args))
    params = list(model.parameters())
    padded = sum(-(-p.shape[0] // world_size) * math.prod(p.shape[1:]) * 4 for p in params)
    assert record.sharded_param_bytes == padded == result.state.params
    assert record.grad_bytes == padded == result.state.grads
    assert record.optimizer_bytes == result.state.optimizer
    assert result.peak_model is not None
    for phase, peak in result.peak_model.peaks.items():
        assert record.peaks[phase] == pytest.approx(peak, rel=0.05), phase
    assert record.collectives["all_gather"]["shard"]["bytes"] == result.min_collectives["all_gather"]
    assert record.collectives["reduce_scatter"]["shard"]["bytes"] == result.min_collectives["reduce_scatter"]


@pytest.mark.parametrize(
    ("world_size", "replicate", "ep", "experts"),
    [(8, 1, 2, 8), (16, 2, 2, 8), (16, 1, 4, 4), (4, 1, 4, 4), (8, 4, 2, 2)],
    ids=["ep2", "hsdp2-ep2", "ep4-shard1", "ep-is-shard", "hsdp4-efsdp1"],
)
def test_experts_on_their_own_mesh_match_the_analytic_state(
    world_size: int, replicate: int, ep: int, experts: int
) -> None:
    """Experts on their own mesh (``efsdp = shard / ep``; ``Shard(1)`` where an ep rank holds fewer experts than
    efsdp has ranks): every rank's state exactly the formulas with each mesh's shard group, FSDP collectives the
    minimum, the per-mesh figures adding up to the totals, each layer's experts a unit of their own."""
    args = {**SMALL_MOE, "num_experts": experts}
    config = PlanConfig(model="moe", model_args=args, world_size=world_size, replicate=replicate, ep=ep, seq_len=11)
    for rank in (0, world_size - 1):
        result = fp.plan(replace(config, rank=rank))
        record = result.record
        assert (record.sharded_param_bytes, record.grad_bytes, record.optimizer_bytes) == (
            result.state.params,
            result.state.grads,
            result.state.optimizer,
        )
        for kind, minimum in result.min_collectives.items():
            groups = record.fsdp_collectives().get(kind, {})
            if kind == "all_reduce":  # the replicas' (the others: the step's agreement)
                groups = {"replicate": groups["replicate"]}
            assert sum(g["bytes"] for g in groups.values()) == minimum, kind
        dense, moe = record.meshes["dense"], record.meshes["experts"]
        assert moe["dims"]["efsdp"] == world_size // (replicate * ep)
        for field in ("sharded_param_bytes", "grad_bytes", "optimizer_bytes"):
            assert dense[field] + moe[field] == getattr(record, field), field
        assert dense["parameters"] + moe["parameters"] == record.parameters
        # 2 layers x (forward, backward) x (dispatch, combine): tokens every way, over the ep ranks
        assert sum(g["calls"] for g in record.collectives["all_to_all"].values()) == 8
        names = [unit["name"] for unit in record.schedule["units"]]
        assert names.count("model.layers.0") == 1 and sum(n.startswith("model.layers.0 on") for n in names) == 1


def test_expert_parallel_needs_a_divisor_of_the_shard_dim_and_a_plan() -> None:
    with pytest.raises(ValueError, match="ep 3 does not divide"):
        fp.plan(PlanConfig(model="moe", model_args=SMALL_MOE, world_size=4, ep=3))
    with pytest.raises(ValueError, match="does not combine ep with tp"):
        fp.plan(PlanConfig(model="moe", model_args=SMALL_MOE, world_size=4, ep=2, tp=2))
    with pytest.raises(ValueError, match="has no expert-parallel plan"):
        fp.plan(PlanConfig(model="gpt", model_args=SMALL_GPT, world_size=4, ep=2))


# ---------------------------------------------------------------------- the engine's schedule
def gpt_with_units(units: str = "0,1", **fields: Any) -> fp.ModelSpec:
    """A planner model factory: the GPT with only the blocks listed in ``units`` sharded as units, in that order
    (the others belong to the root)."""
    cfg = GPTConfig(**fields)
    model = GPT(cfg)
    chosen = [model.blocks[int(i)] for i in units.split(",") if i]
    spec = fp.load_model_spec("gpt", fields)
    return fp.ModelSpec(model, chosen, spec.make_batch, spec.loss, description=asdict(cfg))


@pytest.mark.parametrize("units", ["0,1,2", "2,0", "1", ""])
def test_peak_model_follows_the_engine_schedule(units: str) -> None:
    """The peak model takes its order of events from the engine's declared schedule of the model it plans: with a
    different set of units (blocks 1 and 3 in the root; the units sharded out of order; the root alone) its
    all-gathers follow registration order in forward and ``gather_order`` in backward, its reduce-scatters
    ``reduce_order``, each as the engine issued them in the simulated step (kind and bytes in the recorder's order),
    and its peaks stay within 5% of the measured ones."""
    config = PlanConfig(
        model="tests.test_plan:gpt_with_units",
        model_args={**SMALL_GPT, "n_layers": 3, "units": units},
        world_size=4,
        batch_size=2,
    )
    result = fp.plan(config)
    record, model = result.record, result.peak_model
    assert model is not None
    schedule = record.schedule
    expected_units = ["root", *(f"blocks.{i}" for i in sorted(int(i) for i in units.split(",") if i))]
    assert [u["name"] for u in schedule["units"]] == expected_units  # registration order, whatever the call order
    assert schedule["gather_order"] == ["root", *reversed(expected_units[1:])]
    assert schedule["reduce_order"] == [*reversed(expected_units[1:]), "root"]
    collectives = {u["name"]: u["collectives"] for u in schedule["units"]}
    events = model.events
    assert [u for phase, kind, u in events if phase == "forward" and kind == "all_gather"] == expected_units
    backward_gathers = [u for u in schedule["gather_order"] if "all_gather(backward)" in collectives[u]]
    assert [u for phase, kind, u in events if phase == "backward" and kind == "all_gather"] == backward_gathers
    assert [u for _, kind, u in events if kind == "reduce_scatter"] == schedule["reduce_order"]
    # the same collectives, in the same order, as the engine issued them (the agreement's all-reduce aside)
    segments = {name: segment_numel(infos, config.shard) for name, infos in record.unit_params.items()}
    issued = [(kind, nbytes) for kind, group, nbytes in record.collective_sequence if kind != "all_reduce"]
    assert [kind for kind, _ in issued] == [kind for _, kind, _ in events]
    for (kind, nbytes), (_, _, unit) in zip(issued, events, strict=True):
        assert nbytes == 4 * config.shard * segments[unit], (kind, unit)  # fp32, no 0-dim parameters, no flags
    for phase, peak in model.peaks.items():
        assert record.peaks[phase] == pytest.approx(peak, rel=0.05), phase


def test_peak_model_reads_the_orders_it_is_given() -> None:
    """The peak model has no order of its own: a record whose schedule says other orders gets events in those
    orders (here: the backward all-gathers and the reductions in registration order instead of reversed)."""
    config = PlanConfig(model="gpt", model_args={**SMALL_GPT, "n_layers": 3}, world_size=4, batch_size=2)
    record = fp.plan(config).record
    schedule = dict(record.schedule)
    names = [u["name"] for u in schedule["units"]]
    schedule["gather_order"] = names
    schedule["reduce_order"] = [*names[1:], names[0]]
    changed = fp.peak_model(config, replace(record, schedule=schedule))
    assert changed is not None
    assert [u for phase, kind, u in changed.events if phase == "backward" and kind == "all_gather"] == names[1:]
    assert [u for _, kind, u in changed.events if kind == "reduce_scatter"] == schedule["reduce_order"]


# ---------------------------------------------------------------------- CLI
def test_cli_table_json_and_sweep_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = tmp_path / "plan.json"
    args = ["--model", "gpt", "--model-arg", "n_layers=1", "--batch-size", "2"]
    assert plan_cli([*args, "--world-size", "16", "--json", str(one)]) == 0
    table = capsys.readouterr().out
    assert "peak during backward" in table and "all_gather" in table and "note:" in table
    assert "backward all-gathers: root -> blocks.0" in table and "reductions: blocks.0 -> root" in table
    payload = json.loads(one.read_text())
    assert payload["measured"]["mesh"] == {"shard": 16}
    assert payload["analytic"]["state"]["params"] == payload["measured"]["sharded_param_bytes"]
    sweep_json = tmp_path / "sweep.json"
    extra: list[str] = []
    if _has_matplotlib():
        extra = ["--plot", str(tmp_path / "sweep.png")]
    assert plan_cli([*args, "--sweep", "8,2x8", "--json", str(sweep_json), *extra]) == 0
    out = capsys.readouterr().out
    assert "[1/2] planning 8 ranks" in out and "[2/2] done" in out
    assert [r["measured"]["mesh"] for r in json.loads(sweep_json.read_text())] == [
        {"shard": 8},
        {"replicate": 2, "shard": 8},
    ]
    if extra:
        assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert plan_cli([*args, "--world-size", "6", "--tp", "4"]) == 2  # not divisible: a clear error
    assert "not divisible" in capsys.readouterr().err


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_the_gpt_preset_builds_the_example_model() -> None:
    """The planner's ``gpt`` preset is the example's GPT (one definition), so what it plans is what the example
    trains: same class, same config defaults, same parameter names and shapes."""
    import examples.gpt_model as example

    spec = fp.load_model_spec("gpt")
    assert type(spec.model) is example.GPT and GPT is example.GPT and GPTConfig is example.GPTConfig
    reference = example.GPT(example.GPTConfig())
    assert [(n, p.shape) for n, p in spec.model.named_parameters()] == [
        (n, p.shape) for n, p in reference.named_parameters()
    ]
    assert spec.units == list(spec.model.blocks)  # type: ignore[arg-type]
