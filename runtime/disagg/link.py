"""A control connection to a P/D peer (a PUSH socket to its control socket) that notices when the peer goes away:
ZeroMQ reports the TCP connection's close (a killed process's kernel closes it at once), so a side waiting on
a dead peer fails its rooms then, not at --disaggregation-timeout."""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message


class PeerLink:
    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.PUSH)
        self.socket.setsockopt(zmq.LINGER, 1000)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # never block the scheduler: a message to a gone peer is queued
        self._events = self.socket.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.socket.connect(address)
        self._connected = False
        self._lost = False

    def send(self, raw: bytes) -> None:
        self.socket.send(raw)

    @property
    def lost(self) -> bool:
        """Whether the connection, once made, has closed: the peer's process is gone (ZeroMQ would reconnect to
        whatever binds the address next, but the peer's rooms and its agent went with it)."""
        while not self._lost and self._events.poll(0):
            event = recv_monitor_message(self._events)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                self._lost = True
        return self._lost

    def close(self) -> None:
        self.socket.disable_monitor()
        self._events.close(linger=0)
        self.socket.close(linger=0)
