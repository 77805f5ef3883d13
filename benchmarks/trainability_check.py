"""Per-step cost of fsdp_compose's trainability check, which the root runs at every forward.

    python benchmarks/trainability_check.py [--write docs/benchmarks.md]

One process (gloo, world size 1, a ``FileStore`` in a temporary directory), a model of ``--params`` parameters made of
tiny ``nn.Linear(4, 4)`` layers (weight and bias: two parameters each), sharded two ways:

- ``1 unit``: ``fc.fully_shard(model)`` on the whole stack, one unit holding every parameter;
- ``N units``: the layers in groups of ``--group`` parameters, ``fc.fully_shard`` on every group, then on the root
  (which holds no parameter of its own).

After one forward and backward (lazy init), timed with ``timeit`` (best and median of ``--repeat`` repetitions,
each long enough to take 0.2 s), per step:

- **no change**: ``state.params_changed()`` for every unit with nothing changed: one identity and one
  ``requires_grad`` comparison per parameter, what the root adds to every forward;
- **one change**: flip ``requires_grad`` of one parameter, then the same loop: the unit holding it rebuilds its
  gradient layout (under ``frozen_params="replicate"`` it also re-lays out its parameters: the flipped one moves
  between sharded and whole, an all-gather of the unit at world size > 1, none here);
- for context: ``views_intact()`` of every unit (the identity check of a unit's adoption) and one forward and
  backward of the model on a batch of ``--batch`` rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import datetime  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import timeit  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402

import fsdp_compose as fc  # noqa: E402
from benchmarks.report import _table, write_section  # noqa: E402
from fsdp_compose.state import states_under  # noqa: E402

WIDTH = 4  # nn.Linear(WIDTH, WIDTH): weight and bias


def build(params: int, group: int | None, mode: str, mesh: DeviceMesh) -> nn.Module:
    """``params // 2`` linear layers in one unit (``group`` None) or in units of ``group`` parameters, then the root."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH) for _ in range(params // 2)]
    if group is None:
        model = nn.Sequential(*layers)
    else:
        per_unit = group // 2
        model = nn.Sequential(*(nn.Sequential(*layers[i : i + per_unit]) for i in range(0, len(layers), per_unit)))
        for unit in model:
            fc.fully_shard(unit, mesh=mesh, frozen_params=mode)
    fc.fully_shard(model, mesh=mesh, frozen_params=mode)
    return model


def per_call(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """(best, median) seconds per call over ``repeat`` repetitions of an auto-ranged number of calls."""
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    runs = [t / number for t in timer.repeat(repeat=repeat, number=number)]
    return min(runs), statistics.median(runs)


def measure(params: int, group: int | None, mode: str, args: argparse.Namespace, mesh: DeviceMesh) -> dict[str, Any]:
    model = build(params, group, mode, mesh)
    x = torch.randn(args.batch, WIDTH)

    def step() -> None:
        model(x).sum().backward()
        model.zero_grad(set_to_none=True)

    step()  # lazy init: the root collects its states
    states = states_under(model)
    count = sum(len(state.params.shards.params) for state in states)
    assert count == params, (count, params)

    def check() -> None:
        for state in states:
            state.params_changed()

    flipped = next(p for p in model.parameters())

    def change() -> None:
        flipped.requires_grad_(not flipped.requires_grad)
        for state in states:
            state.refresh_trainable()

    def toggle_only() -> None:
        flipped.requires_grad_(not flipped.requires_grad)

    def views() -> None:
        for state in states:
            state.params.shards.views_intact()

    result = {"units": sum(1 for s in states if s.params.shards.params), "states": len(states)}
    result["check"] = per_call(check, args.repeat)
    result["change"] = per_call(change, args.repeat)
    result["toggle"] = per_call(toggle_only, args.repeat)
    if not flipped.requires_grad:
        change()  # leave it trainable for the step below
    result["views"] = per_call(views, args.repeat)
    result["step"] = per_call(step, max(3, args.repeat // 2))
    return result


def render(rows: list[tuple[str, str, dict[str, Any]]], args: argparse.Namespace, command: str) -> str:
    def us(pair: tuple[float, float]) -> str:
        return f"{pair[0] * 1e6:.1f} / {pair[1] * 1e6:.1f}"

    body = []
    for label, mode, res in rows:
        ns_per_param = res["check"][0] * 1e9 / args.params
        body.append(
            [
                label,
                mode,
                us(res["check"]),
                f"{ns_per_param:.0f}",
                us(res["change"]),
                us(res["views"]),
                f"{res['step'][1] * 1e3:.2f}",
                f"{100 * res['check'][1] / res['step'][1]:.1f}%",
            ]
        )
    header = ["model", "frozen_params", "no change µs", "best ns / param", "one change µs", "views_intact µs"]
    header += ["fwd+bwd ms", "check / step"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    toggle = max(res["toggle"][1] for _, _, res in rows) * 1e6
    return (
        f"Command: `{command}`\n\n"
        f"Date: {now}; torch {torch.__version__}; Python {platform.python_version()} on {platform.machine()}; one "
        f"process, gloo world size 1, torch threads: {torch.get_num_threads()}. Model: {args.params // 2} x "
        f"nn.Linear({WIDTH}, {WIDTH}) = {args.params} parameters; fwd+bwd on {args.batch} rows.\n\n"
        "**Trainability check per step** — µs per step, best / median of "
        f"{args.repeat} timeit repetitions. No change: `state.refresh_trainable()` for every state of the "
        "root, nothing changed (the per-forward check). One change: `requires_grad` of one parameter flipped, "
        f"then the same loop (the flip alone costs at most {toggle:.1f} µs). views_intact: the identity check "
        "before every all-gather, every unit. check / step: median no-change check over the median forward and "
        "backward of this (tiny) model.\n\n" + _table(header, body) + "\n"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=1000, help="parameters in the model (even)")
    parser.add_argument("--group", type=int, default=10, help="parameters per unit in the many-units model (even)")
    parser.add_argument("--batch", type=int, default=8, help="rows of the forward/backward batch")
    parser.add_argument("--repeat", type=int, default=7, help="timeit repetitions")
    parser.add_argument("--write", metavar="PATH", help="replace the --section of this markdown file")
    parser.add_argument("--section", default="trainability", help="marker name in the markdown file")
    args = parser.parse_args(argv)
    if args.params % 2 or args.group % 2 or args.params % args.group:
        parser.error("--params and --group must be even, and --group must divide --params")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(str(Path(tmp) / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            mesh = init_device_mesh("cpu", (1,))
            rows = []
            for mode in ("shard", "replicate"):
                for group in (None, args.group):
                    units = args.params // group if group else 1
                    label = f"{units} unit{'s' if units > 1 else ''} x {group or args.params} params"
                    rows.append((label, mode, measure(args.params, group, mode, args, mesh)))
                    print(f"[trainability] {label}, {mode} done", flush=True)
        finally:
            dist.destroy_process_group()
    command = "python benchmarks/trainability_check.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = render(rows, args, command.rstrip())
    print(text)
    if args.write:
        target = Path(args.write) if Path(args.write).is_absolute() else REPO / args.write
        write_section(target, text, args.section)
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
