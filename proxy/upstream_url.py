"""The upstream URL as its receiver reads it: where a tenant goes in it, and the labels
VictoriaMetrics' ``extra_label`` query parameter sets through it.

Apart from the forwarding client (``proxy.upstream``) because the settings check reads
them too (``proxy.config``: an ``upstream.url`` that stores every series under another
cluster than the proxy's is refused before start), and the settings cannot depend on the
client.
"""

from __future__ import annotations

import functools
import re
from urllib.parse import parse_qsl, unquote_to_bytes, urlsplit, urlunsplit

from yarl import URL

#: VictoriaMetrics' write-path query parameter that adds a label to every series of the
#: request (``?extra_label=name=value``, repeatable), set by the receiver after the proxy
#: stamped the series. Go reads query names as they are: ``Extra_Label`` is another name,
#: ignored by VictoriaMetrics
EXTRA_LABEL = "extra_label"


def karta_extra_label(query: str) -> str:
    """The first ``extra_label`` of a request's raw query string that names a ``karta_*``
    label, decoded (``karta_workload=evil``); "" when none does.

    The receiver would set such a label on every series of the request, over the ones
    the proxy stamped: a sender could forge any attribution through its URL. Read as
    VictoriaMetrics reads it (Go's ``url.ParseQuery``: ``&``-separated pairs, ``%XX`` and
    ``+`` decoded in names and values, the label name up to the value's first ``=``), so
    ``extra%5Flabel=karta%5Fworkload%3Dx`` is found too. A pair Go skips as malformed (a
    bad ``%`` escape) is looked at all the same, and a name with blanks around it counts:
    a refusal too many at worst, never a forged label through."""
    if not query:
        return ""
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == EXTRA_LABEL and value.partition("=")[0].strip().startswith("karta_"):
            return value
    return ""


#: a ``%`` that does not start a ``%XX`` escape: Go's ``url.ParseQuery`` skips the pair
_BAD_ESCAPE = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _go_unescaped(s: str) -> bytes | None:
    """``s`` decoded as Go's ``url.QueryUnescape`` does (``+`` is a blank, ``%XX`` a byte,
    no UTF-8 check); None where Go fails (a bad ``%`` escape)."""
    if _BAD_ESCAPE.search(s):
        return None
    return unquote_to_bytes(s.replace("+", " "))


def extra_label_value(query: str, label: bytes) -> bytes | None:
    """The value VictoriaMetrics gives ``label`` on every series of a request sent with
    this raw query string, from its ``extra_label`` parameters; None: they name none.

    Read as VictoriaMetrics reads them, as measured against VictoriaMetrics 1.79 (a
    strict reading, unlike :func:`karta_extra_label`'s: this one decides where a series
    is stored, and a pair read that VictoriaMetrics skips would name a cluster it does
    not store): Go's ``url.ParseQuery`` (``&``-separated pairs; a pair holding a ``;``
    or a bad ``%`` escape is skipped), the label name up to the value's first ``=``,
    exact (``%20cluster`` is another label); of several, the last wins, and one with an
    empty value is skipped (the series keeps what it had)."""
    found: bytes | None = None
    for pair in query.split("&"):
        if ";" in pair:
            continue
        name, _, value = pair.partition("=")
        if _go_unescaped(name) != EXTRA_LABEL.encode():
            continue
        decoded = _go_unescaped(value)
        if decoded is None:
            continue
        named, eq, given = decoded.partition(b"=")
        if eq and named == label and given:
            found = given
    return found


@functools.lru_cache(maxsize=256)
def own_extra_label(url: str, label: bytes) -> bytes | None:
    """:func:`extra_label_value` of ``url``'s own query, as the client requests it (yarl's
    form of it, ``proxy.upstream.upstream_target``); cached: the same few URLs, one per
    tenant, every request."""
    return extra_label_value(URL(url).raw_query_string, label)


#: the place of the tenant in ``upstream.url`` (VictoriaMetrics cluster, Mimir-style bases)
TENANT_PLACEHOLDER = "{tenant}"
#: a vminsert write URL's path: ``/insert/<tenant>/prometheus[/api/v1/write]``
_VMINSERT_PATH = re.compile(
    r"^(?P<head>.*/insert/)(?P<tenant>[^/]+)(?P<tail>/prometheus(?:/api/v1/write)?/?)$")


def tenant_url(url: str, tenant: str | None, default_tenant: str) -> str | None:
    """The upstream URL for a request that named ``tenant`` in its path (None: it named
    none); None when the URL has no place for a tenant.

    ``{tenant}`` in ``url`` is replaced; a VictoriaMetrics cluster write URL
    (``.../insert/<t>/prometheus/api/v1/write``) gets its tenant swapped. A request with
    no tenant goes to ``url`` (with ``default_tenant`` in a placeholder).
    """
    if TENANT_PLACEHOLDER in url:
        return url.replace(TENANT_PLACEHOLDER, tenant if tenant is not None else default_tenant)
    if tenant is None:
        return url
    parts = urlsplit(url)
    m = _VMINSERT_PATH.match(parts.path)
    if m is None:
        return None
    path = m.group("head") + tenant + m.group("tail")
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, parts.fragment))
