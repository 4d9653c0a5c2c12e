"""The project's own descriptions of core Kubernetes kinds, shipped as YAML beside this file.

They use the run.ai Karta form so that they read like any user description and go through
the same parser and validation; a user description of the same GroupKind replaces one.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from proxy.karta.description import DescriptionError, parse_description
from proxy.karta.model import Description

_HERE = Path(__file__).resolve().parent


def builtin_files() -> list[Path]:
    return sorted(_HERE.glob("*.yaml"))


@lru_cache(maxsize=1)
def _load() -> tuple[Description, ...]:
    out: list[Description] = []
    for path in builtin_files():
        for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            if doc is None:
                continue
            name = (doc.get("metadata") or {}).get("name", "") if isinstance(doc, dict) else ""
            if not name:  # a built-in without a name is a bug of ours: fail loudly
                raise DescriptionError(f"builtin:{path.name}", "", "metadata.name", "required")
            out.append(parse_description(doc, f"builtin:{name}", builtin=True))
    return tuple(out)


def builtin_descriptions() -> list[Description]:
    """Every built-in description, parsed once per process (a broken one raises)."""
    return list(_load())
