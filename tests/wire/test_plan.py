"""What a splice is told and answers (proxy.wire.plan), read on their own."""

from __future__ import annotations

from proxy.wire.plan import SpliceResult
from proxy.wire.primitives import Counts


def test_a_result_adds_another_as_counts_do_and_keeps_its_body() -> None:
    """A request spliced in parts answers for the sum of its parts
    (``handler.splice_in_parts``)."""
    whole = SpliceResult(b"", Counts(series=2, samples=3), attributed=1,
                         unattributed={"pod_unknown": 1}, stripped=1)
    part = SpliceResult(b"part", Counts(series=3, samples=4, histograms=1, exemplars=2),
                        attributed=1, unattributed={"pod_unknown": 1, "no_pod_label": 1},
                        stripped=2, encoded=True)
    whole.add(part)
    assert whole == SpliceResult(b"", Counts(series=5, samples=7, histograms=1, exemplars=2),
                                 attributed=2,
                                 unattributed={"pod_unknown": 2, "no_pod_label": 1},
                                 stripped=3)
    assert part.unattributed == {"pod_unknown": 1, "no_pod_label": 1}  # not shared
