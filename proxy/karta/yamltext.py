"""Reading YAML text: libyaml's safe loader where present, and a parse error as one line.

Description files, snapshot files and the configuration file all tell an operator that a
file is not valid YAML; the line and column are what finds the mistake, so all three say
it in one wording, made here. It sits in ``proxy.karta`` because the engine's package
imports nothing above it (``tests/test_layout.py``) and its description files need it.
"""

from __future__ import annotations

from typing import Any

import yaml

#: libyaml's safe loader when present: several times faster on big snapshots
Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

#: a reason is a log line and an attribution-page cell, not a dump of the file
_LIMIT = 300


def yaml_error(exc: yaml.YAMLError) -> str:
    """``invalid YAML: line L, column C: problem (context at line L, column C)``, positions
    1-based as editors count them; an error without a position is its own text. One line,
    at most ``_LIMIT`` characters."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return _one_line(f"invalid YAML: {exc}")
    text = f"invalid YAML: line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context = getattr(exc, "context", None)
    context_mark = getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} at line {context_mark.line + 1}, column {context_mark.column + 1})"
    elif context:
        text += f" ({context})"
    return _one_line(text)


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _LIMIT else text[: _LIMIT - 3] + "..."
