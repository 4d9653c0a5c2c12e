"""Why a pod got its attribution: the owner chain walked again, for the status page.

The engine keeps answers, not reasons: the walk that placed a pod is not recorded (that
would cost memory per pod, for every pod, to serve a page an operator opens now and then).
So an explanation is computed on demand, from what the engine holds: the controller
references are followed up again with the walk's rules (controller references only, at
most ``max_owner_hops``, pods can be owners, an owner not seen ends the walk unless it is
the ghost of a removed one), and every
owner passed is reported with the description in force for its kind.

The result shown is always the engine's own :class:`PodAttribution`, never recomputed
here: if the two ever disagreed, the page would still say what the proxy stamps.
Read-only: nothing here changes engine state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.karta.model import GroupKind
from proxy.karta.owners import POD, OwnerGraph, OwnerRef
from proxy.karta.results import PodAttribution

#: How the walk ended (``Explanation.walk_end``).
#: the pod has no controller reference: nothing to walk
END_NO_CONTROLLER = "no_controller"
#: an owner without a controller reference: the top of the chain
END_TOP = "top_reached"
#: an owner not seen (yet): known from its reference alone
END_OWNER_MISSING = "owner_missing"
#: ``max_owner_hops`` references followed (or a reference cycle)
END_HOP_LIMIT = "hop_limit"


class PodLike(Protocol):
    """What the explanation reads of a pod the engine holds."""

    uid: str
    name: str
    namespace: str
    owner: OwnerRef | None


@dataclass(frozen=True, slots=True)
class OwnerLink:
    """One controller reference followed up from the pod."""

    kind: str
    group: str
    name: str
    uid: str
    #: the owner object is held by the engine (else it is known from the reference alone)
    seen: bool
    #: name of the description in force for its kind ("" when none)
    description: str
    #: its kind's only description is invalid (a description object failed validation)
    description_error: bool
    #: this owner is the pod's workload (the highest described one reached)
    workload: bool
    #: the owner was removed, and is walked through its ghost (kind, name and its own
    #: controller reference kept for a while: docs/karta-attribution.md, "Absent owners")
    ghost: bool = False

    @property
    def described(self) -> bool:
        return bool(self.description)


@dataclass(frozen=True, slots=True)
class Explanation:
    """A pod's attribution and the chain of owners behind it."""

    #: the engine's answer (what the proxy stamps, or the reason it stamps nothing)
    attribution: PodAttribution
    #: owners walked, nearest first
    chain: tuple[OwnerLink, ...]
    #: how the walk ended: one of the ``END_*`` values
    walk_end: str
    max_owner_hops: int


def explain_pod(
    pod: PodLike,
    attribution: PodAttribution,
    pods: Mapping[str, PodLike],
    graph: OwnerGraph,
    description_of: Callable[[GroupKind], str | None],
    errored: Callable[[GroupKind], bool],
) -> Explanation:
    """Walk ``pod``'s controller chain as :meth:`OwnerGraph.walk` does, naming each owner.

    ``description_of`` gives the name of the description an owner walk may stop at for a
    kind (None when undescribed), ``errored`` whether a kind's only description is invalid.
    """
    wl = attribution.workload
    links: list[OwnerLink] = []
    ref = pod.owner
    end = END_NO_CONTROLLER if ref is None else END_TOP
    hops = 0
    namespace = pod.namespace
    while ref is not None:
        if hops >= graph.max_hops or any(link.uid == ref.uid for link in links):
            end = END_HOP_LIMIT  # the limit, or a reference back to an owner passed
            break
        hops += 1
        up: OwnerRef | None = None
        seen = True
        ghost = None
        rec = graph.objects.get(ref.uid)
        if graph.foreign(ref.uid, namespace):  # another namespace's: absent to this one
            gk, name, seen = ref.gk, ref.name, False
        elif rec is not None:
            gk, name, up, namespace = rec.gk, rec.name, rec.owner, rec.namespace
        else:
            owner_pod = pods.get(ref.uid)
            ghost = graph.ghosts.get(ref.uid) if owner_pod is None else None
            if ghost is not None:  # removed: passed as absent, its own reference known
                gk, name, up, seen = ghost.gk, ghost.name, ghost.owner, False
                namespace = ghost.namespace
            elif owner_pod is None:
                gk, name, seen = ref.gk, ref.name, False
            else:
                gk, name, up = POD, owner_pod.name, owner_pod.owner
        desc = description_of(gk)
        is_workload = wl is not None and wl.uid == ref.uid
        if desc is None and is_workload:
            # placed by a description the walk does not stop at (a controlling bare pod
            # under the Pod description): the engine's answer names it
            desc = attribution.description or None
        links.append(OwnerLink(
            gk.kind, gk.group, name, ref.uid, seen, desc or "",
            desc is None and errored(gk), is_workload, ghost is not None,
        ))
        if not seen and up is None:
            end = END_OWNER_MISSING
            break
        ref = up
    return Explanation(attribution, tuple(links), end, graph.max_hops)
