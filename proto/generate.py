#!/usr/bin/env python3
"""Regenerate ``proxy/pb`` from the project's ``.proto`` files.

The generated modules are committed so that the proxy needs no compiler at run time.
protoc writes absolute imports (``from prometheus import types_pb2``) that only work with
the proto root on ``sys.path``; they are rewritten to the ``proxy.pb`` package so the
modules import like any other part of the proxy. ``tests/test_proto.py`` calls
:func:`generate` into a temporary folder and fails when the committed modules differ.

Usage: ``python3 proto/generate.py [--protoc PATH] [--out DIR]`` (default out: proxy/pb).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent
DEFAULT_OUT = REPO_ROOT / "proxy" / "pb"
PACKAGE = "proxy.pb"

#: every .proto of the project, relative to PROTO_ROOT (imports resolve against it)
PROTO_FILES: tuple[str, ...] = (
    "prometheus/types.proto",
    "prometheus/remote.proto",
    "io/prometheus/write/v2/types.proto",
)

_IMPORT = re.compile(r"^from ((?:[A-Za-z_][A-Za-z0-9_]*\.)*[A-Za-z_][A-Za-z0-9_]*) import "
                     r"([A-Za-z0-9_]+_pb2) as ", re.MULTILINE)


def _rewrite(source: str) -> str:
    def sub(m: re.Match[str]) -> str:
        return f"from {PACKAGE}.{m.group(1)} import {m.group(2)} as "

    return _IMPORT.sub(sub, source)


def generate(out: Path, protoc: str = "protoc") -> list[Path]:
    """Compile every project .proto into ``out`` (a package tree); returns the files."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [protoc, f"-I{PROTO_ROOT}", f"--python_out={tmp}", *PROTO_FILES],
            check=True,
            cwd=PROTO_ROOT,
        )
        written: list[Path] = []
        out.mkdir(parents=True, exist_ok=True)
        init = out / "__init__.py"
        if not init.exists():
            init.write_text('"""Modules generated from proto/ (see proto/README.md)."""\n')
        for src in sorted(Path(tmp).rglob("*_pb2.py")):
            rel = src.relative_to(tmp)
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            # every folder on the way is a package
            folder = dst.parent
            while folder != out:
                (folder / "__init__.py").touch()
                folder = folder.parent
            dst.write_text(_rewrite(src.read_text()))
            written.append(dst)
        return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--protoc", default=shutil.which("protoc") or "protoc")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    for path in generate(args.out, args.protoc):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
