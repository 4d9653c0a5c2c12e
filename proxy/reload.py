"""Which settings a reload (SIGHUP, ``POST /-/reload``) applies, and which wait for a restart.

A reload reads the configuration again (the ``--config`` file with the flags on top),
validates all of it, and applies what can change under a running process; anything else
keeps its running value, and the log names each such key. ``proxy.runtime`` does the
applying; this module only compares settings, so the rule is one list, testable alone.

Live: the enrichment and ``upstream.max_labels_per_series`` (a new splice plan, swapped
between requests), the description files and the built-in switch (the engine
re-evaluates, the index follows), the jq sandbox's time and memory limits (its child
restarted with them), ``log_level``. The TLS certificate, key and client CA
are loaded again, and so are the upstream's TLS files
(their paths are not live); both are tried before anything is applied. Credential files
need nothing: the upstream re-reads them whenever they change.

Restart: the listening address, the worker threads and every other ``server`` bound (fixed
when the listener and the pool are made), the upstream (one pooled session), the index
source, the fact writer, ``log_format``; the rest of ``upstream``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from proxy.config import Section, Settings

#: dotted keys (or sections) the splice plan is built from: a reload that changes one
#: builds a new plan (``proxy.runtime.enrich_arguments`` reads them)
PLAN_KEYS: tuple[str, ...] = (
    "enrich",
    "upstream.max_labels_per_series",
)
#: the jq sandbox's limits: a reload that changes one restarts its child with them
#: (``karta.jq_sandbox`` itself takes a restart)
JQ_LIMIT_KEYS: tuple[str, ...] = (
    "karta.jq_timeout_seconds",
    "karta.jq_memory_limit_bytes",
)
#: dotted keys (or sections) a reload applies; everything else takes a restart
LIVE_KEYS: tuple[str, ...] = (
    *PLAN_KEYS,
    "karta.description_paths",
    "karta.builtins",
    *JQ_LIMIT_KEYS,
    "log_level",
)


@dataclass(frozen=True)
class ReloadOutcome:
    """What one reload did: applied or not, why not, and what waits for a restart."""

    ok: bool
    #: why the reload failed (the new configuration was not applied); "" when ok
    error: str = ""
    #: keys changed and applied
    applied: tuple[str, ...] = ()
    #: keys changed in the file but kept at their running value until a restart
    restart_required: tuple[str, ...] = ()
    #: description files found empty whose descriptions of the last load stay in force
    #: (``proxy.karta.description.read_description_paths``)
    kept_empty_files: tuple[str, ...] = ()


def _under(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def is_live(key: str) -> bool:
    return _under(key, LIVE_KEYS)


def is_plan_key(key: str) -> bool:
    """Does a change of this key take a new splice plan?"""
    return _under(key, PLAN_KEYS)


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ; a section is walked, anything else is a value."""
    out: list[str] = []
    for name in old.__struct_fields__:
        key = f"{prefix}{name}"
        a, b = getattr(old, name), getattr(new, name)
        if isinstance(a, Section):
            out.extend(changed_keys(a, b, key + "."))
        elif a != b:
            out.append(key)
    return out


def _set(settings: Settings, key: str, value: Any) -> None:
    *path, name = key.split(".")
    target: Any = settings
    for part in path:
        target = getattr(target, part)
    setattr(target, name, value)


def _get(settings: Settings, key: str) -> Any:
    target: Any = settings
    for part in key.split("."):
        target = getattr(target, part)
    return target


@dataclass(frozen=True)
class Merge:
    """The settings to run with after a reload, and how they came about."""

    settings: Settings
    applied: tuple[str, ...]
    restart_required: tuple[str, ...]


def with_keys(running: Settings, loaded: Settings, keys: list[str] | tuple[str, ...]
              ) -> Settings:
    """A copy of ``running`` with these keys' values of ``loaded``: what a reload that
    failed while applying had applied (``proxy.runtime``), so the settings in force say
    so and the next reload compares with them."""
    out = copy.deepcopy(running)
    for k in keys:
        _set(out, k, copy.deepcopy(_get(loaded, k)))
    return out


def merge(running: Settings, loaded: Settings) -> Merge:
    """The running settings with the live keys of ``loaded`` in them."""
    keys = changed_keys(running, loaded)
    applied = tuple(k for k in keys if is_live(k))
    out = copy.deepcopy(running)
    for k in applied:
        _set(out, k, copy.deepcopy(_get(loaded, k)))
    return Merge(out, applied, tuple(k for k in keys if not is_live(k)))
