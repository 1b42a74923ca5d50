"""`gyre.embedded.free_port` picks ports outside the kernel's ephemeral range, where no outgoing
connection can take them between the pick and the server's bind (a CI run lost a service that way)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gyre.embedded import free_port, ports
from gyre.embedded.ports import LOWEST_PORT, ephemeral_port_range


def test_a_picked_port_lies_outside_the_ephemeral_range_and_can_be_bound() -> None:
    first, last = ephemeral_port_range()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert not first <= port <= last
        assert port >= LOWEST_PORT
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_port_held_by_a_listener_is_never_picked(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", free_port("127.0.0.1")))
        held.listen()
        taken = held.getsockname()[1]
        # Leave the held port as the only one outside the range: every try finds it taken, and the
        # kernel picks instead.
        monkeypatch.setattr(ports, "LOWEST_PORT", taken)
        assert free_port("127.0.0.1", ephemeral=(taken + 1, 65_535)) != taken


def test_with_no_room_outside_the_range_the_kernel_picks() -> None:
    port = free_port("127.0.0.1", ephemeral=(1024, 65_535))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))


def test_an_unreadable_range_file_means_linux_default(tmp_path: Path) -> None:
    assert ephemeral_port_range(tmp_path / "missing") == (32_768, 60_999)
    (tmp_path / "range").write_text("20000\t30000\n")
    assert ephemeral_port_range(tmp_path / "range") == (20_000, 30_000)
