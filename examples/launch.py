"""Process-group set-up and tear-down shared by the examples (run under torchrun)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist


def run_distributed(train: Callable[[str], None]) -> None:
    """Initialize the default process group (NCCL on GPUs, gloo on CPU), call ``train(device_type)``, tear down."""
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    train("cuda" if use_cuda else "cpu")
    tear_down()


def tear_down() -> None:
    """Destroy the default process group; on gloo, exit right away (see below)."""
    on_gloo = dist.get_backend() == "gloo"
    dist.destroy_process_group()
    if on_gloo:
        # Skip interpreter teardown on gloo: torch keeps gloo's worker threads alive past destroy_process_group once
        # DTensor ops ran, and a worker that releases its last collective's tensors while Python shuts down needs
        # the GIL and aborts the process (rarely, on a loaded machine; see pytorch/pytorch#179291).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
