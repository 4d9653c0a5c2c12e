"""How a refusal shows bytes it did not accept: the first :data:`SHOWN` bytes, printable
ASCII as it is and every other byte as ``\\xNN``.

One rule for every refusal that quotes what a sender or a description's author wrote:
the relay's (a label string, ``proxy.wire``; the native splice follows it byte for byte)
and the engine's (an id an expression yielded, ``proxy.karta.jqexpr.checked_id``). And
what a person reads of a URL or a credential: without the credential (a URL's userinfo
and credential query values, a credential a request carried and its answer echoes). A
leaf, importing nothing of the project: the wire layer and the engine each stay free of
the other and of the layers above them (``tests/test_layout.py``).
"""

from __future__ import annotations

import base64
import contextlib
import re
from collections.abc import Mapping
from urllib.parse import unquote

#: bytes a refusal shows (the native splice's ``SHOWN``)
SHOWN = 64


def shown(s: bytes) -> str:
    """``s`` as a refusal shows it: its first :data:`SHOWN` bytes, printable ASCII as it
    is and every other byte (``\\``, ``"``, anything not ASCII, invalid UTF-8 included)
    as ``\\xNN``, ``...`` after a cut: safe in a log line and a response body, and the
    same in Python and in the native splice."""
    out = "".join(chr(b) if 0x20 <= b < 0x7F and b not in b'\\"' else f"\\x{b:02x}"
                  for b in s[:SHOWN])
    return out + "..." if len(s) > SHOWN else out


#: what is left of C0, DEL and C1 once whitespace is folded: NUL, ESC (a terminal's
#: escape sequences), backspace, ...
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")


def one_line(text: str) -> str:
    """``text`` as one line of a log field or an answer's body: every run of whitespace
    (line breaks, tabs, U+2028, ...) one space, and the other control characters as
    ``\\xNN``. A sender logs an answer's first line alone, and an upstream's or a
    library's message often spans several (an HTML page, a Go panic, a parser's caret
    line); a control character relayed raw reached the sender's terminal or log as
    such (an ANSI escape recolouring or erasing what an operator reads)."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", " ".join(text.split()))


#: what the name of a header whose value is a credential holds, its letters alone lower-cased
#: (``Authorization``, ``Proxy-Authorization``, ``Cookie``, ``X-Api-Key``, ``X-Auth-Token``,
#: ``X-Vault-Token``; a malformed ``Authorization\x00`` too)
_CREDENTIAL_NAME = re.compile("auth|token|key|cookie|secret|passw|credential|session")


def credential_header(name: str) -> bool:
    """Whether a header so named carries a credential: what quotes a header line (a
    malformed request's refusal) or may quote its value (an upstream's answer echoing the
    request) shows its name alone."""
    return _CREDENTIAL_NAME.search(
        "".join(c for c in name.lower() if "a" <= c <= "z")) is not None


#: a query's parameter: its lead (``?`` or ``&``), name and value. A value also ends at
#: whitespace, which no URL holds (upstream.url refuses it) and which ends the target of
#: a request line or a URL a parser's message quotes.
_QUERY_PARAM = re.compile(r"([?&])([^=&#\s]*)=([^&#\s]*)")
#: what a person or a log reads for a query parameter's value that is a credential
HIDDEN = "(hidden)"


def hidden_query(text: str) -> str:
    """``text`` with the value of each query parameter a name tells as a credential
    (``?api_key=...``, ``&token=...``: :func:`credential_header`'s rule) as
    :data:`HIDDEN`: how a URL or a request line is shown (the upstream's URL in the log
    and on ``/metrics``, a sender's request line that a refusal quotes)."""
    def hide(m: re.Match[str]) -> str:
        name = unquote(m.group(2))
        return f"{m.group(1)}{m.group(2)}={HIDDEN}" if credential_header(name) else m.group(0)

    return _QUERY_PARAM.sub(hide, text)


#: the userinfo of a URL's authority: after ``//``, up to the last ``@`` before the path
_USERINFO = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)[^/?#]*@")
#: the same for a URL that does not parse, whose password may hold an unescaped ``/``
_USERINFO_BROKEN = re.compile(r"^((?:[A-Za-z][A-Za-z0-9+.-]*:)?//)?[^?#]*@")


def without_userinfo(url: str, *, broken: bool = False) -> str:
    """``url`` with its ``user:password@`` dropped, for anything a person or a log reads.

    A text rule, not ``urlsplit``, so a URL too broken to parse (a port that is not a
    number, the case a config error reports) loses its credentials all the same. With
    ``broken``, everything up to the last ``@`` before a query goes: a password with an
    unescaped ``/`` ends the authority early, and the rule for a valid URL would keep it.
    """
    return (_USERINFO_BROKEN if broken else _USERINFO).sub(r"\1", url, count=1)


def shown_url(url: str, *, broken: bool = False) -> str:
    """``url`` as a person or a log may read it (the log, ``/metrics``' ``url`` labels,
    the landing page, an error's text): without its userinfo (:func:`without_userinfo`),
    and the value of each query parameter a name tells as a credential
    (``?api_key=...``, ``?token=...``: :func:`proxy.shown.credential_header`'s rule)
    hidden (:func:`proxy.shown.hidden_query`). The request goes to the URL as written,
    less its userinfo."""
    base = without_userinfo(url, broken=broken)
    head, mark, rest = base.partition("?")
    return head + hidden_query("?" + rest) if mark else base


#: what an answer shows in place of a credential its request carried
WITHHELD = b"(credential not shown)"


def sent_credentials(fields: Mapping[str, str], configured: set[str]) -> list[bytes]:
    """The credentials a request carried, in the forms its answer could echo them (an
    auth proxy's or a debug handler's "you sent: ..."; a token endpoint's
    ``error_description`` quoting the client secret; that text reached the log and the
    sender, another tenant's or the proxy's own token with it): the value of each of its
    headers or form ``fields`` a name tells as a credential (:func:`credential_header`:
    ``Authorization``, ``client_secret``) or ``configured`` (lower-case names: the
    caller's, a tenant's header left out), its part after an auth scheme, and a Basic
    one's ``user:password`` and password. Longest first; none under 4 characters (a
    tenant id "1" is no secret, and every "1" of the body replaced would garble it)."""
    found: set[str] = set()
    for name, value in fields.items():
        if not credential_header(name) and name.lower() not in configured:
            continue
        found.add(value)
        scheme, _, rest = value.strip().partition(" ")
        rest = rest.strip()
        if not rest:
            continue
        found.add(rest)
        if scheme.lower() == "basic":
            with contextlib.suppress(ValueError):  # binascii.Error, UnicodeDecodeError
                userinfo = base64.b64decode(rest, validate=True).decode()
                found.update((userinfo, userinfo.partition(":")[2]))
    return sorted((v.encode() for v in found if len(v) >= 4), key=len, reverse=True)


def withheld(text: bytes, credentials: list[bytes]) -> bytes:
    """``text`` with each of ``credentials`` (:func:`sent_credentials`) as ``WITHHELD``."""
    for credential in credentials:
        text = text.replace(credential, WITHHELD)
    return text
