"""The sandbox's free loopback ports: drawn together they are distinct and free, and none is a
port to avoid (an operator's liveness and metrics ports once came out equal, and its second
bind was refused)."""

from __future__ import annotations

from rankguard_sim.kube.cluster import free_port, free_ports, port_is_free


def test_ports_drawn_together_are_distinct_free_and_not_the_ones_to_avoid() -> None:
    apiserver = free_port()
    ports = free_ports(200, avoid=(apiserver,))
    assert len(set(ports)) == 200 and apiserver not in ports
    assert all(port_is_free(p) for p in ports)  # released once drawn
