"""kubernetes-asyncio without the generated API and model classes the proxy never uses.

Importing any part of kubernetes-asyncio runs its package ``__init__`` files, which import
every generated API class (``client/api``, 27 MB of source) and every model class
(``client/models``, 20 MB): ~40 MiB of RSS and ~0.5 s at start, for a proxy that sends
its own requests through ``ApiClient.call_api`` and reads the JSON itself. In Kubernetes
mode at 37.5k pods those 40 MiB took the process past the 300 MB peak target that
snapshot mode meets (docs/performance.md, "Kubernetes mode at 37.5k pods").

So the four packages (``kubernetes_asyncio``, its ``client``, ``client.api`` and
``client.models``) are put in ``sys.modules`` hollow: their ``__init__`` is not run, and
a name asked of one is imported from the module its ``__init__`` would have taken it from
(read from that file's own ``from ... import`` lines), alone. ``ApiClient`` loads
``api_client`` and what it imports; the Lease's ``CoordinationV1Api`` and ``V1Lease``
their two modules. A name the ``__init__`` does not import (``__version__``, say) runs the
real ``__init__`` once, so anything that reaches for the whole package still gets it:
leanness is never bought with a missing name.

Done once, at this module's import, before any kubernetes-asyncio import of the proxy's
(``proxy.kube.client`` and ``proxy.lease`` take their names from here); a process that
imported the package whole before (a test session) keeps it whole.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

#: the packages made hollow, parents first
HOLLOW = (
    "kubernetes_asyncio",
    "kubernetes_asyncio.client",
    "kubernetes_asyncio.client.api",
    "kubernetes_asyncio.client.models",
)

_FROM = re.compile(r"^from ([\w.]+) import ([\w ,]+)$", re.M)
_AS = re.compile(r"^import ([\w.]+) as (\w+)$", re.M)


def _sources(init: Path) -> dict[str, tuple[str, str]]:
    """name -> (module, attribute) for each ``from M import A [as N]`` and
    ``import M as N`` line of a package's ``__init__``."""
    text = init.read_text(encoding="utf-8")
    out: dict[str, tuple[str, str]] = {}
    for module, names in _FROM.findall(text):
        for part in names.split(","):
            attr, _, alias = part.strip().partition(" as ")
            if attr and module != "__future__":
                out[(alias or attr).strip()] = (module, attr.strip())
    for module, alias in _AS.findall(text):
        out[alias] = (module, "")
    return out


def _hollow(name: str) -> None:
    """Put package ``name`` in ``sys.modules`` without running its ``__init__``."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.origin is None:
        return
    module = importlib.util.module_from_spec(spec)
    sources = _sources(Path(spec.origin))
    loader = spec.loader

    def whole() -> None:
        """The real ``__init__``, run once in the hollow module (what it imports
        resolves to the modules already loaded)."""
        module.__dict__.pop("__getattr__", None)
        loader.exec_module(module)

    def __getattr__(attr: str) -> Any:  # PEP 562
        source = sources.get(attr)
        if source is not None:
            found = importlib.import_module(source[0])
            value = getattr(found, source[1]) if source[1] else found
        elif not attr.startswith("__") and importlib.util.find_spec(f"{name}.{attr}"):
            value = importlib.import_module(f"{name}.{attr}")
        else:
            if "__getattr__" not in module.__dict__:
                raise AttributeError(f"module {name!r} has no attribute {attr!r}")
            whole()
            return getattr(module, attr)
        setattr(module, attr, value)
        return value

    module.__getattr__ = __getattr__  # type: ignore[method-assign]
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def install() -> None:
    """Hollow the packages, unless kubernetes-asyncio is imported already."""
    if HOLLOW[0] in sys.modules:
        return
    for name in HOLLOW:
        _hollow(name)


install()

from kubernetes_asyncio import client, config  # noqa: E402
from kubernetes_asyncio.client import rest  # noqa: E402
from kubernetes_asyncio.client.exceptions import ApiException  # noqa: E402
from kubernetes_asyncio.config import incluster_config  # noqa: E402

__all__ = ["ApiException", "client", "config", "incluster_config", "rest"]
