"""How many bytes a worker gives its pool (and the speculative scratch carved from it): `--mem-bytes`, or with
`--mem-fraction` that share of the memory its device has free once the model's weights are loaded, read where
that memory is known (the worker, after the load: as SGLang sizes its KV pool) and agreed over the TP group
(the smallest rank's share), so that every rank of a replica allocates the same pool. The scheduler learns
the size from the ranks' readiness (`WorkerReady.pool_bytes`), never from a reading of its own."""

from __future__ import annotations

import os

import torch

from radixk3.parallel import tp_min
from runtime.server_args import ServerArgs


def free_device_bytes(device: str | torch.device) -> int:
    """Memory `device` has free now: the CUDA device's free bytes (the caching allocator's idle blocks handed
    back first), or on CPU the machine's available physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pool_memory_bytes(args: ServerArgs, device: str | torch.device) -> int:
    """The bytes for this rank's pool and its speculative scratch (`pool_layout.pool_budget` splits them):
    `--mem-bytes`, or `--mem-fraction` of the device's free memory now, the smallest over the TP group. Call it
    after the weights are loaded, on every rank of the group (it is a collective then)."""
    if args.mem_fraction is None:
        return args.mem_bytes
    return tp_min(int(free_device_bytes(device) * args.mem_fraction), device)
