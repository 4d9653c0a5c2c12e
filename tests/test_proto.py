"""The generated modules in proxy/pb agree with proto/*.proto, and the protos with upstream.

With protoc installed the modules are regenerated into a temporary folder and compared
byte for byte, and the descriptors protoc reads from the .proto files are compared with
the ones the modules register. Without protoc a small reader of the project's own .proto
syntax still compares every field (name, number, label, type) with the modules, so the
test keeps failing on drift on a machine without a compiler.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from proxy.pb.io.prometheus.write.v2 import types_pb2 as v2_pb2
from proxy.pb.prometheus import remote_pb2, types_pb2
from tests.upstream_proto import upstream_v1, upstream_v2

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT / "proto"
PB = ROOT / "proxy" / "pb"

MODULES: dict[str, ModuleType] = {
    "prometheus/types.proto": types_pb2,
    "prometheus/remote.proto": remote_pb2,
    "io/prometheus/write/v2/types.proto": v2_pb2,
}


def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("proto_generate", PROTO / "generate.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_proto_file_is_generated() -> None:
    gen = _generate_module()
    on_disk = sorted(str(p.relative_to(PROTO)) for p in PROTO.rglob("*.proto"))
    assert sorted(gen.PROTO_FILES) == on_disk
    assert sorted(MODULES) == on_disk


def test_regenerated_modules_match_committed(tmp_path: Path) -> None:
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc not installed (the field comparison below still runs)")
    gen = _generate_module()
    written = gen.generate(tmp_path / "pb", protoc)
    assert written
    for path in written:
        rel = path.relative_to(tmp_path / "pb")
        committed = PB / rel
        assert committed.is_file(), f"{rel} is generated but not committed"
        assert committed.read_text() == path.read_text(), (
            f"proxy/pb/{rel} differs from proto/: run python3 proto/generate.py"
        )


def test_descriptors_match_protoc(tmp_path: Path) -> None:
    protoc = shutil.which("protoc")
    if protoc is None:
        pytest.skip("protoc not installed")
    out = tmp_path / "set.pb"
    subprocess.run(
        [protoc, f"-I{PROTO}", f"--descriptor_set_out={out}", *MODULES],
        check=True,
        cwd=PROTO,
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    assert len(fds.file) == len(MODULES)
    for fdp in fds.file:
        mine = descriptor_pb2.FileDescriptorProto.FromString(
            MODULES[fdp.name].DESCRIPTOR.serialized_pb
        )
        _strip_json_names(fdp)
        _strip_json_names(mine)
        assert mine == fdp, f"{fdp.name}: generated module and .proto disagree"


def _strip_json_names(fdp: descriptor_pb2.FileDescriptorProto) -> None:
    """protoc fills json_name in descriptor sets, not in Python modules: not a difference."""

    def visit(msg: descriptor_pb2.DescriptorProto) -> None:
        for f in msg.field:
            f.ClearField("json_name")
        for nested in msg.nested_type:
            visit(nested)

    for msg in fdp.message_type:
        visit(msg)


# -- a reader of the project's own .proto syntax (no protoc needed) ------------------------

_TOKEN = re.compile(r"//[^\n]*|[{};=]|[A-Za-z_][A-Za-z0-9_.]*|\d+|\S")

_TYPES = {
    "double": FieldDescriptor.TYPE_DOUBLE,
    "int64": FieldDescriptor.TYPE_INT64,
    "uint64": FieldDescriptor.TYPE_UINT64,
    "uint32": FieldDescriptor.TYPE_UINT32,
    "sint32": FieldDescriptor.TYPE_SINT32,
    "sint64": FieldDescriptor.TYPE_SINT64,
    "string": FieldDescriptor.TYPE_STRING,
    "bytes": FieldDescriptor.TYPE_BYTES,
    "bool": FieldDescriptor.TYPE_BOOL,
}


def read_proto(text: str) -> dict[str, dict[str, tuple[int, bool, Any]]]:
    """message full name -> field name -> (number, repeated, scalar type or type name)."""
    toks = [t for t in _TOKEN.findall(text) if not t.startswith("//")]
    package = ""
    messages: dict[str, dict[str, tuple[int, bool, Any]]] = {}
    stack: list[tuple[str, str]] = []  # (kind, name)
    i = 0
    while i < len(toks):
        t = toks[i]
        if t == "package":
            package = toks[i + 1]
            i += 3
        elif t in ("message", "enum", "oneof"):
            stack.append((t, toks[i + 1]))
            if t == "message":
                name = ".".join([package, *[n for k, n in stack if k == "message"]])
                messages[name] = {}
            i += 3
        elif t == "}":
            stack.pop()
            i += 1
        elif t in ("syntax", "import", "option", "reserved"):
            while toks[i] != ";":
                i += 1
            i += 1
        elif stack and stack[-1][0] == "enum":
            i += 4  # NAME = N ;
        elif stack:
            repeated = t == "repeated"
            if repeated:
                i += 1
            ftype, fname, eq, num = toks[i : i + 4]
            assert eq == "=", f"cannot read field near {toks[i : i + 5]}"
            owner = ".".join([package, *[n for k, n in stack if k == "message"]])
            messages[owner][fname] = (int(num), repeated, _TYPES.get(ftype, ftype))
            i += 5
        else:
            i += 1
    return messages


def _is_repeated(field: Any) -> bool:
    """``FieldDescriptor.is_repeated`` came in protobuf 6.31 and ``label`` went in 7: the
    runtime bound (pyproject, 5.26) is older than the one and the tested newest has only the
    other, so the wire-shape checks read whichever the installed protobuf has."""
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def _module_fields(mod: ModuleType) -> dict[str, dict[str, tuple[int, bool, Any]]]:
    out: dict[str, dict[str, tuple[int, bool, Any]]] = {}

    def visit(desc: Any) -> None:
        fields = {}
        for f in desc.fields:
            repeated = _is_repeated(f)
            kind: Any = f.type
            if f.type == FieldDescriptor.TYPE_MESSAGE:
                kind = f.message_type.name
            elif f.type == FieldDescriptor.TYPE_ENUM:
                kind = f.enum_type.name
            fields[f.name] = (f.number, repeated, kind)
        out[desc.full_name] = fields
        for nested in desc.nested_types:
            visit(nested)

    for desc in mod.DESCRIPTOR.message_types_by_name.values():
        visit(desc)
    return out


@pytest.mark.parametrize("proto_file", sorted(MODULES))
def test_fields_match_without_protoc(proto_file: str) -> None:
    declared = read_proto((PROTO / proto_file).read_text())
    generated = _module_fields(MODULES[proto_file])
    assert declared.keys() == generated.keys()
    for msg, fields in declared.items():
        short = {k: (n, r, t.rsplit(".", 1)[-1] if isinstance(t, str) else t)
                 for k, (n, r, t) in fields.items()}
        assert short == generated[msg], f"{proto_file}: {msg} differs from proxy/pb"


def test_reader_sees_a_changed_field_number() -> None:
    text = (PROTO / "prometheus/types.proto").read_text()
    changed = text.replace("int64 timestamp = 2;", "int64 timestamp = 7;", 1)
    assert read_proto(changed) != read_proto(text)


# -- wire compatibility with upstream ------------------------------------------------------


def _wire_shape(desc: Any) -> dict[int, tuple[int, bool]]:
    return {f.number: (f.type, _is_repeated(f)) for f in desc.fields}


def _compare_with_upstream(
    mine: Any, theirs: Any, allow_extra: frozenset[int] = frozenset()
) -> None:
    ours = _wire_shape(mine)
    upstream = _wire_shape(theirs)
    extra = set(ours) - set(upstream)
    assert extra <= allow_extra, f"{mine.full_name}: fields {extra} not upstream"
    for number, shape in upstream.items():
        assert ours.get(number) == shape, f"{mine.full_name} field {number} differs upstream"


def test_v1_wire_compatible_with_upstream(tmp_path: Path) -> None:
    up = upstream_v1(tmp_path)
    for name in ("WriteRequest", "TimeSeries", "Label", "Sample", "Exemplar", "Histogram",
                 "BucketSpan", "MetricMetadata"):
        mod = remote_pb2 if name == "WriteRequest" else types_pb2
        _compare_with_upstream(
            getattr(mod, name).DESCRIPTOR, up[f"prometheus.{name}"].DESCRIPTOR
        )


def test_v2_wire_compatible_with_upstream(tmp_path: Path) -> None:
    up = upstream_v2(tmp_path)
    for name in ("Request", "TimeSeries", "Sample", "Exemplar", "Histogram", "BucketSpan",
                 "Metadata"):
        # created_timestamp = 6 is rc.3's, reserved upstream since rc.4
        extra = frozenset({6}) if name == "TimeSeries" else frozenset()
        _compare_with_upstream(
            getattr(v2_pb2, name).DESCRIPTOR,
            up[f"io.prometheus.write.v2.{name}"].DESCRIPTOR,
            extra,
        )
