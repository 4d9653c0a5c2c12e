"""``python -m proxy`` is the same as the ``karta-proxy`` console script."""

from proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
