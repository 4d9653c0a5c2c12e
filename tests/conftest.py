"""The whole suite's plugins: the watchdog that ends a hung run with every thread's and
every asyncio task's stack (tests/watchdog.py, ``KARTA_TEST_TIMEOUT``); and the fixtures
shared across folders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.karta.jq_sandbox import JqSandbox
from proxy.karta.jqexpr import install_runner, remove_runner

pytest_plugins = ["tests.watchdog"]


@pytest.fixture
def installed_sandbox() -> Iterator[JqSandbox]:
    """The real jq sandbox as the runner every expression goes through, as in the proxy."""
    box = JqSandbox(timeout_seconds=5.0)
    install_runner(box)
    try:
        yield box
    finally:
        remove_runner(box)
        box.close()
