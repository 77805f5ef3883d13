"""What planning costs: wall time, CPU time and peak resident memory of ``python -m fsdp_compose.plan``.

    python benchmarks/plan_cost.py [--write docs/planner.md] [--quick]

Each case runs the CLI in a fresh process (so the resident-set figure is that run's alone, imports included) and
reads the child's resource usage with ``os.wait4``. Default cases: a 70B-shaped Llama (80 layers, 8192 wide, GQA,
128256-token vocabulary) at 1024 ranks, fp32 without activation checkpointing, and bf16 compute / fp32 reduce with
checkpointing at sequence 4096. ``--quick`` plans the 8B shape instead (a smoke test of the script).
Target (issue 12): under 60 s and under 2 GiB on 2 cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

from benchmarks.report import write_section  # noqa: E402

CASES = {
    "llama-70b, 1024 ranks, fp32, batch 1 x 2048": ["--model", "llama-70b", "--world-size", "1024"],
    "llama-70b, 1024 ranks, bf16 / fp32 reduce, checkpointing, batch 1 x 4096": [
        "--model",
        "llama-70b",
        "--world-size",
        "1024",
        "--param-dtype",
        "bf16",
        "--reduce-dtype",
        "fp32",
        "--activation-checkpointing",
        "--seq-len",
        "4096",
    ],
}
QUICK = {"llama-8b, 64 ranks, fp32, batch 1 x 2048": ["--model", "llama-8b", "--world-size", "64"]}


def measure(args: list[str]) -> tuple[float, float, int]:
    """(wall s, user + system CPU s, max RSS bytes) of one CLI run in a fresh process."""
    command = [sys.executable, "-m", "fsdp_compose.plan", *args, "--quiet"]
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    stderr = child.stderr.read().decode() if child.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr}")
    rss = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return wall, usage.ru_utime + usage.ru_stime, rss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", metavar="PATH", help="replace the cost section of this markdown file")
    parser.add_argument("--quick", action="store_true", help="plan the 8B shape instead of 70B")
    ns = parser.parse_args(argv)
    cases = QUICK if ns.quick else CASES
    rows = ["| case | wall s | CPU s (user + sys) | max RSS |", "| --- | ---: | ---: | ---: |"]
    for name, args in cases.items():
        print(f"[plan_cost] {name} ...", flush=True)
        wall, cpu, rss = measure(args)
        rows.append(f"| {name} | {wall:.1f} | {cpu:.1f} | {rss / (1 << 20):.0f} MiB |")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    body = (
        f"Command: `python benchmarks/plan_cost.py`; {os.cpu_count()} CPUs ({platform.machine()}), load average "
        f"{load:.1f} at the end; each figure is one fresh process, imports included.\n\n" + "\n".join(rows) + "\n"
    )
    print(body)
    if ns.write:
        target = Path(ns.write) if Path(ns.write).is_absolute() else REPO / ns.write
        write_section(target, body, name="cost")
        print(f"wrote {target}")


if __name__ == "__main__":
    main()
