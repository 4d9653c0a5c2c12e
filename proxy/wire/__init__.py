"""The wire layer: remote-write bodies read and rewritten at the protobuf wire level.

``primitives`` (varints, fields, labels) -> ``plan`` (what a splice is told and answers)
-> ``podtable`` (the per-pod answers) -> ``splice_v1`` / ``splice_v2`` (the pure-Python
reference splices) and ``_splice`` (the native ones, with ``_snappy_edit``'s output
block; ``native`` chooses) -> ``convert`` (2.0 -> 1.0 for 1.0-only upstreams, the
reference of the native ``_convert``; ``conversion`` chooses) and ``halves`` (a request
cut in parts for an upstream that refused it for its size).
"""
