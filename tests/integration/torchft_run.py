"""torchft 0.2.0 fault tolerance over FSDP: a lighthouse, two replica groups of 2 gloo ranks, one rank of group 1
killed inside its backward, group 1 relaunched, rejoining and healing from group 0.

Two modes in one file:

- ``python -m tests.integration.torchft_run scenario IMPL ROUTE`` runs the whole scenario and prints a JSON summary:
  the lighthouse (torchft's ``torchft_lighthouse``, on CPU), group 0, group 1 (its rank 0 dies in the backward of
  step ``KILL_AT``), group 1 again once the first attempt is gone; then it reads every rank's log. Everything it
  starts runs under a deadline and is killed on the way out (``_Processes``).
- under torchrun (``worker``): one replica group. FSDP over the group's ranks, the cross-replica gradient average
  through torchft's ``Manager``, a quorum per step, healing (parameter shards and momentum) from a live group.

``IMPL``: ``torch`` (torch's ``fully_shard``) or ``fc`` (``fc.fully_shard``). ``ROUTE``:

- ``hook``: a 1-D shard mesh and FSDP2's all-reduce hook calling ``manager.allreduce`` (torchft 0.2.0's way);
- ``managed``: a 2-D (replicate, shard) mesh whose replicate dim is torchft's ``ManagedProcessGroup``, unchanged,
  through ``DeviceMesh.from_group``: the FSDP implementation's own replica all-reduce runs through the manager.

Each rank of each attempt logs one JSON line per step (``<out>/g<group>_a<attempt>_r<rank>.jsonl``): the step, whether
it committed, the participants, the loss and the sha256 of this rank's local parameter shards after the step (keyed by
torchft's step counter after it: a healed group jumps to the healthy group's step).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = 16  # the steps every group trains to (torchft's step counter)
KILL_AT = 4  # group 1's rank 0 dies in the backward of this step (the first one with both groups in it from here)
ALONE = 2  # after retrying the crashed step alone, group 0 trains this many steps by itself, then lets group 1 in
DEADLINE_S = 240  # the whole scenario: every process still running then is killed
WAIT_S = 90  # a group waiting for the other (start, rejoin) gives up after this


# ---------------------------------------------------------------------------------------------------------- worker
def _note(log: Any, **record: Any) -> None:
    log.write(json.dumps(record) + "\n")
    log.flush()


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {WAIT_S}s for {what}")
        time.sleep(0.05)


def worker(impl: str, route: str, group: int, attempt: int, out: Path) -> None:
    # First of all, for the scenario's clean-up (torchrun's RANK: the process group does not exist yet)
    (out / f"pid_g{group}_a{attempt}_r{os.environ['RANK']}").write_text(str(os.getpid()))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.process_group import ManagedProcessGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    log = open(out / f"g{group}_a{attempt}_r{rank}.jsonl", "a", buffering=1)  # open until os._exit
    if attempt > 0:
        # A relaunched group starts its manager (which heartbeats to the lighthouse, making group 0's quorums wait
        # for it) only once group 0 trained ALONE steps by itself: the rejoin comes at the same step in every run.
        _wait_for(out / "rejoin", "group 0's steps alone")

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),  # a dead peer fails the step after 5 s
        min_replica_size=1,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"group{group}",
        hostname="localhost",
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10),
        init_sync=False,  # every group builds the same weights (seeded): step 0 is already a two-group step
    )

    shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    if route == "hook":
        mesh = shard_mesh
    else:
        # torchft registers its group as a 1-rank c10d group (its size() is the live replica count): the mesh's
        # replicate dim has size 1 here, whatever the quorum.
        replicas = ManagedProcessGroup(manager).register("replicate")
        mesh = DeviceMesh.from_group(
            [replicas, shard_mesh.get_group(0)],
            "cpu",
            mesh=shard_mesh.mesh.unsqueeze(0),
            mesh_dim_names=("replicate", "shard"),
        )

    dying = group == 1 and attempt == 0 and rank == 0
    step_now = [0]

    class Tripwire(nn.Module):
        """Identity; on the dying rank at the kill step, its gradient hook ends the process: inside the backward,
        after the last layer's gradients, with that unit's reductions under way or about to be."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if dying and step_now[0] >= KILL_AT and x.requires_grad and manager.num_participants() == 2:
                x.register_hook(self._die)
            return x

        def _die(self, grad: torch.Tensor) -> None:
            _note(log, event="dying", step=step_now[0], rank=rank)
            os._exit(13)

    torch.manual_seed(0)  # the same weights in every group
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), Tripwire(), nn.Linear(32, 1))
    linears = [m for m in model if isinstance(m, nn.Linear)]
    if impl == "torch":
        from torch.distributed.fsdp import FSDPModule, fully_shard

        for layer in linears:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units: list[Any] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    else:
        import fsdp_compose as fc

        for layer in linears:
            fc.fully_shard(layer, mesh=mesh, fsdp2_methods=True)
        fc.fully_shard(model, mesh=mesh, fsdp2_methods=True)
        units = [m for m in model.modules() if fc.has_fsdp2_methods(m)]

    params = list(model.parameters())  # the sharded DTensors the optimizer updates
    inner = torch.optim.SGD(params, lr=0.05, momentum=0.9)

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def state_dict() -> dict[str, Any]:
        # torchft's quorum thread calls this, possibly during this rank's forward: clones of the local shards read
        # through the optimizer's own references (a module state_dict would touch FSDP's state)
        with torch.no_grad():
            return {
                "params": [local(p).detach().clone() for p in params],
                "momentum": [
                    local(inner.state[p]["momentum_buffer"]).clone() if "momentum_buffer" in inner.state[p] else None
                    for p in params
                ],
            }

    def load_state_dict(loaded: dict[str, Any]) -> None:
        with torch.no_grad():
            for p, value, momentum in zip(params, loaded["params"], loaded["momentum"], strict=True):
                local(p).copy_(value)
                if momentum is None:
                    inner.state[p].pop("momentum_buffer", None)
                else:
                    inner.state[p]["momentum_buffer"] = DTensor.from_local(
                        momentum.clone(), p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
        _note(log, event="healed", rank=rank)

    manager.register_state_dict_fn("default", load_state_dict, state_dict)
    optimizer = Optimizer(manager, inner)

    if route == "hook":

        def average_over_replicas(rows: torch.Tensor) -> None:
            manager.allreduce(rows).wait()  # in place: AVG over the groups in the quorum

        for unit in units:
            unit.set_all_reduce_hook(average_over_replicas)

    # Both first attempts start together (a group starting alone would train alone); after ALONE steps by itself,
    # group 0 lets the relaunched group 1 start its manager and waits until both its ranks asked for a quorum: the
    # lighthouse then holds group 1's request (join_timeout) until group 0's arrives, and they rejoin at that step.
    if attempt == 0:
        dist.barrier()
        if rank == 0:
            (out / f"ready_g{group}_a0").touch()
        _wait_for(out / f"ready_g{1 - group}_a0", f"group {1 - group}")
    _note(log, event="start", rank=rank, world=world, mesh=str(mesh), torch=torch.__version__)
    alone = 0
    while manager.current_step() < STEPS:
        step = manager.current_step()
        step_now[0] = step
        if group == 0 and alone == ALONE:
            if rank == 0:
                (out / "rejoin").touch()
            _wait_for(out / "ready_g1_a1", "group 1's relaunch")
        generator = torch.Generator().manual_seed(1000 * step + 10 * group + rank)  # a batch per group and rank
        x = torch.randn(8, 16, generator=generator)
        y = x.sum(dim=1, keepdim=True)
        optimizer.zero_grad()  # starts the quorum (asynchronously)
        if attempt > 0 and step == 0:
            dist.barrier()
            if rank == 0:
                (out / "ready_g1_a1").touch()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()  # should_commit, then the inner step if every rank of every group in the quorum succeeded
        committed = manager.current_step() > step
        participants = manager.num_participants()
        if group == 0 and committed and participants == 1 and step > KILL_AT:
            alone += 1
        with torch.no_grad():
            shards = b"".join(local(p).detach().contiguous().numpy().tobytes() for p in params)
        _note(
            log,
            event="step",
            step=manager.current_step(),  # the state's step: after a heal, the healthy group's step + 1
            committed=committed,
            participants=participants,
            loss=loss.item(),
            sha256=hashlib.sha256(shards).hexdigest(),
            rank=rank,
        )
    _note(log, event="done", step=manager.current_step(), rank=rank)
    manager.shutdown(wait=False)
    dist.barrier()
    dist.destroy_process_group()
    log.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo: a work object released at interpreter exit can abort the process


# -------------------------------------------------------------------------------------------------------- scenario
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
    if not os.access(found, os.X_OK):
        raise FileNotFoundError("torchft_lighthouse (installed with torchft) not found")
    return found


class _Processes:
    """Processes started in their own sessions; ``close`` ends each one that still runs, then the ranks torchrun
    started (torchrun puts each rank in a session of its own: they are found by the pid files they wrote, and killed
    only if that pid still runs this script for this scenario), so nothing outlives the scenario."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.out / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started.append(proc)
        return proc

    def close(self) -> None:
        running = [proc for proc in self.started if proc.poll() is None]
        for proc in running:  # torchrun passes SIGTERM on to its ranks
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for pid_file in self.out.glob("pid_*"):
            pid = int(pid_file.read_text())
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if str(Path(__file__)).encode() in command and str(self.out).encode() in command:
                    os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def _processes(out: Path) -> Iterator[_Processes]:
    procs = _Processes(out)
    try:
        yield procs
    finally:
        procs.close()


def _wait(proc: subprocess.Popen[bytes], deadline: float, what: str) -> int:
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{what} still running at the scenario's deadline ({DEADLINE_S}s)") from None


def scenario(impl: str, route: str, out: Path) -> dict[str, Any]:
    """Runs the scenario with logs in ``out``; returns ``summarize(out)`` plus the exit codes and the wall time."""
    start = time.monotonic()
    deadline = start + DEADLINE_S
    lighthouse_port = _free_port()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{lighthouse_port}",
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }

    def launch(group: int, attempt: int) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
            "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), "--max-restarts", "0",
            str(Path(__file__)), "worker", impl, route, "--group", str(group), "--attempt", str(attempt),
            "--out", str(out),
        ]  # fmt: skip
        return procs.start(f"torchrun_g{group}_a{attempt}", command, env)

    with _processes(out) as procs:
        # join_timeout: how long a quorum request waits for heartbeating replicas that have not asked yet (group 1's
        # first request after its relaunch waits for group 0's); a dead group stops heartbeating: 3 s, then it is out.
        lighthouse = [
            lighthouse_binary(), "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
            "--heartbeat_timeout_ms", "3000", "--bind", f"127.0.0.1:{lighthouse_port}",
        ]  # fmt: skip
        procs.start("lighthouse", lighthouse, env)
        while True:  # until the lighthouse listens
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", lighthouse_port), timeout=1):
                break
            if time.monotonic() > start + 20:
                raise TimeoutError("the lighthouse did not start in 20 s")
            time.sleep(0.1)
        group0, group1 = launch(0, 0), launch(1, 0)
        codes = {"g1_a0": _wait(group1, deadline, "group 1 (first attempt)")}
        group1 = launch(1, 1)  # torchrun of the first attempt ended its other rank: a fresh group rejoins
        codes["g0_a0"] = _wait(group0, deadline, "group 0")
        codes["g1_a1"] = _wait(group1, deadline, "group 1 (relaunched)")
    return {**summarize(out), "exit_codes": codes, "wall_s": round(time.monotonic() - start, 1)}


def summarize(out: Path) -> dict[str, Any]:
    """What the logs say, per shard rank: the steps group 0 and group 1 both committed before the crash and after
    the rejoin (the heal step included: group 1 loads group 0's state there and does not train), group 0's steps
    alone, its uncommitted steps, and the steps where the two groups' shards differ (sha256); group 0's losses and
    its (step, committed, participants) history (rank 0)."""
    logs: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for path in glob.glob(str(out / "g*_a*_r*.jsonl")):
        group, attempt, rank = (int(part[1:]) for part in Path(path).stem.split("_"))
        logs[(group, attempt, rank)] = [json.loads(line) for line in Path(path).read_text().splitlines()]

    def steps(key: tuple[int, int, int]) -> list[dict[str, Any]]:
        return [r for r in logs.get(key, []) if r["event"] == "step"]

    def committed(key: tuple[int, int, int]) -> dict[int, dict[str, Any]]:
        return {r["step"]: r for r in steps(key) if r["committed"]}

    per_rank = {}
    for rank in sorted({rank for _, _, rank in logs}):
        group0, before, after = committed((0, 0, rank)), committed((1, 0, rank)), committed((1, 1, rank))
        heal = min(after, default=None)
        both_before, both_after = sorted(set(group0) & set(before)), sorted(set(group0) & set(after))
        per_rank[rank] = {
            "both_committed_before": both_before,
            "heal_step": heal,
            "both_committed_after": both_after,
            "group0_alone": [s for s, r in group0.items() if r["participants"] == 1 and s != heal],
            "group0_uncommitted": [r["step"] for r in steps((0, 0, rank)) if not r["committed"]],
            "group0_last_step": max(group0, default=-1),
            "differing_steps": [s for s in both_before if group0[s]["sha256"] != before[s]["sha256"]]
            + [s for s in both_after if group0[s]["sha256"] != after[s]["sha256"]],
        }
    return {
        "dying": [e["step"] for recs in logs.values() for e in recs if e["event"] == "dying"],
        "events": {
            f"g{g}_a{a}_r{r}": [e["event"] for e in recs if e["event"] != "step"] for (g, a, r), recs in logs.items()
        },
        "ranks": per_rank,
        "group0_losses": {r["step"]: r["loss"] for r in steps((0, 0, 0)) if r["committed"]},
        "group0_history": [(r["step"], r["committed"], r["participants"]) for r in steps((0, 0, 0))],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["scenario", "worker"])
    parser.add_argument("impl", choices=["torch", "fc"])
    parser.add_argument("route", choices=["hook", "managed"])
    parser.add_argument("--group", type=int, default=0)
    parser.add_argument("--attempt", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.mode == "worker":
        worker(args.impl, args.route, args.group, args.attempt, args.out)
        return
    out = args.out or Path(tempfile.mkdtemp(prefix=f"torchft_{args.impl}_{args.route}_"))
    out.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(json.dumps(scenario(args.impl, args.route, out)) + "\n")
    sys.stdout.write(f"logs: {out}\n")


if __name__ == "__main__":
    main()
