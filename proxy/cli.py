"""``karta-proxy`` command line (also ``python -m proxy``), and the ``demo`` subcommand.

Precedence: flags > ``--config`` YAML > built-in defaults (``NODE_NAME`` and
``KUBECONFIG`` stand in for their flags when those are absent). An invalid setting ends
the process before anything starts with one line on stderr and exit code 2, the
convention of argparse, so supervisors and scripts can tell it from a runtime failure.
"""

from __future__ import annotations

# ruff: noqa: E402 (the early signal handlers come before the imports: see _record_early)
import os
import signal

#: SIGTERM / SIGINT / SIGHUP that came while this module's imports ran (recorded as PID 1)
_EARLY: set[int] = set()


def _record_early(signum: int, frame: object) -> None:
    _EARLY.add(signum)


# As PID 1 (a container without an init) a signal whose action is the default is dropped
# by the kernel: a SIGTERM in the ~0.2 s of imports before ``EarlySignals`` was lost and
# the proxy started and ran on. There it is recorded from here, before the heavy imports,
# and ``EarlySignals`` acts on it. Elsewhere the default action ends the process anyway.
_BEFORE_EARLY: dict[int, object] = {}
if os.getpid() == 1:
    for _sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        _BEFORE_EARLY[_sig] = signal.signal(_sig, _record_early)

import argparse
import asyncio
import contextlib
import functools
import logging
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from msgspec import inspect as mi

from proxy import __version__
from proxy.config import (
    ConfigError,
    Flag,
    Section,
    SettingInfo,
    Settings,
    canonical_choice,
    load_settings,
    schema,
    validate,
)
from proxy.contract import CONTRACT_VERSION
from proxy.wire.native import DEFAULT as SPLICE

PROG = "karta-proxy"
EXIT_USAGE = 2

_EPILOG = """\
subcommands:
  karta-proxy demo [--help]   run the bundled demo: a proxy on a bundled snapshot, a batch
                              of cAdvisor, kubelet and DCGM series replayed through it,
                              series before/after and a per-workload summary (loopback only)

Precedence: flags override the --config file, which overrides the defaults. Every setting,
with its YAML key, is in docs/configuration.md; config/karta-proxy.yaml shows them all.

Without --snapshot the index comes from the Kubernetes API (in-cluster service account, or
--kubeconfig / KUBECONFIG). Environment: KUBECONFIG and NODE_NAME stand in for absent
flags; POD_NAMESPACE (else the service account's namespace) places the fact writer's Lease.
In node mode (--node-name) no fact series are written (facts.allow_in_node_mode).

Endpoints (docs/operations.md, Endpoints): POST /api/v1/write, /api/v1/push,
/api/v1/receive, /insert/<tenant>/prometheus/api/v1/write (remote write 1.0 and 2.0,
snappy or zstd); GET /metrics, /-/healthy, /-/ready, /; GET /attribution (why a pod has
its labels, or none), /api/v1/attribution?namespace=NS&pod=NAME,
/api/v1/attribution/unattributed (the same as JSON); POST or PUT /-/reload (with
--web.enable-lifecycle; else 403). All on the listening port, without authentication:
restrict them with a network policy, or TLS client certificates (--tls-client-ca-file).

Reload: SIGHUP (or POST /-/reload, with --web.enable-lifecycle) reads the --config file
again (flags still win) and the description files, and applies
{live};
other changed keys are logged and wait for a restart. An invalid new config keeps the old one
(karta_proxy_config_last_reload_successful 0). TLS files are re-read when they change.

Exit codes: 0 after SIGTERM/SIGINT; 2 for an invalid setting; 1 when starting fails (the
port is taken, the snapshot cannot be loaded, no cluster is configured, ...). Either
failure is one line on stderr, "karta-proxy: error: ...", naming what to fix, before
anything listens. An API server that does not answer yet is waited for (not ready).
"""


def _live_keys() -> str:
    """What a reload applies (``proxy.reload.LIVE_KEYS``, a section as ``enrich.*``),
    wrapped as the epilog is: the list written out here left out the jq limits."""
    from proxy.reload import LIVE_KEYS

    sections = {f for f in Settings.__struct_fields__
                if isinstance(getattr(Settings(), f), Section)}
    keys = [f"{k}.*" if k in sections else k for k in LIVE_KEYS]
    said = f"{', '.join(keys[:-1])} and {keys[-1]}"
    return "\n".join(textwrap.wrap(said, 90, break_on_hyphens=False))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Prometheus remote-write proxy that stamps Karta workload attribution\n"
        "(karta_workload, karta_component, karta_instance, ...) onto pod series and\n"
        "forwards them to one TSDB.",
        epilog=_EPILOG.format(live=_live_keys()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # a prefix of a flag was taken for it: ``--name web`` watched the namespace web
        # alone (``--namespace``), and a manifest's ``--upstream-time`` would break the
        # day another flag shares the prefix; Prometheus' flags take no prefixes either
        allow_abbrev=False,
    )
    p.add_argument("--version", action="version",
                   version=f"{PROG} {__version__} (contract {CONTRACT_VERSION}, "
                   f"{SPLICE} splice)")
    p.add_argument("--config", "--config.file", metavar="FILE", dest="config", action=_Once,
                   help="YAML file holding any setting (see config/karta-proxy.yaml); flags "
                   "override it (--config.file: Prometheus' name)")
    groups = {name: p.add_argument_group(name) for name in FLAG_GROUPS}
    for info in schema():
        if info.flag is not None:
            _add_flag(groups[info.flag.group], info, info.flag)
    return p


#: the ``--help`` sections, in order
FLAG_GROUPS = ("serving", "upstream", "index source", "descriptions", "facts")


def _add_flag(g: argparse._ArgumentGroup, info: SettingInfo, flag: Flag) -> None:
    """One setting's flag, its type, choices and help all read from the declaration."""
    t = info.type
    help_text = f"{flag.help or info.help} ({info.key}"
    if not isinstance(t, mi.BoolType | mi.ListType) and info.default not in ("", None):
        help_text += f"; default {info.default}"
    help_text += "; repeatable)" if flag.repeat else ")"
    kw: dict[str, Any] = {"dest": info.key, "help": help_text}
    if isinstance(t, mi.BoolType):
        kw.update(action="store_true", default=None)
    elif info.choices:
        kw.update(choices=info.choices, action=_Once)
        # as in the file, any case: --log-level INFO, --log-format JSON
        kw["type"] = functools.partial(canonical_choice, choices=info.choices)
    else:
        kw["metavar"] = flag.metavar
        if isinstance(t, mi.IntType | mi.FloatType):
            kw["type"] = int if isinstance(t, mi.IntType) else float
        kw["action"] = "append" if flag.repeat else _Once
    g.add_argument(*flag.names, **kw)


class _Once(argparse._StoreAction):
    """A flag of one value given twice is refused, as Prometheus refuses it: argparse
    kept the last silently, so of a manifest's ``--config a.yaml ... --config b.yaml``
    (an image's arguments and the operator's) one file was read and nothing said which."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, self.dest, None) is not None:
            parser.error(f"{option_string}: given more than once ({'/'.join(self.option_strings)}"
                         f"); give it once")
        super().__call__(parser, namespace, values, option_string)


def build_demo_parser() -> argparse.ArgumentParser:
    from proxy.demo import add_demo_arguments

    return add_demo_arguments(argparse.ArgumentParser(
        prog=f"{PROG} demo",
        description="Run the bundled demo: karta-proxy on a bundled snapshot, a batch of "
        "cAdvisor, kubelet-resource and DCGM series replayed through it to an in-process "
        "receiver; prints series before/after and a per-workload summary. No cluster, TSDB "
        "or network beyond loopback.",
    ))


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None, *,
                       reloading: bool = False) -> Settings:
    """Config file, then flags on top; raises ConfigError. ``reloading``: a config file
    with no settings in it is refused (``load_settings``), not every default."""
    env = dict(os.environ) if env is None else env
    if args.config == "":  # an unset variable in a manifest: not "no file"
        raise ConfigError("--config: the path is empty; name the YAML file or leave the "
                          "flag out")
    s = load_settings(args.config, empty_ok=not reloading) if args.config else Settings()
    #: key -> where a flag or an environment variable set it ("--upstream-url", "$KUBECONFIG")
    origins: dict[str, str] = {}
    for info in schema():
        if info.flag is not None:
            origin = _apply_flag(s, info, info.flag, getattr(args, info.key), env)
            if origin:
                origins[info.key] = origin
    try:
        validate(s)
    except ConfigError as e:
        raise ConfigError(_where(str(e), args.config, origins)) from None
    return s


def _where(message: str, config: str | None, origins: dict[str, str]) -> str:
    """A check after parsing (``validate``), said where the value came from, as a parse
    error is: the config file in front (``FILE: key: ...``) when the key the message begins
    with came from it, or was left at a default the file could set; ``(from $VAR)`` after
    the key when an environment variable set it; unchanged for a flag (the operator typed
    it, and the message names its key)."""
    for key, origin in origins.items():
        if message.startswith(key) and message[len(key):len(key) + 1] in (":", " ", "[", "."):
            if origin.startswith("$"):
                return f"{key} (from {origin}){message[len(key):]}"
            return message
    return f"{config}: {message}" if config else message


def _apply_flag(s: Settings, info: SettingInfo, flag: Flag, value: Any,
                env: dict[str, str]) -> str:
    """A flag given wins over the file; its environment variable stands in when it is not.

    Returns what set the value: the flag's name, ``$VAR``, or "" (left as it was)."""
    *path, name = info.key.split(".")
    target: Any = s
    for part in path:
        target = getattr(target, part)
    if value is None:
        fallback = env.get(flag.env) if flag.env else None
        if fallback and (flag.env_over_file or getattr(target, name) == info.default):
            setattr(target, name, fallback)
            return f"${flag.env}"
        return ""
    if isinstance(info.type, mi.StrType | mi.ListType) and not info.choices and (
            value == "" or (isinstance(value, list) and "" in value)):
        # an unset variable in a manifest (--snapshot "$SNAPSHOT"), as --config "": ""
        # read as "not set" served plain HTTP under a file's TLS files, switched a
        # snapshot proxy to the cluster of ~/.kube/config, sent no upstream credentials.
        # No flag of a path, URL or name means anything by an empty value.
        raise ConfigError(f"{flag.names[0]}: the value is empty; give one, or leave the "
                          "flag out (to unset what the config file sets, edit the file)")
    if isinstance(info.type, mi.BoolType):
        value = not flag.names[0].startswith("--no-")
    elif flag.repeat == "extend":
        value = [*getattr(target, name), *value]
    setattr(target, name, value)
    return flag.names[0]


def _fail(message: str) -> int:
    from proxy.log import error_line

    error_line(message)
    return EXIT_USAGE


class StoppedWhileStarting(SystemExit):
    """A SIGTERM or SIGINT before the event loop handles them: the stop asked for, exit 0
    as after any other stop."""

    def __init__(self) -> None:
        super().__init__(0)


class EarlySignals:
    """Signals that come before the event loop handles them (``serve``), while the
    imports and the settings' read take the first ~0.5-0.9 s after exec. Their default
    actions ended the process: SIGHUP (a reloader signalling a proxy just started) with
    exit 129, SIGTERM with 143 and no line, SIGINT with a ``KeyboardInterrupt``
    traceback from an import. From here on a SIGHUP is recorded, and ``serve`` reloads
    once for those that came, as for one that comes later; a SIGTERM or SIGINT ends the
    start with exit 0, as the documented stop does. Only the first ~0.2 s (the
    interpreter's start and this module's imports) are left to the default actions."""

    def __init__(self) -> None:
        self.hangup = False
        self._before: dict[int, Any] = {}
        for sig, handler in ((getattr(signal, "SIGHUP", None), self._hangup),
                             (signal.SIGTERM, self._stop), (signal.SIGINT, self._stop)):
            if sig is None:
                continue
            with contextlib.suppress(ValueError):  # not the main thread (a test's caller)
                before = signal.signal(sig, handler)
                self._before[sig] = _BEFORE_EARLY.get(sig, before)
        self.hangup = getattr(signal, "SIGHUP", None) in _EARLY

    @staticmethod
    def stop_if_asked() -> None:
        """A SIGTERM or SIGINT recorded during the imports (as PID 1) stops the start."""
        if _EARLY & {signal.SIGTERM, signal.SIGINT}:
            raise StoppedWhileStarting

    def restore(self) -> None:
        """The signals handled as before ``main`` (tests call it in their own process)."""
        for sig, before in self._before.items():
            signal.signal(sig, before)
        self._before.clear()

    def _hangup(self, signum: int, frame: object) -> None:
        self.hangup = True

    @staticmethod
    def _stop(signum: int, frame: object) -> None:
        raise StoppedWhileStarting

    def take_hangup(self) -> bool:
        """Whether a SIGHUP came, forgotten once told."""
        seen, self.hangup = self.hangup, False
        return seen


def main(argv: Sequence[str] | None = None) -> int:
    early = EarlySignals()
    try:
        early.stop_if_asked()
        return _main(argv, early)
    except StoppedWhileStarting:
        logging.getLogger("proxy").info("stop requested while starting")
        return 0
    finally:
        early.restore()


def _main(argv: Sequence[str] | None, early: EarlySignals) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        demo_args = build_demo_parser().parse_args(argv[1:])
        from proxy.demo import run_demo

        return run_demo(demo_args)
    args = build_parser().parse_args(argv)
    from proxy.log import HeldRecords, setup_logging

    held = HeldRecords()  # the settings say how to log; reading them may warn
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        held.replay()
        return _fail(str(e))
    from proxy import memory
    from proxy.runtime import serve

    memory.limit_arenas()  # before any thread starts (proxy.memory)
    memory.keep_request_buffers()
    setup_logging(settings.log_level, settings.log_format)
    held.replay()
    runner = asyncio.Runner()
    try:
        # a reload reads the file again and puts the same flags on top
        return runner.run(serve(settings,
                                loader=lambda: settings_from_args(args, reloading=True),
                                early_reload=early.take_hangup))
    except KeyboardInterrupt:
        return 130
    finally:
        _close(runner)


def _close(runner: asyncio.Runner) -> None:
    """The loop closed, its default pool shut down: in a thread, which at a pids limit
    cannot start (``can't start new thread``, the same failure the start just reported
    as the last line on stderr: no traceback after it). The pool's threads, if any, are
    joined at exit."""
    try:
        runner.close()
    except RuntimeError as e:
        if "can't start new thread" not in str(e):
            raise


if __name__ == "__main__":
    raise SystemExit(main())
