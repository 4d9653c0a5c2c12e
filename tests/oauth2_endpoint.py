"""A small OAuth 2.0 token endpoint on 127.0.0.1 (no real one is installed): the client
credentials grant as RFC 6749 section 4.4 has it, and the bearer check of what it issued.

- ``POST`` a form (``application/x-www-form-urlencoded``) with ``grant_type=
  client_credentials``, else 400 ``unsupported_grant_type`` / ``invalid_request``;
- the client authenticated by HTTP Basic (id and secret form-encoded first, section
  2.3.1) or by ``client_id`` / ``client_secret`` in the form (which styles it takes is
  the test's), never both ways at once (400 ``invalid_request``), else 401
  ``invalid_client`` (with ``WWW-Authenticate`` when Basic was tried);
- the answer ``{"access_token", "token_type": "Bearer", "expires_in"}`` with
  ``Cache-Control: no-store`` (section 5.1).

The test may make it answer otherwise (``down``: a 503; ``answer``: a reply of its own)
or hold answers (``hold``). :meth:`TokenEndpoint.live` tells a token it issued and that
has not expired by its own clock, for a gate in front of an upstream.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote_plus

from aiohttp import web
from multidict import CIMultiDictProxy

from proxy.aux_server import AuxServer


@dataclass
class TokenRequest:
    """One request the endpoint got, as it came."""

    headers: CIMultiDictProxy[str]
    form: dict[str, list[str]]
    #: how the client authenticated: "header", "params", or "" (it did not)
    style: str


@dataclass
class Canned:
    """An answer of the test's own."""

    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass
class TokenEndpoint(AuxServer):
    """The endpoint; ``clients`` maps an id to its secret."""

    clients: dict[str, str] = field(default_factory=lambda: {"karta": "s3cret"})
    #: how a client may authenticate
    styles: frozenset[str] = frozenset({"header", "params"})
    expires_in: int | None = 3600
    token_type: str = "Bearer"
    #: answer 503 (``temporarily_unavailable``) to every request
    down: bool = False
    #: answer this to every request instead (a test's malformed answer)
    answer: Canned | None = None
    #: answers wait until the test sets it
    hold: asyncio.Event | None = None
    clock: Callable[[], float] = time.monotonic
    requests: list[TokenRequest] = field(default_factory=list)
    #: token -> (client id, expiry by ``clock``; None: none)
    issued: dict[str, tuple[str, float | None]] = field(default_factory=dict)
    url: str = ""
    #: serve HTTPS with this context
    tls: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        self._serial = itertools.count(1)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/token", self._token)
        port = await self.serve(app, "127.0.0.1", 0, ssl_context=self.tls)
        self.url = f"{'https' if self.tls else 'http'}://127.0.0.1:{port}/token"
        return self.url

    def live(self, authorization: str) -> bool:
        """``authorization`` is ``Bearer <a token it issued>``, not expired."""
        scheme, _, token = authorization.partition(" ")
        entry = self.issued.get(token)
        if scheme.lower() != "bearer" or entry is None:
            return False
        expiry = entry[1]
        return expiry is None or self.clock() < expiry

    @property
    def granted(self) -> int:
        """Tokens issued so far."""
        return len(self.issued)

    async def _token(self, request: web.Request) -> web.Response:
        body = await request.read()
        form: dict[str, list[str]] = (
            parse_qs(body.decode(), keep_blank_values=True)
            if request.content_type == "application/x-www-form-urlencoded" else {})
        style = ("header" if request.headers.get("Authorization", "").startswith("Basic ")
                 else "params" if "client_id" in form else "")
        self.requests.append(TokenRequest(request.headers, form, style))
        if self.hold is not None:
            await self.hold.wait()
        if self.answer is not None:
            return web.Response(status=self.answer.status, body=self.answer.body,
                                content_type=self.answer.content_type)
        if self.down:
            return _error(503, "temporarily_unavailable")
        if request.method != "POST" or request.content_type != \
                "application/x-www-form-urlencoded":
            return _error(400, "invalid_request", "POST a form")
        if form.get("grant_type") != ["client_credentials"]:
            return _error(400, "unsupported_grant_type")
        client = self._client(request, form, style)
        if isinstance(client, web.Response):
            return client
        token = f"tok-{next(self._serial)}-{base64.b32encode(client.encode()).decode()}"
        expiry = self.clock() + self.expires_in if self.expires_in else None
        self.issued[token] = (client, expiry)
        answer: dict[str, object] = {"access_token": token, "token_type": self.token_type}
        if self.expires_in is not None:
            answer["expires_in"] = self.expires_in
        return web.Response(body=json.dumps(answer).encode(), content_type="application/json",
                            headers={"Cache-Control": "no-store", "Pragma": "no-cache"})

    def _client(self, request: web.Request, form: dict[str, list[str]], style: str
                ) -> str | web.Response:
        """The client's id, or the refusal (section 2.3.1; 5.2 ``invalid_client``)."""
        if style == "header" and "client_secret" in form:
            return _error(400, "invalid_request", "client authenticated two ways")
        if style not in self.styles:
            return _error(401, "invalid_client", f"{style or 'no'} client authentication",
                          basic=style == "header")
        if style == "header":
            raw = base64.b64decode(request.headers["Authorization"].split(" ", 1)[1]).decode()
            user, _, password = raw.partition(":")
            client, secret = unquote_plus(user), unquote_plus(password)
        else:
            client = form["client_id"][0]
            secret = form.get("client_secret", [""])[0]
        if self.clients.get(client) != secret:
            return _error(401, "invalid_client", "client authentication failed",
                          basic=style == "header")
        return client


def _error(status: int, error: str, description: str = "", *, basic: bool = False
           ) -> web.Response:
    answer = {"error": error, **({"error_description": description} if description else {})}
    headers = {"Cache-Control": "no-store"}
    if basic:
        headers["WWW-Authenticate"] = 'Basic realm="token"'
    return web.Response(status=status, body=json.dumps(answer).encode(),
                        content_type="application/json", headers=headers)
