"""The suite's port helper: stop 48's CI failed when two ports asked for back to back were one port."""

from __future__ import annotations

import socket
from pathlib import Path

from conftest import LOOPBACK, _port_slice, find_free_port


def test_ports_asked_for_back_to_back_differ_are_free_and_stay_below_the_ephemeral_range():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    held = socket.socket()
    held.bind((LOOPBACK, 0))  # a port the OS handed out: never one of ours
    try:
        ports = [find_free_port() for _ in range(300)]
        assert len(set(ports)) == 300 and held.getsockname()[1] not in ports
        assert all(port < low for port in ports)
        mine = _port_slice()
        turn = mine.index(ports[-1])
        taken = socket.socket()
        taken.bind((LOOPBACK, mine[(turn + 1) % len(mine)]))  # the next in turn is in use: it is skipped
        try:
            assert find_free_port() == mine[(turn + 2) % len(mine)]
        finally:
            taken.close()
    finally:
        held.close()
