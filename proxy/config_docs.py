"""config/karta-proxy.yaml and the settings tables of docs/configuration.md, from the schema.

``python -m proxy.config_docs --write`` regenerates both after a setting is added or
changed in ``proxy.config``; tests/test_config.py fails while they disagree with it. The
YAML file is generated whole (a comment from each setting's help, its flag, its default);
in the docs tables the key and default columns are generated and the meaning column is
kept as written (a new key starts with its help), because it says more than one line can.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import yaml

from proxy.config import MiB, SettingInfo, Settings, schema

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "karta-proxy.yaml"
DOC = REPO / "docs" / "configuration.md"

_HEADER = """\
# karta-proxy configuration: every key with its default (docs/configuration.md explains each).
# Pass it with --config FILE; command-line flags override what is set here.
# Unknown keys and wrong types are errors (exit code 2), so typos do not go unnoticed.
# Generated from proxy/config.py by `python -m proxy.config_docs --write`: edit it there.
"""
_WIDTH = 92


def _plain(value: Any) -> Any:
    """Builtins as a person writes them: a pod-label pair without ``unless`` as [ns, pod]."""
    if isinstance(value, dict):
        if set(value) == {"namespace", "pod", "unless"} and not value["unless"]:
            return [value["namespace"], value["pod"]]
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


class _Dumper(yaml.SafeDumper):
    """Block sequences indented under their key, as the rest of config/ writes them."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        super().increase_indent(flow, False)


def _flow(value: Any) -> str:
    """One YAML value on one line."""
    if value == "":
        return '""'
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False)
    return text.removesuffix("\n").removesuffix("\n...").strip()


def _size(info: SettingInfo, value: Any) -> str:
    if info.key.endswith("_bytes") and isinstance(value, int) and value >= MiB \
            and value % MiB == 0:
        return f"{value // MiB} MiB"
    return ""


def _yaml_setting(info: SettingInfo, indent: str) -> list[str]:
    name = info.key.rpartition(".")[2]
    lines = [f"{indent}# {line}" for line in
             textwrap.wrap(info.help, _WIDTH - len(indent) - 2, break_on_hyphens=False)]
    if info.flag is not None:
        env = f", ${info.flag.env}" if info.flag.env else ""
        lines.append(f"{indent}# flag: {', '.join(info.flag.names)}{env}")
    value = _plain(msgspec.to_builtins(info.example))
    if isinstance(value, list | dict) and value:
        leaves = isinstance(value, list) and not any(isinstance(v, list | dict) for v in value)
        block = yaml.dump({name: value}, Dumper=_Dumper, sort_keys=False, width=_WIDTH,
                          default_flow_style=False if leaves else None)
        lines += [indent + line for line in block.splitlines()]
    else:
        size = _size(info, value)
        lines.append(f"{indent}{name}: {_flow(value)}" + (f"   # {size}" if size else ""))
    return lines


def _section_doc(section: str) -> str:
    """The docstring of a section's class (``upstream.oauth2``: a section in a section)."""
    value: Any = Settings()
    for part in section.split("."):
        value = getattr(value, part)
    return " ".join((type(value).__doc__ or "").split())


def example_yaml() -> str:
    """config/karta-proxy.yaml: every section and key, in declaration order; a section
    within a section (``upstream.oauth2``) comes last in its parent, indented under it."""
    out = [_HEADER]
    section = None
    for info in schema():
        if info.section != section:
            section = info.section
            depth = section.count(".")
            indent = "  " * depth
            out += ["", *(f"{indent}# {line}" for line in textwrap.wrap(
                _section_doc(section), _WIDTH - len(indent) - 2)),
                f"{indent}{section.rpartition('.')[2]}:"] if section else ["", "# Top level."]
        out += _yaml_setting(info, "  " * (section.count(".") + 1) if section else "")
    return "\n".join(out) + "\n"


def _doc_default(info: SettingInfo) -> str:
    if info.default_doc:
        return info.default_doc
    value = _plain(msgspec.to_builtins(info.default))
    text = f"`{_flow(value) if not isinstance(value, str) or not value else value}`"
    size = _size(info, value)
    return (text + (f" ({size})" if size else "")).replace("|", "\\|")


_ROW = re.compile(r"^\| `(?P<key>[^`]+)` \| (?P<default>.*?) \| (?P<meaning>.*) \|$")
_TABLE_HEAD = "| key | default | meaning |\n|---|---|---|\n"


def doc_tables(text: str) -> str:
    """docs/configuration.md with each section's table regenerated from the schema."""
    meanings = {m["key"]: m["meaning"] for line in text.splitlines()
                if (m := _ROW.match(line))}
    sections: dict[str, list[SettingInfo]] = {}
    for info in schema():
        sections.setdefault(info.section, []).append(info)
    for section, infos in sections.items():
        level = "#" * (2 + section.count("."))  # a section within one: a subheading
        heading = f"{level} `{section}`\n" if section else "## Top level\n"
        start = text.index(heading) + len(heading)
        head = text.index(_TABLE_HEAD, start)
        end = head + len(_TABLE_HEAD)
        while text.startswith("|", end):
            end = text.index("\n", end) + 1
        rows = "".join(
            f"| `{i.key}` | {_doc_default(i)} | {meanings.get(i.key) or i.help} |\n"
            for i in infos)
        text = text[:head] + _TABLE_HEAD + rows + text[end:]
    return text


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.config_docs", description=__doc__)
    p.add_argument("--write", action="store_true", help="rewrite the files (else: check)")
    args = p.parse_args(argv)
    stale = []
    for path, want in ((EXAMPLE, example_yaml()), (DOC, doc_tables(DOC.read_text()))):
        if path.read_text() != want:
            stale.append(path)
            if args.write:
                path.write_text(want)
    for path in stale:
        print(f"{'rewrote' if args.write else 'stale'}: {path.relative_to(REPO)}")
    return 1 if stale and not args.write else 0


if __name__ == "__main__":
    sys.exit(main())
