"""The wire layer: remote-write bodies read and rewritten at the protobuf wire level.

``primitives`` (varints, fields, labels) -> ``plan`` (what a splice is told and answers)
-> ``podtable`` (the per-pod answers) -> ``splice_v1`` / ``splice_v2`` (the pure-Python
reference splices) and ``_splice`` (the native ones, ``native`` chooses) -> ``convert``
(2.0 -> 1.0 for 1.0-only upstreams).
"""
