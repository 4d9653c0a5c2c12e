"""The proxy's ``Via`` entry, and the loop it tells of.

karta-proxy is an HTTP-to-HTTP gateway, which RFC 9110 §7.6.3 says MUST add a ``Via``
entry to each request it forwards: the sender's ``Via`` (if any) and then this process's,
``1.1 karta-proxy-<8 hex digits>``, a pseudonym made at start, so that no address or host
name leaves the cluster. Every request to the upstream carries it: a sender's forwarded
write, and the proxy's own (its check, its fact series).

So a request that comes back to the proxy is known as such. An ``upstream.url`` that names
the proxy itself (its Service, its listen address), or an upstream's redirect that leads
back to it, sent every write in again: forwarded, redirected again, until every
``server.max_concurrent_requests`` slot was held by that one write (measured: one write 64
deep, 2.1 s, every other sender refused meanwhile). Now the second arrival is refused at
once with 508 Loop Detected (``RemoteWriteHandler``), and the hop that sent it reads that
508 as the configuration's fault (``proxy.upstream``: ``not_write_endpoint``), so that
each replica in the loop says so. Through replicas behind a Service a loop ends at the
first replica reached twice: at most one hop more than there are replicas.

A leaf: the handler reads the incoming entry, the upstream writes the outgoing one.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping

from multidict import CIMultiDict, CIMultiDictProxy

#: this process's pseudonym in ``Via`` (RFC 9110 ``received-by``): random at start, so a
#: restarted proxy is another hop, and two replicas are never one
PSEUDONYM = f"karta-proxy-{secrets.token_hex(4)}"
#: this process's entry: the protocol the proxy receives (its server speaks HTTP/1.1)
ENTRY = f"1.1 {PSEUDONYM}"

#: an entry of a ``Via`` value naming this process: ``received-protocol`` (with or
#: without a protocol name), then the pseudonym, then a comment, a comma or the end
_OURS = re.compile(r"(?:^|,)[ \t]*[!#$%&'*+\-.^_`|~0-9A-Za-z/]+[ \t]+"
                   + re.escape(PSEUDONYM) + r"(?=[ \t,(]|$)")


#: what the proxy answers a request that came back to it (the 508's body)
LOOP_SAID = (f"loop detected: this request came through this karta-proxy ({PSEUDONYM}) "
             "before, its Via says: upstream.url, or a redirect of the upstream, leads back "
             "to the proxy; fix upstream.url or the redirect")


def sent(headers: Mapping[str, str]) -> str | None:
    """The ``Via`` a request came with, every line of it joined (RFC 9110: one list), or
    None."""
    if "Via" not in headers:
        return None
    if isinstance(headers, CIMultiDictProxy | CIMultiDict):
        return ", ".join(headers.getall("Via"))
    return headers["Via"]


def forwarded(incoming: str | None) -> str:
    """The ``Via`` of a request forwarded upstream: the sender's entries, then this
    process's (RFC 9110: appended, in the order the messages went). Entries that are not
    UTF-8 (the server keeps such bytes as surrogates) are left out: the upstream client
    cannot send them, and every write of that sender was a 502."""
    if not incoming or not incoming.strip():
        return ENTRY
    if not incoming.isascii():
        try:
            incoming.encode("utf-8")
        except UnicodeEncodeError:
            return ENTRY
    return f"{incoming}, {ENTRY}"


def came_through_here(via: str) -> bool:
    """True when a request's ``Via`` names this process: it was forwarded by this proxy
    and came back (a loop)."""
    return PSEUDONYM in via and _OURS.search(via) is not None
