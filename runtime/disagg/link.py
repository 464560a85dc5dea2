"""A control connection to a P/D peer (a PUSH socket to its control socket) that notices when the peer goes away:
ZeroMQ reports the TCP connection's close (a killed process's kernel closes it at once), so a side waiting on
a dead peer fails its rooms then, not at --disaggregation-timeout."""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

RECONNECT_GRACE_S = 0.5  # a connection closed with its peer alive (a reset) comes back within ZeroMQ's reconnect


class PeerLink:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never block the scheduler: a message to a gone peer is queued
        self._events = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self._connected = False
        self._closed_at: float | None = None  # when the connection closed, unless it came back since

    def send(self, raw: bytes) -> None:
        self.socket.send(raw)

    @property
    def lost(self) -> bool:
        """Whether the connection, once made, closed and did not come back within RECONNECT_GRACE_S: the peer's
        process is gone (a restarted peer listens on another port; its rooms and its agent went with the old)."""
        while self._events.poll(0):
            event = recv_monitor_message(self._events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected, self._closed_at = True, None
            elif event == zmq.EVENT_DISCONNECTED and self._connected and self._closed_at is None:
                self._closed_at = time.monotonic()
        return self._closed_at is not None and time.monotonic() - self._closed_at > RECONNECT_GRACE_S

    def close(self) -> None:
        self.socket.disable_monitor()
        self._events.close(linger=0)
        self.socket.close(linger=0)
