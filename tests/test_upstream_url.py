"""The upstream URL as its receiver reads it (``proxy.upstream_url``)."""

from __future__ import annotations

import pytest

from proxy.upstream_url import extra_label_value, karta_extra_label, tenant_url


@pytest.mark.parametrize(("query", "found"), [
    ("", ""),
    ("extra_label=env=prod", ""),
    ("Extra_Label=karta_workload=x", ""),  # not VictoriaMetrics' name
    ("extra_label=xkarta_w=1", ""),
    ("extra_label=karta_workload=evil", "karta_workload=evil"),
    ("a=1&extra_label=karta%5Fworkload%3Devil", "karta_workload=evil"),
    ("extra%5flabel=karta_team", "karta_team"),
    ("extra_label=+karta_w=1", " karta_w=1"),
    ("extra_label=env=a;b&extra_label=karta_x=%zz", "karta_x=%zz"),
])
def test_karta_extra_label_reads_the_query_as_victoriametrics_does(query: str, found: str
                                                                   ) -> None:
    assert karta_extra_label(query) == found


#: what VictoriaMetrics 1.79 stored as ``cluster`` for a series sent with ``cluster="c2"``
#: and each query (measured: a direct write, then a query of the series)
@pytest.mark.parametrize(("query", "stored"), [
    ("", None),  # c2, the series' own
    ("extra_label=cluster=c3", b"c3"),
    ("extra_label=cluster=c3&extra_label=cluster=c4", b"c4"),  # the last wins
    ("extra_label=cluster=c3&extra_label=cluster=", b"c3"),  # an empty one is skipped
    ("extra_label=cluster=", None),
    ("extra_label=%20cluster=c3", None),  # another label, " cluster"
    ("extra_label=cluster=c%zz", None),  # Go skips a pair with a bad escape
    ("extra_label=cluster=c3&extra_label=cluster=c%zz", b"c3"),
    ("extra_label=cluster=c3;x=1", None),  # and one holding a ";"
    ("Extra_Label=cluster=c3", None),  # another parameter
    ("extra_label=cluster=c+3", b"c 3"),
    ("extra_label=cluster==c3", b"=c3"),
    ("extra%5Flabel=cluster%3Dc3", b"c3"),
    ("a=1&extra_label=env=prod&extra_label=cluster=%E2%9C%93", "\u2713".encode()),
])
def test_extra_label_value_is_what_victoriametrics_stores(query: str, stored: bytes | None
                                                          ) -> None:
    assert extra_label_value(query, b"cluster") == stored


@pytest.mark.parametrize(
    ("url", "tenant", "expected"),
    [
        ("http://vm:8480/insert/0/prometheus/api/v1/write", "5",
         "http://vm:8480/insert/5/prometheus/api/v1/write"),
        ("http://vm:8480/insert/0/prometheus", "5:1", "http://vm:8480/insert/5:1/prometheus"),
        ("http://vm:8480/insert/0/prometheus/api/v1/write", None,
         "http://vm:8480/insert/0/prometheus/api/v1/write"),
        ("http://gw/{tenant}/push", "3", "http://gw/3/push"),
        ("http://gw/{tenant}/push", None, "http://gw/0/push"),
        ("http://prom:9090/api/v1/write", None, "http://prom:9090/api/v1/write"),
        ("http://prom:9090/api/v1/write", "5", None),  # no place for a tenant
    ],
)
def test_tenant_url(url: str, tenant: str | None, expected: str | None) -> None:
    assert tenant_url(url, tenant, "0") == expected
