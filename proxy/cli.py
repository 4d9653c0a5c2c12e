"""``karta-proxy`` command line (also ``python -m proxy``), and the ``demo`` subcommand.

Precedence: flags > ``--config`` YAML > built-in defaults (``NODE_NAME`` and
``KUBECONFIG`` stand in for their flags when those are absent). An invalid setting ends
the process before anything starts with one line on stderr and exit code 2, the
convention of argparse, so supervisors and scripts can tell it from a runtime failure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence

from proxy import __version__
from proxy.config import ConfigError, Settings, load_settings, validate
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

Endpoints: POST /api/v1/write, /api/v1/push, /api/v1/receive (remote write 1.0 and 2.0,
snappy or zstd); GET /metrics, /-/healthy, /-/ready, /; POST /-/reload.

Reload: SIGHUP or POST /-/reload reads the --config file again (flags still win) and the
description files, and applies enrich.*, karta.description_paths, karta.builtins and
log_level; other changed keys are logged and wait for a restart. An invalid new config
keeps the old one (karta_proxy_config_last_reload_successful 0). TLS files are re-read
when they change.

Exit codes: 0 after SIGTERM/SIGINT; 2 for an invalid setting; 1 when starting fails (the
port is taken, the snapshot cannot be loaded, no cluster is configured, ...). Either
failure is one line on stderr, "karta-proxy: error: ...", naming what to fix, before
anything listens. An API server that does not answer yet is waited for (not ready).
"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Prometheus remote-write proxy that stamps Karta workload attribution\n"
        "(karta_workload, karta_component, karta_instance, ...) onto pod series and\n"
        "forwards them to one TSDB.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version",
                   version=f"{PROG} {__version__} (contract {CONTRACT_VERSION}, "
                   f"{SPLICE} splice)")
    p.add_argument("--config", "--config.file", metavar="FILE", dest="config",
                   help="YAML file holding any setting (see config/karta-proxy.yaml); flags "
                   "override it (--config.file: Prometheus' name)")
    g = p.add_argument_group("serving")
    g.add_argument("--listen-address", "--web.listen-address", metavar="HOST:PORT",
                   dest="listen_address",
                   help="address to serve remote write and /metrics on (server.listen_address; "
                   "default 0.0.0.0:9091; --web.listen-address: Prometheus' name)")
    g.add_argument("--forward-before-ready", action="store_true", default=None,
                   help="until the index is loaded, forward requests unenriched (and report "
                   "ready) instead of answering 503 (server.forward_before_ready)")
    g.add_argument("--tls-cert-file", metavar="PATH",
                   help="serve HTTPS with this certificate (PEM), re-read when it changes "
                   "(server.tls_cert_file; needs --tls-key-file)")
    g.add_argument("--tls-key-file", metavar="PATH",
                   help="the certificate's private key (PEM) (server.tls_key_file)")
    g.add_argument("--tls-client-ca-file", metavar="PATH",
                   help="CA bundle client certificates must chain to: mutual TLS "
                   "(server.tls_client_ca_file)")
    g.add_argument("--tls-client-auth-type",
                   choices=("NoClientCert", "VerifyClientCertIfGiven",
                            "RequireAndVerifyClientCert"),
                   help="client certificate policy (server.tls_client_auth_type; default "
                   "RequireAndVerifyClientCert with a client CA, else NoClientCert)")
    g.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="log level (log_level; default info)")
    g.add_argument("--log-format", choices=("auto", "json", "text"),
                   help="log format (log_format; default auto: text when stderr is a "
                   "terminal, else JSON)")
    g = p.add_argument_group("upstream")
    g.add_argument("--upstream-url", metavar="URL",
                   help="remote-write URL of the TSDB to forward to, e.g. "
                   "http://prometheus:9090/api/v1/write (upstream.url; required)")
    g.add_argument("--upstream-protocol", choices=("auto", "v1", "passthrough"),
                   help="RW 2.0 handling toward the upstream: auto converts to RW 1.0 after a "
                   "415, v1 always converts, passthrough never (upstream.protocol)")
    g.add_argument("--upstream-timeout", type=float, metavar="SECONDS",
                   help="timeout of one upstream request (upstream.timeout_seconds; default 30)")
    g.add_argument("--upstream-bearer-token-file", metavar="PATH",
                   help="bearer token for the upstream, re-read when the file changes "
                   "(upstream.bearer_token_file)")
    g = p.add_argument_group("index source")
    g.add_argument("--snapshot", metavar="PATH",
                   help="file or folder of Kubernetes objects (YAML, a List, or JSON) to build "
                   "the index from instead of a live cluster (snapshot)")
    g.add_argument("--snapshot-reload-seconds", type=float, metavar="SECONDS",
                   help="poll the snapshot's files this often and apply changes; 0 loads "
                   "once (snapshot_reload_seconds; default 30)")
    g.add_argument("--kubeconfig", metavar="PATH",
                   help="kubeconfig of the cluster to watch (kube.kubeconfig; default "
                   "$KUBECONFIG, else the in-cluster service account)")
    g.add_argument("--namespace", metavar="NS", action="append",
                   help="watch only this namespace; repeatable (kube.namespaces; default all)")
    g.add_argument("--node-name", metavar="NODE",
                   help="node-scoped mode: watch only this node's pods (kube.node_name; "
                   "default $NODE_NAME)")
    g = p.add_argument_group("descriptions")
    g.add_argument("--description", metavar="PATH", action="append",
                   help="file or folder of Karta / ResourceInterface descriptions; repeatable "
                   "(karta.description_paths)")
    g.add_argument("--no-builtin-descriptions", action="store_true", default=None,
                   help="switch off the built-in descriptions of core kinds (karta.builtins)")
    g = p.add_argument_group("facts")
    g.add_argument("--no-facts", action="store_true", default=None,
                   help="do not write fact series upstream (facts.enabled)")
    return p


def build_demo_parser() -> argparse.ArgumentParser:
    from proxy.demo import add_demo_arguments

    return add_demo_arguments(argparse.ArgumentParser(
        prog=f"{PROG} demo",
        description="Run the bundled demo: karta-proxy on a bundled snapshot, a batch of "
        "cAdvisor, kubelet-resource and DCGM series replayed through it to an in-process "
        "receiver; prints series before/after and a per-workload summary. No cluster, TSDB "
        "or network beyond loopback.",
    ))


def settings_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    """Config file, then flags on top; raises ConfigError."""
    env = dict(os.environ) if env is None else env
    s = load_settings(args.config) if args.config else Settings()
    if args.listen_address is not None:
        s.server.listen_address = args.listen_address
    if args.forward_before_ready:
        s.server.forward_before_ready = True
    for flag in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_client_auth_type"):
        if getattr(args, flag) is not None:
            setattr(s.server, flag, getattr(args, flag))
    if args.log_level is not None:
        s.log_level = args.log_level
    if args.log_format is not None:
        s.log_format = args.log_format
    if args.upstream_url is not None:
        s.upstream.url = args.upstream_url
    if args.upstream_protocol is not None:
        s.upstream.protocol = args.upstream_protocol
    if args.upstream_timeout is not None:
        s.upstream.timeout_seconds = args.upstream_timeout
    if args.upstream_bearer_token_file is not None:
        s.upstream.bearer_token_file = args.upstream_bearer_token_file
    if args.snapshot is not None:
        s.snapshot = args.snapshot
    if args.snapshot_reload_seconds is not None:
        s.snapshot_reload_seconds = args.snapshot_reload_seconds
    if args.kubeconfig is not None:
        s.kube.kubeconfig = args.kubeconfig
    elif not s.kube.kubeconfig and env.get("KUBECONFIG"):
        s.kube.kubeconfig = env["KUBECONFIG"]
    if args.namespace:
        s.kube.namespaces = list(args.namespace)
    if args.node_name is not None:
        s.kube.node_name = args.node_name
    elif env.get("NODE_NAME"):
        s.kube.node_name = env["NODE_NAME"]
    if args.description:
        s.karta.description_paths = [*s.karta.description_paths, *args.description]
    if args.no_builtin_descriptions:
        s.karta.builtins = False
    if args.no_facts:
        s.facts.enabled = False
    validate(s)
    return s


def _fail(message: str) -> int:
    from proxy.log import error_line

    error_line(message)
    return EXIT_USAGE


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":
        demo_args = build_demo_parser().parse_args(argv[1:])
        from proxy.demo import run_demo

        return run_demo(demo_args)
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        return _fail(str(e))
    from proxy.log import setup_logging
    from proxy.runtime import serve

    setup_logging(settings.log_level, settings.log_format)
    try:
        # a reload reads the file again and puts the same flags on top
        return asyncio.run(serve(settings, loader=lambda: settings_from_args(args)))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
