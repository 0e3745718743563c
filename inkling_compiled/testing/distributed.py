"""Running a function on N local gloo ranks: the tensor-parallel tests and the ``tp`` benchmark section.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes, joins them into one gloo process group over a
TCP store on 127.0.0.1 (the parent holds it on a port the OS picks, so there is no port race) with gloo's sockets on
the loopback interface, builds the 1-D ``DeviceMesh`` over them and calls ``fn(mesh, *args)`` on every rank. It
returns each rank's result, in rank order. ``device="cuda"`` runs NCCL instead, rank r on GPU r (one GPU per rank:
NCCL refuses two ranks on one device). Bounded: a collective that waits longer than ``timeout`` fails on the
ranks, and the parent stops every process still running at its deadline. An exception on a rank is raised in the
parent with that rank's traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LOOPBACK = "127.0.0.1"


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, threads: int = 1, device: str = "cpu") -> list:
    """``[fn(mesh, *args) on rank r for r in range(world_size)]``; ``fn`` must be importable (module level) and its
    results picklable. Each rank runs ``threads`` intra-op threads."""
    store = dist.TCPStore(LOOPBACK, 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    with tempfile.TemporaryDirectory(prefix="inkling-ranks-") as out:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' (gloo) or 'cuda' (NCCL), got {device!r}")
        if device == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"{world_size} NCCL ranks need {world_size} GPUs, this machine has "
                             f"{torch.cuda.device_count()}")
        setup = (world_size, store.port, timeout, threads, device, out)
        context = mp.start_processes(_rank_main, args=(*setup, fn, args),
                                     nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout + 60.0  # the ranks' own collective timeout fires first
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {getattr(fn, '__name__', fn)} still running after "
                                       f"{timeout + 60:.0f} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(5.0)
        return [torch.load(Path(out) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, world_size: int, port: int, timeout: float, threads: int, device: str, out: str, fn,
               args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's own connections stay on the loopback interface
    torch.set_num_threads(threads)
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.TCPStore(LOOPBACK, port, world_size + 1, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        mesh = init_device_mesh(device, (world_size,))
        result = fn(mesh, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
