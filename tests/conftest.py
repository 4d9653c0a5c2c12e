"""The whole suite's plugins: the watchdog that ends a hung run with every thread's and
every asyncio task's stack (tests/watchdog.py, ``KARTA_TEST_TIMEOUT``)."""

pytest_plugins = ["tests.watchdog"]
