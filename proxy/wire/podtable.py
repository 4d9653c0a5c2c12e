"""The pure-Python pod table: (namespace, pod) -> the stamp of that pod, or why it has none.

Its size grows with pods, never with series: the splices hold no per-series state at all.
The native table (``_splice.PodTable``) has the same methods; this one is what the
reference splices read and what runs when the extension is not built.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.wire.plan import PodAnswer, PodStamp

#: what :meth:`PodTable.set` takes: the stamped (name, value) pairs, or a reason
Answer = tuple[tuple[str, str], ...] | str
#: one change for :meth:`PodTable.update`: None removes the pod
Change = tuple[bytes, bytes, "Answer | None"]


class PodTable:
    """(namespace, pod) -> :class:`PodStamp` or a reason string."""

    implementation = "python"

    def __init__(self) -> None:
        self._pods: dict[tuple[bytes, bytes], PodAnswer] = {}
        #: identical pair tuples share one stamp (every pod of a workload component)
        self._stamps: dict[tuple[tuple[str, str], ...], PodStamp] = {}

    def set(self, namespace: bytes, pod: bytes, answer: Answer) -> None:
        if not isinstance(namespace, bytes) or not isinstance(pod, bytes):
            raise TypeError("namespace and pod must be bytes")
        if isinstance(answer, str):
            if not answer:
                raise ValueError("a reason must not be empty")
            self._pods[(namespace, pod)] = answer
            return
        stamp = self._stamps.get(answer)
        if stamp is None:
            stamp = self._stamps[answer] = PodStamp.of(answer)
        self._pods[(namespace, pod)] = stamp

    def delete(self, namespace: bytes, pod: bytes) -> None:
        self._pods.pop((namespace, pod), None)

    def update(self, changes: Iterable[Change]) -> None:
        """Apply many changes at once (the native table takes its lock once for them)."""
        for ns, pod, answer in changes:
            if answer is None:
                self.delete(ns, pod)
            else:
                self.set(ns, pod, answer)
        if len(self._stamps) > 4 * len(self._pods) + 1024:
            live = {id(s) for s in self._pods.values()}
            self._stamps = {k: s for k, s in self._stamps.items() if id(s) in live}

    def get(self, namespace: bytes, pod: bytes) -> PodAnswer | None:
        return self._pods.get((namespace, pod))

    def clear(self) -> None:
        self._pods.clear()
        self._stamps.clear()

    def __len__(self) -> int:
        return len(self._pods)
