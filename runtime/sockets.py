"""ZeroMQ sockets between the engine's processes: addresses, options, and how a process notices that its peer
or its parent is gone (see `runtime.topology` for which process binds which address)."""

from __future__ import annotations

import ctypes
import signal
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

# A node-0 socket that stays silent this long is taken for a dead machine (ZeroMQ heartbeats, tcp only).
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 10_000
# A failing process's last word (why it failed) must still be delivered.
LINGER_MS = 2000


def endpoint(ipc_dir: str, name: str) -> str:
    return f"ipc://{Path(ipc_dir) / name}"


def make_socket(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, LINGER_MS)
    if addr.startswith("tcp://"):  # across machines: notice a peer that went silent, not only one that closed
        s.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        s.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    (s.bind if bind else s.connect)(addr)
    return s


def die_with_parent() -> None:
    """Children get SIGTERM when their parent dies, however it dies (Linux prctl PDEATHSIG)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def disconnected(monitor: zmq.Socket) -> bool:
    """Drain a monitor socket; whether a peer went away."""
    gone = False
    while monitor.poll(0):
        gone |= recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    return gone
