"""A pytest plugin (`pytest -p tests.leakcheck`, on in `make test`): a test that leaves a socket, or an asyncio
socket transport, open past its end errors in its own teardown, naming where the socket was made.

Without it such a leak surfaces as an unclosed-socket ResourceWarning (an error in this suite) whenever the
garbage collector next runs, under whatever test runs then, and only if the socket has become garbage by then:
that is how a Redis Cluster store's close, which left its connections open after losing a node, showed up as a
rare failure of an unrelated test. Checked: sockets made during the test and still open after its teardown;
transports still open once their event loop has closed. A socket a session fixture opens during a test's setup
counts as that test's: run with the fixture's test first, or read the stack."""

from __future__ import annotations

import asyncio.selector_events
import socket
import traceback
import weakref
from collections.abc import Generator
from typing import Any

import pytest

_made: weakref.WeakKeyDictionary[Any, tuple[str, str]] = weakref.WeakKeyDictionary()
_current = ["(between tests)"]


def _track(cls: Any) -> None:
    init = cls.__init__

    def tracking_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _made[self] = (_current[0], "".join(traceback.format_stack(limit=16)[:-1]))

    cls.__init__ = tracking_init


def pytest_configure(config: pytest.Config) -> None:
    _track(socket.socket)
    _track(asyncio.selector_events._SelectorSocketTransport)  # type: ignore[attr-defined]  # (not in typeshed)


def _still_open(thing: Any) -> bool:
    if isinstance(thing, socket.socket):
        return thing.fileno() != -1
    return thing._sock is not None and thing._loop.is_closed()  # a transport its closed loop can no longer close


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    _current[0] = item.nodeid
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, None, None]:
    result = yield
    _current[0] = "(between tests)"
    left = [(thing, stack) for thing, (nodeid, stack) in list(_made.items())
            if nodeid == item.nodeid and _still_open(thing)]
    for thing, _ in left:
        del _made[thing]  # said once
    if left:
        raise AssertionError("left open by this test:\n" + "\n".join(f"{thing!r}, made at\n{stack}"
                                                                     for thing, stack in left))
    return result
