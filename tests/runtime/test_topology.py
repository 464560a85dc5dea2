"""runtime.topology's free ports: drawn below the kernel's ephemeral range, each one bindable when returned."""

from __future__ import annotations

import socket

from runtime.topology import _ephemeral_low, free_port, free_ports


def test_free_ports_are_consecutive_bindable_and_below_the_ephemeral_range() -> None:
    for _ in range(20):
        base = free_ports(4)
        assert 10000 <= base and base + 4 <= _ephemeral_low()
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", base))
            b.bind(("127.0.0.1", base + 3))


def test_a_port_held_by_a_listener_is_never_returned() -> None:
    held = []
    try:
        for _ in range(50):
            s = socket.socket()
            held.append(s)
            s.bind(("127.0.0.1", free_port()))
            s.listen()
        ports = [s.getsockname()[1] for s in held]
        assert len(set(ports)) == len(ports)  # each draw skipped every port the earlier listeners hold
    finally:
        for s in held:
            s.close()
