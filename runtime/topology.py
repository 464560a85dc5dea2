"""Where the engine's processes run: replicas, ranks and nodes, the socket addresses between them.

Per engine replica i (`dp_size` replicas without DP attention): one scheduler on node 0 and `tp_size` worker
ranks, spread evenly over the nodes (rank r of every replica on node r // (tp_size / nnodes), so each
replica's rank 0, which hosts its torch.distributed store, is on node 0). With DP attention there is one
replica whose ranks form `dp_size` attention groups of consecutive ranks, each group's first rank sending that
group's results (`runtime.scheduler.dp_attention`).

Endpoints: `sched_in_{i}`, `worker_in_{i}_{r}`, `worker_out_{i}`, and the shared `sched_out` and `ready`.
The scheduler binds its plan and result sockets and the ranks connect, so across nodes only node 0 listens.
On one node they are `ipc://` files; with `--nnodes > 1` the rank sockets are tcp on node 0's address, and
every port derives from `--dist-init-addr HOST:P` (R replicas, T ranks each):
  P + i              torch.distributed rendezvous of replica i
  P + R + i*T + r    plans to rank r of replica i (`worker_in_{i}_{r}`)
  P + R + R*T + i    results of replica i (`worker_out_{i}`)
"""

from __future__ import annotations

import contextlib
import ipaddress
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from runtime.server_args import ServerArgs

# A rank's exit code after a failed collective (a consequence of another rank's death or hang).
COLLECTIVE_FAILED_EXIT = 3


class RankId(NamedTuple):
    replica: int
    rank: int


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (what outgoing connections and bind-to-0 draw from)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; IANA's range starts at 49152, so below 32768 is outside both


def free_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port P with P .. P+n-1 free on `host` now, drawn below the ephemeral range: a port taken from that
    range (bind to 0) can be handed to any process's outgoing connection before its listener binds it ("address
    already in use" under many open connections), one below it only to another listener."""
    low = min(_ephemeral_low(), 65536)
    pick = random.SystemRandom()  # not the `random` module: a seeded test must not make every process pick alike
    for _ in range(200):
        base = pick.randrange(10000, max(low - n, 10001))
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    stack.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
        return base
    raise RuntimeError(f"no {n} consecutive free ports on {host} below {low}")


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)


def split_addr(addr: str) -> tuple[str, int]:
    """`host:port` (or `[v6]:port`) -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def num_replicas(args: ServerArgs) -> int:
    return 1 if args.enable_dp_attention else args.dp_size


@dataclass(frozen=True)
class Topology:
    num_replicas: int
    tp_size: int
    nnodes: int
    ipc_dir: str | None  # node 0's socket dir; None on the other nodes (they use only tcp)
    host: str  # node 0's address
    dist_ports: tuple[int, ...]  # torch.distributed rendezvous port of each replica
    base_port: int | None  # with nnodes > 1: P of the port layout above
    attention_groups: int = 1  # DP attention: the replica's ranks in this many groups of consecutive ranks

    @classmethod
    def for_args(cls, args: ServerArgs, ipc_dir: str | None) -> Topology:
        if args.tp_size % args.nnodes:
            raise ValueError(f"--nnodes {args.nnodes} must divide --tp-size {args.tp_size} (ranks spread evenly)")
        replicas = num_replicas(args)
        if args.dist_init_addr is None:
            host, ports = "127.0.0.1", tuple(free_port() for _ in range(replicas))
            base = None
        else:
            host, p = split_addr(args.dist_init_addr)
            last = p + replicas * (args.tp_size + 2) - 1
            if last > 65535:
                raise ValueError(f"--dist-init-addr port {p}: ports up to {last} are needed")
            ports = tuple(p + i for i in range(replicas))
            base = p + replicas if args.nnodes > 1 else None
        groups = args.dp_size if args.enable_dp_attention else 1
        return cls(replicas, args.tp_size, args.nnodes, ipc_dir, host, ports, base, groups)

    def attention_group(self, rank: int) -> int:
        """The DP rank (attention group) of worker rank `rank`; 0 without DP attention."""
        return rank // (self.tp_size // self.attention_groups)

    def leads_group(self, rank: int) -> bool:
        """Whether `rank` is its attention group's first rank: the one that sends the group's results."""
        return rank % (self.tp_size // self.attention_groups) == 0

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_ranks(self, node: int) -> list[RankId]:
        return [RankId(i, r) for i in range(self.num_replicas) for r in range(self.tp_size) if self.node_of(r) == node]

    def local_index(self, replica: int, rank: int) -> int:
        """This rank's index among the ranks on its node (its GPU there), replica by replica."""
        return replica * self.ranks_per_node + rank % self.ranks_per_node

    def rank_device(self, device: str, replica: int, rank: int) -> str:
        """`cuda` without an index: one GPU per rank on its node; anything else as given."""
        return f"cuda:{self.local_index(replica, rank)}" if device == "cuda" else device

    def rank_threads(self, cpus: int) -> int:
        """CPU threads per rank: the node's cores shared evenly by its ranks (oversubscribed ranks on one
        machine measure contention, not the configuration)."""
        return max(1, cpus // (self.num_replicas * self.ranks_per_node))

    def dist_init(self, replica: int) -> str:
        return f"tcp://{_url_host(self.host)}:{self.dist_ports[replica]}"

    def _port(self, name: str) -> int | None:
        """The tcp port of a rank socket when they cross nodes; None: an ipc file."""
        if self.base_port is None:
            return None
        parts = name.split("_")
        if name.startswith("worker_in_"):
            return self.base_port + int(parts[2]) * self.tp_size + int(parts[3])
        if name.startswith("worker_out_"):
            return self.base_port + self.num_replicas * self.tp_size + int(parts[2])
        return None

    def addr(self, name: str) -> str:
        """The address to connect to."""
        port = self._port(name)
        if port is not None:
            return f"tcp://{_url_host(self.host)}:{port}"
        if self.ipc_dir is None:
            raise ValueError(f"endpoint {name!r} lives on node 0")
        return f"ipc://{Path(self.ipc_dir) / name}"

    def bind_addr(self, name: str) -> str:
        port = self._port(name)
        if port is None:
            return self.addr(name)
        try:
            ipaddress.ip_address(self.host)
            return f"tcp://{_url_host(self.host)}:{port}"
        except ValueError:  # a host name: listen on every interface (ZeroMQ binds interfaces, not names)
            return f"tcp://*:{port}"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# What a failed torch.distributed collective says (gloo and NCCL raise plain RuntimeErrors for a lost or silent
# peer): the group is broken, so the rank must exit rather than fail one step and desynchronise from the rest.
def rank_label(replica: int, rank: int) -> str:
    return f"worker rank {rank} of replica {replica}"


def rank_process_name(rid: RankId) -> str:
    return f"radixk3-worker-dp{rid.replica}-tp{rid.rank}"
