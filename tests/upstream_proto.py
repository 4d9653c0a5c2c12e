"""Message classes from the upstream Prometheus .proto files in ../shared/proto-upstream.

Compiled with protoc into a private descriptor pool (the upstream files share package and
message names with the project's own, so they must not enter the default pool). The
gogoproto import and options are stripped: they only steer Go code generation.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
UPSTREAM = SHARED / "proto-upstream"

_GOGO_IMPORT = re.compile(r'^import "gogoproto/gogo.proto";\s*$', re.MULTILINE)
_GOGO_OPTION = re.compile(r"\s*\[\s*\(gogoproto\.[a-z_]+\)\s*=\s*[a-z]+\s*\]")


def compile_upstream(tmp: Path, files: list[str], root: Path = UPSTREAM) -> dict[str, Any]:
    """Message classes by full name, or pytest.skip when the files or protoc are absent."""
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc not installed")
    if not all((root / f).is_file() for f in files):
        pytest.skip(f"upstream protos not found under {root}")
    src = tmp / "src"
    for f in files:
        text = (root / f).read_text()
        text = _GOGO_OPTION.sub("", _GOGO_IMPORT.sub("", text))
        dst = src / f
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(text)
    out = tmp / "upstream.pb"
    subprocess.run(
        [protoc, f"-I{src}", "--include_imports", f"--descriptor_set_out={out}", *files],
        check=True,
        cwd=src,
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    pool = descriptor_pool.DescriptorPool()
    for fdp in fds.file:
        pool.Add(fdp)
    classes: dict[str, Any] = {}
    for fdp in fds.file:
        for msg in fdp.message_type:
            full = f"{fdp.package}.{msg.name}" if fdp.package else msg.name
            classes[full] = message_factory.GetMessageClass(pool.FindMessageTypeByName(full))
    return classes


def upstream_v1(tmp: Path) -> dict[str, Any]:
    return compile_upstream(tmp, ["types.proto", "remote.proto"])


def upstream_v2(tmp: Path) -> dict[str, Any]:
    return compile_upstream(tmp, ["io/prometheus/write/v2/types.proto"])
