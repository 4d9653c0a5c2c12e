"""The attribution status page: why a pod has the labels it has, or why it has none.

Operators otherwise learn why a pod is unattributed only from
``karta_pod_unattributed_info``. ``GET /attribution`` is a plain form and a
server-rendered page (no script, no external asset: it must work from a port-forward
with no internet); ``GET /api/v1/attribution`` and ``/api/v1/attribution/unattributed``
answer the same as JSON, in the Prometheus API's envelope (``status``, ``data``, or
``errorType`` and ``error``).

One pod's answer is computed per view from the index and the engine (the owner chain is
walked again by :meth:`proxy.karta.engine.Engine.explain`). The unattributed listings (all
pods grouped and sorted, then the page's HTML and every pod's JSON made) are built off the
event loop, in a thread, from a copy of the index's pod list taken on the loop (the index
is changed on the loop only), one build at a time, once per change of the index
(``PodIndex.generation``) whatever ``limit`` is asked: each JSON answer is a cut of pods
serialized once (``JsonListing``), not a ``json.dumps`` per request. Built on the loop, 4
clients fetching the JSON in a loop raised the relayed writes' p50 from 3.9 to 62 ms;
serialized per ``limit``, one client changing it per request raised their p99 from 5 to
79 ms. The request path is not involved.

Pod names, namespaces, labels and reasons come from the cluster, so every
value is HTML-escaped, and the page is served with a Content-Security-Policy that allows
no script at all.
"""

from __future__ import annotations

import asyncio
import html
import json
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from itertools import accumulate
from operator import add
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from proxy.index import PodIndex
from proxy.karta.explain import (
    END_HOP_LIMIT,
    END_NO_CONTROLLER,
    END_OWNER_MISSING,
    END_TOP,
    Explanation,
)
from proxy.karta.owners import (
    REASON_DESCRIPTION_ERROR,
    REASON_HOP_LIMIT,
    REASON_NO_CONTROLLER_OWNER,
    REASON_NO_DESCRIBED_OWNER,
    REASON_OWNER_MISSING,
)
from proxy.karta.results import PodAttribution

#: the engine's explanation of a pod by (namespace, name); None for an unknown pod
Explainer = Callable[[str, str], Explanation | None]

PAGE_PATH = "/attribution"
API_PATH = "/api/v1/attribution"
UNATTRIBUTED_API_PATH = "/api/v1/attribution/unattributed"

#: pods listed per reason on the page (the JSON's default ``limit`` too); counts are whole
LIST_LIMIT = 500
MAX_LIST_LIMIT = 100_000
#: a JSON listing bigger than this is written in steps of it (40k pods: 3.6 MB)
ANSWER_STEP = 256 * 1024

#: the index's reason for an unattributed pod whose engine reason is empty
UNATTRIBUTED = "unattributed"

REASONS = {
    REASON_NO_CONTROLLER_OWNER: "the pod has no controller reference and the built-in Pod "
                                "description is off",
    REASON_NO_DESCRIBED_OWNER: "the owner chain ends (an owner without a controller) before "
                               "any described kind",
    REASON_OWNER_MISSING: "the chain is broken by an owner not seen (yet), of an undescribed "
                          "kind, or in another namespace, before any described kind",
    REASON_HOP_LIMIT: "max_owner_hops references followed without reaching a described kind "
                      "(or an ownerReference cycle)",
    REASON_DESCRIPTION_ERROR: "the chain passes a kind whose only description is invalid",
}

WALK_ENDS = {
    END_NO_CONTROLLER: "the pod has no controller reference: it is its own top",
    END_TOP: "reached an owner without a controller reference: the top of the chain",
    END_OWNER_MISSING: "an owner not seen (yet), or in another namespace (absent to the pod): "
                       "known from its reference only",
    END_HOP_LIMIT: "max_owner_hops references followed",
}

#: no script, no remote anything: the page is a form and a table
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
                               "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
#: the JSON answers quote the query and the cluster's names: never sniffed as anything else
JSON_HEADERS = {"X-Content-Type-Options": "nosniff"}


@dataclass(frozen=True, slots=True)
class PodReport:
    """One pod's answer, and how it was reached when the engine could say."""

    attribution: PodAttribution
    #: None when no engine was given (the answer comes from the index alone)
    explanation: Explanation | None


@dataclass(frozen=True, slots=True)
class Unattributed:
    """The unattributed pods of one reason, sorted by namespace and name."""

    reason: str
    count: int
    #: at most the asked limit of them
    pods: tuple[PodAttribution, ...]


# -- answers ------------------------------------------------------------------------------


def find_pod(index: PodIndex, explain: Explainer | None, namespace: str,
             pod: str) -> PodReport | None:
    """The engine's explanation, else the index's answer alone; None for an unknown pod.
    The index finds the pod by name (no scan of its pods on the loop)."""
    if explain is not None:
        ex = explain(namespace, pod)
        if ex is not None:
            return PodReport(ex.attribution, ex)
    uid = index.uid_of(namespace, pod)
    att = index.pods.get(uid) if uid is not None else None
    return PodReport(att, None) if att is not None else None


def unattributed_of(pods: Iterable[PodAttribution], limit: int | None = LIST_LIMIT
                    ) -> list[Unattributed]:
    """The unattributed pods of a list of pods (a copy of the index's, in a thread)
    grouped by reason, the biggest group first; every pod of each reason with ``limit``
    None."""
    groups: dict[str, list[PodAttribution]] = {}
    for att in pods:
        if att.workload is None:
            groups.setdefault(att.reason or UNATTRIBUTED, []).append(att)
    out = []
    for reason, atts in groups.items():
        atts.sort(key=lambda a: (a.namespace, a.pod, a.uid))
        out.append(Unattributed(reason, len(atts), tuple(atts[:limit])))
    out.sort(key=lambda u: (-u.count, u.reason))
    return out


def at_most(groups: list[Unattributed], limit: int) -> list[Unattributed]:
    """``groups`` with at most ``limit`` pods each (their counts whole)."""
    return [g if len(g.pods) <= limit else replace(g, pods=g.pods[:limit]) for g in groups]


def pods_text(index: PodIndex) -> str:
    """The pods the index knows, attributed and in all: the landing page and this page
    say it the same way (they said 15 and 16 of the same index)."""
    known = len(index.pods)
    if not index.ready:  # some kinds listed, not yet others: no count of attributed yet
        return f"{known} known so far (the index is loading)"
    return f"{known - index.unattributed_pods} attributed / {known} in all"


@dataclass(frozen=True, slots=True)
class _JsonGroup:
    """One reason's pods as JSON, serialized once: any ``limit`` is a cut of ``pods``."""

    #: ``{"reason": ..., "count": N, "truncated": `` (then true/false and the pods)
    head: bytes
    count: int
    #: every pod's JSON object, in order, joined by ``", "`` (json.dumps' separator)
    pods: bytes
    #: ends[i]: where pod i's object ends in ``pods``
    ends: array[int]


@dataclass(frozen=True, slots=True)
class JsonListing:
    """The JSON answer's listing, serialized once per generation of the index.

    The answer for ``limit`` is the first ``limit`` pods' ready-made JSON of each reason
    (a cut of one bytes object: no serialization per request) in the fixed envelope: the
    same bytes as ``json.dumps`` of the listing cut to ``limit`` made before.
    """

    total: int
    groups: tuple[_JsonGroup, ...]

    def reasons(self, limit: int) -> list[bytes | memoryview]:
        """The pieces of the ``reasons`` list's JSON with at most ``limit`` pods each,
        to be joined (the pods are views of the serialized bytes, not copies)."""
        out: list[bytes | memoryview] = [b"["]
        for i, g in enumerate(self.groups):
            n = min(limit, len(g.ends))
            out += [b", " if i else b"", g.head,
                    b"true" if g.count > n else b"false", b', "pods": [',
                    memoryview(g.pods)[:g.ends[n - 1]] if n else b"", b"]}"]
        out.append(b"]")
        return out

    def pieces(self, limit: int, index_json: str) -> list[bytes | memoryview]:
        """The answer of ``/api/v1/attribution/unattributed?limit=`` in pieces: the
        Prometheus API envelope, ``total``, the reasons cut to ``limit``, then
        ``index_json`` (the index's freshness, of the moment of the answer)."""
        return [b'{"status": "success", "data": {"total": %d, "reasons": ' % self.total,
                *self.reasons(limit), b', "index": ', index_json.encode(), b"}}"]

    def answer(self, limit: int, index_json: str) -> bytes:
        """``pieces`` joined: the whole answer as one bytes object."""
        return b"".join(self.pieces(limit, index_json))

    @property
    def nbytes(self) -> int:
        """What the serialized listing holds (the pods' JSON and their ends)."""
        return sum(len(g.head) + len(g.pods) + g.ends.itemsize * len(g.ends)
                   for g in self.groups)


def json_listing(groups: list[Unattributed]) -> JsonListing:
    """``groups`` (every pod of each reason) serialized for the JSON answer, each pod's
    object once, as ``json.dumps`` writes it (its string encoder, its separators). A
    Python loop, in a thread: one ``json.dumps`` of the whole listing is one C call that
    holds the GIL throughout (35 ms at 40k pods); this loop lets the event loop run."""
    enc = json.encoder.encode_basestring_ascii
    out = []
    for g in groups:
        frags = [f'{{"namespace": {enc(a.namespace)}, "pod": {enc(a.pod)}, '
                 f'"uid": {enc(a.uid)}}}' for a in g.pods]
        # each object's end: the objects up to it and the ", " between them
        ends = array("q", map(add, accumulate(map(len, frags)), range(0, 2 * len(frags), 2)))
        head = f'{{"reason": {enc(g.reason)}, "count": {g.count:d}, "truncated": '
        out.append(_JsonGroup(head.encode("ascii"), g.count,
                              ", ".join(frags).encode("ascii"), ends))
    return JsonListing(sum(g.count for g in groups), tuple(out))


def page_listing(groups: list[Unattributed]) -> str:
    """The page's listing as HTML: ``LIST_LIMIT`` pods a reason (the page has no limit
    to vary: one rendering per generation)."""
    return _unattributed_html(at_most(groups, LIST_LIMIT))


class Listings:
    """The unattributed listings, built off the loop once per index change.

    A build copies the index's pod list on the loop (a list of references: ~0.3 ms at
    45k pods; the index is only changed on the loop, so the copy is consistent) and groups
    and sorts every unattributed pod in a thread (14-72 ms at 10k-80k of them), once per
    generation of the index whatever the views ask. Each rendering (``what``: the JSON's
    serialized pods, ``json_listing``; the page's HTML, ``page_listing``) is made once per
    generation too, in a thread, from that one grouping, and every ``limit`` of the JSON
    is cut from its one serialization (``JsonListing.answer``). Renderings were kept by
    (view, limit), at most 8: a client cycling ``limit`` had the whole listing
    ``json.dumps``-ed per request (~57 ms a listing at 40k pods, one C call holding the
    GIL: the relayed writes' p99 went from 5 to 79 ms). One build at a time (``_lock``):
    concurrent views of a listing not yet built wait for the one build, then share it.
    Only the current generation's grouping and renderings are kept.
    """

    def __init__(self, index: PodIndex) -> None:
        self.index = index
        self._lock = asyncio.Lock()
        self._groups: tuple[int, list[Unattributed]] | None = None
        self._renders: dict[str, tuple[int, Any]] = {}

    async def get(self, what: str, render: Callable[[list[Unattributed]], Any]) -> Any:
        """``render`` of the whole listing (every pod of each reason), made once per
        generation of the index and kept by ``what`` until the next."""
        hit = self._renders.get(what)
        if hit is not None and hit[0] == self.index.generation:
            return hit[1]
        async with self._lock:
            generation = self.index.generation
            hit = self._renders.get(what)
            if hit is not None and hit[0] == generation:
                return hit[1]
            if self._groups is None or self._groups[0] != generation:
                # the last generation's go first: never two generations held at once
                self._groups = None
                self._renders.clear()
                pods = list(self.index.pods.values())
                self._groups = (generation,
                                await asyncio.to_thread(unattributed_of, pods, None))
            value = await asyncio.to_thread(render, self._groups[1])
            self._renders[what] = (generation, value)
            return value


def index_state(index: PodIndex, now: float) -> dict[str, Any]:
    """How current the index is: per resource, when it was last known current."""
    return {
        "ready": index.ready,
        "stale": index.stale,
        "freshness": [
            {"resource": name, "last_current": ts, "age_seconds": round(max(0.0, now - ts), 3)}
            for name, ts in sorted(index.freshness.items())
        ],
    }


# -- JSON ---------------------------------------------------------------------------------


def _attribution_json(att: PodAttribution) -> dict[str, Any]:
    w = att.workload
    return {
        "namespace": att.namespace,
        "pod": att.pod,
        "uid": att.uid,
        "attributed": w is not None,
        "workload": None if w is None else {
            "namespace": w.namespace, "group": w.group, "kind": w.kind, "name": w.name,
            "uid": w.uid,
        },
        "component": att.component,
        "instance": att.instance,
        "replica": att.replica,
        "description": att.description,
        "reason": "" if w is not None else (att.reason or UNATTRIBUTED),
    }


def not_found(index: PodIndex, namespace: str, pod: str) -> tuple[str, dict[str, Any] | None]:
    """Why a pod has no report, and for a deleted pod whose name still stamps series (a
    tombstone: its late samples and stale markers), what they are stamped with: "not in
    the index" alone contradicted the stamped series."""
    tomb = index.tombstone(namespace.encode(), pod.encode())
    if tomb is None:
        return f"no pod {namespace}/{pod} in the index", None
    labels = dict(tomb.pairs)
    message = (f"pod {namespace}/{pod} was deleted; its series are stamped with its last "
               f"attribution ({', '.join(f'{k}={v}' for k, v in tomb.pairs)}) for "
               f"{tomb.seconds_left:.0f} s more (karta.tombstone_seconds)")
    return message, {"uid": tomb.uid, "labels": labels,
                     "seconds_left": round(tomb.seconds_left, 1)}


def report_json(report: PodReport, index: PodIndex, now: float) -> dict[str, Any]:
    data = _attribution_json(report.attribution)
    ex = report.explanation
    data["chain"] = None if ex is None else [
        {"kind": link.kind, "group": link.group, "name": link.name, "uid": link.uid,
         "seen": link.seen, "described": link.described, "description": link.description,
         "description_error": link.description_error, "workload": link.workload,
         "ghost": link.ghost}
        for link in ex.chain
    ]
    data["walk_end"] = None if ex is None else ex.walk_end
    data["max_owner_hops"] = None if ex is None else ex.max_owner_hops
    data["index"] = index_state(index, now)
    return data


def _error(status: int, kind: str, message: str, **more: Any) -> web.Response:
    return web.json_response({"status": "error", "errorType": kind, "error": message,
                              **more}, status=status, headers=JSON_HEADERS)


def _query(request: web.Request) -> tuple[str, str] | str:
    """(namespace, pod), or what is wrong with the query."""
    ns = request.query.get("namespace", "")
    pod = request.query.get("pod", "")
    if not ns or not pod:
        return "both namespace and pod are required (?namespace=NS&pod=NAME)"
    return ns, pod


# -- HTML ---------------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pod_link(namespace: str, pod: str) -> str:
    href = PAGE_PATH + "?" + urlencode({"namespace": namespace, "pod": pod})
    return f'<a href="{_e(href)}">{_e(namespace)}/{_e(pod)}</a>'


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _index_html(index: PodIndex, now: float) -> str:
    state = index_state(index, now)
    rows = "".join(
        f"<tr><td>{_e(f['resource'])}</td>"
        f"<td>{_e(time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(f['last_current'])))} UTC"
        f"</td><td>{_e(_age(f['age_seconds']))}</td></tr>"
        for f in state["freshness"]
    ) or '<tr><td colspan="3">nothing loaded yet</td></tr>'
    stale = ('<strong class="bad">yes: a source is cut off, the last known state is '
             'served</strong>' if index.stale else "no")
    return f"""<section id="index">
<h2>Index</h2>
<p>ready: {"yes" if index.ready else "<strong class='bad'>no</strong>"}; stale: {stale};
pods: {_e(pods_text(index))}; workloads: {len(index.workloads)}</p>
<table><tr><th>resource</th><th>last known current</th><th>age</th></tr>{rows}</table>
</section>"""


def _form_html(namespace: str, pod: str) -> str:
    return f"""<form id="search" method="get" action="{PAGE_PATH}">
<label>namespace <input name="namespace" value="{_e(namespace)}" required></label>
<label>pod <input name="pod" value="{_e(pod)}" required size="50"></label>
<button type="submit">Explain</button>
</form>"""


def _chain_html(report: PodReport) -> str:
    ex = report.explanation
    att = report.attribution
    if ex is None:
        return "<p>owner chain: not available (no engine attached to this page)</p>"
    items = [f"<li>Pod {_e(att.namespace)}/{_e(att.pod)} (the pod itself)</li>"]
    for link in ex.chain:
        kind = f"{link.kind}.{link.group}" if link.group else link.kind
        notes = []
        if link.description:
            notes.append(f"described by <code>{_e(link.description)}</code>")
        elif link.description_error:
            notes.append('<span class="bad">its description is invalid</span>')
        else:
            notes.append("not described")
        if link.ghost:
            notes.append("removed: walked through its ghost (its own owner still known)")
        elif not link.seen:
            notes.append("not seen: known from the reference only")
        mark = ' class="workload"' if link.workload else ""
        top = " <strong>&larr; workload</strong>" if link.workload else ""
        items.append(f"<li{mark}>{_e(kind)} {_e(link.name)} "
                     f"<small>uid {_e(link.uid)}</small>: {'; '.join(notes)}{top}</li>")
    end = WALK_ENDS.get(ex.walk_end, ex.walk_end)
    return (f'<h3>Owner chain walked</h3><ol id="chain">{"".join(items)}</ol>'
            f'<p id="walk-end">walk ended: <code>{_e(ex.walk_end)}</code>: {_e(end)} '
            f"(max_owner_hops {ex.max_owner_hops})</p>")


def _report_html(report: PodReport) -> str:
    att = report.attribution
    w = att.workload
    rows: list[tuple[str, str]] = [("pod", f"{_e(att.namespace)}/{_e(att.pod)}"),
                                   ("uid", _e(att.uid))]
    if w is None:
        reason = att.reason or UNATTRIBUTED
        rows += [("attributed", '<strong class="bad">no</strong>'),
                 ("reason", f"<code>{_e(reason)}</code>: {_e(REASONS.get(reason, ''))}")]
    else:
        kind = f"{w.kind}.{w.group}" if w.group else w.kind
        rows += [
            ("attributed", "yes"),
            ("workload", f"{_e(kind)} {_e(w.namespace)}/{_e(w.name)} "
                         f"<small>uid {_e(w.uid)}</small>"),
            ("component", _e(att.component) or "<em>none (no component selector accepted)</em>"),
            ("instance", _e(att.instance) or "<em>none</em>"),
            ("replica", _e(att.replica) or "<em>none</em>"),
            ("description", f"<code>{_e(att.description)}</code>"),
        ]
    table = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return (f'<section id="result"><h2>{_e(att.namespace)}/{_e(att.pod)}</h2>'
            f'<table id="answer">{table}</table>{_chain_html(report)}</section>')


def _unattributed_html(groups: list[Unattributed]) -> str:
    total = sum(g.count for g in groups)
    parts = [f'<section id="unattributed"><h2>Unattributed pods ({total})</h2>']
    if not groups:
        parts.append("<p>none: every pod has a workload</p>")
    for g in groups:
        more = (f"<li>... and {g.count - len(g.pods)} more (see "
                f'<a href="{UNATTRIBUTED_API_PATH}">the JSON</a>)</li>'
                if g.count > len(g.pods) else "")
        pods = "".join(f"<li>{_pod_link(a.namespace, a.pod)}</li>" for a in g.pods)
        parts.append(f"<h3><code>{_e(g.reason)}</code> ({g.count})</h3>"
                     f"<p>{_e(REASONS.get(g.reason, ''))}</p><ul>{pods}{more}</ul>")
    parts.append("</section>")
    return "".join(parts)


_STYLE = """body{font-family:sans-serif;margin:1.5em;max-width:70em}
table{border-collapse:collapse}th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left}
.bad{color:#b00}li.workload{font-weight:bold}form{margin:1em 0}small{color:#666}"""


def render_page(index: PodIndex, now: float, namespace: str, pod: str,
                report: PodReport | None, message: str, unattributed_html: str) -> str:
    """The page; ``unattributed_html``: its listing, built already (``Listings``, off the
    loop)."""
    body = [_index_html(index, now), _form_html(namespace, pod)]
    if message:
        body.append(f'<p id="message" class="bad">{_e(message)}</p>')
    if report is not None:
        body.append(_report_html(report))
    body.append(unattributed_html)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>karta-proxy: attribution</title>
<style>{_STYLE}</style></head>
<body>
<h1>Attribution</h1>
<p><a href="/">karta-proxy</a> &middot; why a pod has the workload labels it has, or why
it has none. As JSON: <code>{API_PATH}?namespace=NS&amp;pod=NAME</code>,
<a href="{UNATTRIBUTED_API_PATH}">{UNATTRIBUTED_API_PATH}</a>.</p>
{"".join(body)}
</body></html>
"""


# -- routes -------------------------------------------------------------------------------


#: what the page and its JSON twins answer before the index is ready (503): it then holds
#: some kinds and not yet others, and a pod whose ReplicaSet is not listed yet walks up to
#: it as its workload (an audit: "attributed", ReplicaSet/web-1, during a start)
NOT_READY = ("the index is not ready yet (cluster state still loading): attribution would "
             "be partial (a pod whose owner is not listed yet would show that owner as its "
             "workload); try again once /-/ready says ready")


def add_routes(app: web.Application, index: PodIndex, explain: Explainer | None) -> None:
    """``GET /attribution`` and its two JSON twins."""
    listings = Listings(index)

    async def page(request: web.Request) -> web.Response:
        ns = request.query.get("namespace", "")
        pod = request.query.get("pod", "")
        report = None
        message = ""
        status = 200
        if not index.ready:
            text = render_page(index, time.time(), ns, pod, None, NOT_READY, "")
            return web.Response(text=text, content_type="text/html", status=503,
                                headers=SECURITY_HEADERS)
        if ns or pod:
            q = _query(request)
            if isinstance(q, str):
                status, message = 400, q
            else:
                report = find_pod(index, explain, *q)
                if report is None:
                    status = 404
                    message = not_found(index, *q)[0]
        listing = await listings.get("page", page_listing)
        text = render_page(index, time.time(), ns, pod, report, message, listing)
        return web.Response(text=text, content_type="text/html", status=status,
                            headers=SECURITY_HEADERS)

    async def api_pod(request: web.Request) -> web.Response:
        q = _query(request)
        if isinstance(q, str):
            return _error(400, "bad_data", q)
        if not index.ready:
            return _error(503, "unavailable", NOT_READY)
        report = find_pod(index, explain, *q)
        if report is None:
            message, tombstone = not_found(index, *q)
            # a deleted pod's name: the error, and the stamp the name still gives
            more = {"tombstone": tombstone} if tombstone is not None else {}
            return _error(404, "not_found", message, **more)
        return web.json_response({"status": "success",
                                  "data": report_json(report, index, time.time())},
                                 headers=JSON_HEADERS)

    async def api_unattributed(request: web.Request) -> web.StreamResponse:
        raw = request.query.get("limit", str(LIST_LIMIT))
        try:
            limit = int(raw)
        except ValueError:
            limit = 0
        if not 1 <= limit <= MAX_LIST_LIMIT:
            return _error(400, "bad_data",
                          f"limit must be an integer from 1 to {MAX_LIST_LIMIT}, not {raw!r}")
        if not index.ready:
            return _error(503, "unavailable", NOT_READY)
        listing: JsonListing = await listings.get("json", json_listing)
        # the pods are serialized once per generation; the index's freshness is of now
        pieces = listing.pieces(limit, json.dumps(index_state(index, time.time())))
        size = sum(len(p) for p in pieces)
        if size <= ANSWER_STEP:
            return web.Response(body=b"".join(pieces), content_type="application/json",
                                charset="utf-8", headers=JSON_HEADERS)
        # a big answer is written ANSWER_STEP bytes at a time, each let go to the socket
        # before the next (no copy of it all on the loop: a fresh 9 MB took up to 5 ms)
        response = web.StreamResponse(headers=JSON_HEADERS)
        response.content_type = "application/json"
        response.charset = "utf-8"
        response.content_length = size
        await response.prepare(request)
        for piece in pieces:
            view = memoryview(piece)
            for at in range(0, len(view), ANSWER_STEP):
                await response.write(view[at:at + ANSWER_STEP])
        await response.write_eof()
        return response

    app.router.add_get(PAGE_PATH, page)
    app.router.add_get(API_PATH, api_pod)
    app.router.add_get(UNATTRIBUTED_API_PATH, api_unattributed)
