"""The entry point of a node other than node 0 (`radixk3 serve --node-rank R`, R > 0): it runs only this node's
worker ranks, which connect to node 0's schedulers."""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import signal

from runtime.engine_processes import main_module_hidden
from runtime.server_args import ServerArgs
from runtime.topology import Topology, rank_process_name
from runtime.worker_main import worker_main


def run_node(args: ServerArgs, grace_s: float = 5.0) -> int:
    """Node `node_rank > 0`: run this node's ranks until node 0 shuts them down (0) or one fails (1)."""
    if args.node_rank == 0:
        raise ValueError("node 0 runs the engine itself (Engine / radixk3 serve), not only its ranks")
    topo = Topology.for_args(args, ipc_dir=None)
    spawn = mp.get_context("spawn")
    procs = [spawn.Process(target=worker_main, args=(args, topo, rid.replica, rid.rank), daemon=True,
                           name=rank_process_name(rid)) for rid in topo.local_ranks(args.node_rank)]
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with main_module_hidden():  # the ranks start without the caller's script (see `main_module_hidden`)
            for p in procs:
                p.start()
        while not stopping and all(p.is_alive() for p in procs):
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)
        if not stopping:  # one rank ended: node 0 said Shutdown (all end with 0) or something failed
            for p in procs:
                p.join(timeout=grace_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for s, h in old.items():
            signal.signal(s, h)
    return 0 if stopping or all(p.exitcode == 0 for p in procs) else 1
