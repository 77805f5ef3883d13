"""Runs a script of this folder under torchrun (2 ranks unless told) and returns the JSON its rank 0 printed after
``RESULT``; ``finish_rank`` ends such a script."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def finish_rank(result: dict[str, Any]) -> None:
    """Rank 0 prints ``result``; every rank then leaves as docs say gloo needs (a work object released at interpreter
    exit can abort the process): barrier, destroy the process group, flush, ``os._exit(0)``."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_script(name: str, variant: str, *args: str, cwd: Path | None = None, nproc: int = 2) -> Any:
    """Runs ``name`` under torchrun (``nproc`` ranks) with ``variant`` and ``args`` (in ``cwd``); a failure shows
    each rank's error line first, then the ends of stdout and stderr."""
    script = Path(__file__).with_name(name)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    done = subprocess.run(
        [*command, str(script), variant, *args], capture_output=True, text=True, env=env, timeout=600, cwd=cwd
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    errors = [line for line in done.stderr.splitlines() if re.match(r"\[rank\d+\]: [\w.]*(Error|Exception)\b", line)]
    assert done.returncode == 0 and lines, "\n".join(errors) + "\n" + done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[0].removeprefix("RESULT "))
