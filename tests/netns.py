"""A network of the test's own, where packets can be dropped for real (Linux network namespaces).

A relay (tests/relay.py) can hold bytes back, but its kernel still acknowledges them and answers TCP keepalive
probes: a peer that went dark (a host powered off, a route gone: packets dropped, no reset) is more than that. In
``private_network()`` the calling thread (the test's event loop) works in a new network namespace with only a
loopback of its own: a Relay made there listens in it and reaches the real servers from its own thread, outside.
``drop(ports)`` then makes the kernel discard every packet of those connections, both ways, by port (``ip rule``
blackholes): the connections that went through the relay before are dark, and new ones still pass.

Needs Linux, CAP_SYS_ADMIN and CAP_NET_ADMIN (root, as CI runs) and the ``ip`` command (iproute2): otherwise the
test is skipped, saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from collections.abc import Iterable, Iterator

import pytest

CLONE_NEWNET = 0x40000000  # <sched.h>: Python 3.11 has no os.unshare / os.setns
DROP_FROM = 10  # preference of the first blackhole rule; the local table's lookup moves behind them
_home: int | None = None  # while a private network is in use: the namespace the test started in (an open fd)


def at_home() -> None:
    """Put the calling thread (a new one: it starts in its maker's namespace) back in the namespace the test started
    in, when a private network is in use: a relay's own thread, which reaches the real servers."""
    if _home is not None and ctypes.CDLL(None, use_errno=True).setns(_home, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "could not return to the network namespace the test started in")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def private_network() -> Iterator[None]:
    """The calling thread in a network namespace of its own (loopback up, local lookups behind ``drop``'s rules)
    until the block ends; sockets it opened meanwhile keep working afterwards, in that namespace."""
    if not hasattr(os, "O_RDONLY") or shutil.which("ip") is None or not os.path.exists("/proc/thread-self/ns/net"):
        pytest.skip("a network namespace of the test's own needs Linux and the ip command (iproute2)")
    global _home
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        if libc.unshare(CLONE_NEWNET) != 0:
            said = os.strerror(ctypes.get_errno())
            pytest.skip(f"a network namespace of the test's own needs CAP_SYS_ADMIN ({said})")
        _home = home
        try:
            _ip("link", "set", "lo", "up")
            _ip("rule", "del", "pref", "0")  # the local table first would bypass every rule below
            _ip("rule", "add", "pref", "1000", "lookup", "local")
            yield
        finally:
            _home = None
            if libc.setns(home, CLONE_NEWNET) != 0:  # (never expected: a test thread left elsewhere fails loudly)
                raise OSError(ctypes.get_errno(), "could not return to the network namespace the test started in")
    finally:
        os.close(home)


def drop(ports: Iterable[int]) -> None:
    """Discard every packet from or to these local TCP ports from now on (in the private network): no byte, no
    acknowledgement, no reset. Other ports pass."""
    for n, port in enumerate(ports):
        _ip("rule", "add", "pref", str(DROP_FROM + 2 * n), "ipproto", "tcp", "sport", str(port), "blackhole")
        _ip("rule", "add", "pref", str(DROP_FROM + 2 * n + 1), "ipproto", "tcp", "dport", str(port), "blackhole")
