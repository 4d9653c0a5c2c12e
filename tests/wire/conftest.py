"""Both splices, side by side: every test taking ``splicer`` runs on each."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from proxy import contract
from proxy.wire.native import Splicer, native_available
from proxy.wire.plan import PodPair, SplicePlan

STAMPED = frozenset(n.encode() for n in contract.STAMPED_LABELS)
#: a plan reading (namespace, pod) only
PLAN = SplicePlan(pairs=(PodPair(b"namespace", b"pod"),), stamped=STAMPED)
#: what the table stamps onto pod ml/p
STAMP = (("karta_workload", "w"),)

MakeSplicer = Callable[..., Splicer]


@pytest.fixture(params=["native", "python"])
def implementation(request: pytest.FixtureRequest) -> str:
    if request.param == "native" and not native_available():
        pytest.skip("native splice not built")
    return str(request.param)


@pytest.fixture
def make_splicer(implementation: str) -> MakeSplicer:
    def make(plan: SplicePlan = PLAN, **pods: object) -> Splicer:
        sp = Splicer(plan, implementation)  # type: ignore[arg-type]
        sp.table.set(b"ml", b"p", STAMP)
        return sp

    return make


@pytest.fixture
def splicer(make_splicer: MakeSplicer) -> Splicer:
    return make_splicer()
