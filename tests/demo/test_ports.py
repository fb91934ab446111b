"""The rendezvous port is drawn below the kernel's ephemeral range and is free when returned."""

import socket

from sdc_forensics.demo import ports


def test_the_port_is_below_the_ephemeral_range_and_bindable():
    low = ports._ephemeral_low()
    for _ in range(20):
        port = ports.free_port()
        if low - ports.LOWEST >= 1000:
            assert ports.LOWEST <= port < low
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_in_use_is_never_returned(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST + 1000)
        real = ports.random.SystemRandom.randrange
        calls = []

        def draw(self, a, b):
            # the taken port three times, then the real draw
            calls.append(a)
            return taken if len(calls) <= 3 else real(self, a, b)

        monkeypatch.setattr(ports.random.SystemRandom, "randrange", draw)
        port = ports.free_port()
    assert port != taken and len(calls) >= 4


def test_no_room_below_the_range_falls_back_to_the_kernels_choice(monkeypatch):
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: ports.LOWEST + 10)
    assert ports.free_port() > 0
