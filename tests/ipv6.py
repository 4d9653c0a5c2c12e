"""Whether this machine has an IPv6 loopback, for the tests that listen or connect on ::1
(a container without IPv6 has none: they skip there, cleanly)."""

from __future__ import annotations

import socket

import pytest


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


needs_ipv6 = pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback (::1) here")
