"""Which splice runs, and what a machine without the extension gets: the pure-Python
splice with a loud warning, named by --version (and the build info and landing page)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import snappy

from proxy.wire import native
from proxy.wire.native import Splicer
from proxy.wire.plan import OverLimit
from proxy.wire.primitives import Protocol
from tests.wire.conftest import PLAN
from tests.wire_fixtures import request_v1, request_v2, series_v1

REPO = Path(__file__).resolve().parents[2]
#: runs Python with the extension made unimportable, as on a machine that could not build it
WITHOUT = "import sys; sys.modules['proxy.wire._splice'] = None\n"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WITHOUT + code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)


def test_the_extension_is_built_here() -> None:
    # the README's set-up (pip install -e .) compiles it; CI installs the same way
    assert native.native_available(), native.NATIVE_MISSING
    assert native.DEFAULT == "native"


def test_without_the_extension_the_python_splice_runs_and_says_so_loudly() -> None:
    out = _python(
        "import logging; logging.basicConfig()\n"
        "from proxy.wire import native\n"
        "print(native.DEFAULT, native.native_available())\n"
        "native.warn_if_python()\n"
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "False"]
    assert "native splice not built" in out.stderr
    assert "pip install -e ." in out.stderr


def test_version_names_the_splice() -> None:
    out = _python("from proxy.cli import main\nmain(['--version'])\n")
    assert "python splice" in out.stdout
    built = subprocess.run([sys.executable, "-m", "proxy", "--version"], cwd=REPO,
                           capture_output=True, text=True, timeout=60, check=False)
    assert "native splice" in built.stdout


def test_asking_for_the_native_splice_without_it_is_a_clear_error() -> None:
    out = _python(
        "from proxy.wire.native import Splicer\n"
        "from tests.wire.conftest import PLAN\n"
        "Splicer(PLAN, 'native')\n"
    )
    assert out.returncode != 0
    assert "native splice is not built" in out.stderr


@pytest.mark.parametrize("implementation", ["native", "python"])
def test_tables_take_the_same_answers(implementation: str) -> None:
    sp = Splicer(PLAN, implementation)  # type: ignore[arg-type]
    sp.table.update([(b"a", b"p1", (("karta_workload", "w"), ("karta_replica", ""))),
                     (b"a", b"p2", "no_described_owner"), (b"a", b"p3", None)])
    assert len(sp.table) == 2
    with pytest.raises(ValueError):
        sp.table.set(b"a", b"p4", "")
    with pytest.raises(TypeError):
        sp.table.set("a", b"p4", "why")
    sp.table.delete(b"a", b"p1")
    sp.table.delete(b"a", b"missing")
    assert len(sp.table) == 1
    sp.table.clear()
    assert len(sp.table) == 0


#: a stamp longer than the series it goes on, many times (tests/wire/conftest's is short)
LONG_STAMP = tuple((f"karta_{n}", n * 8) for n in ("component", "kind", "namespace", "workload"))


def _tiny_stamped(count: int) -> list[dict[str, str]]:
    return [{"__name__": "m", "namespace": "ml", "pod": "p", "i": str(i)} for i in range(count)]


@pytest.mark.parametrize("protocol", [Protocol.V1, Protocol.V2])
def test_a_splice_past_its_limit_stops_with_the_estimate_of_the_whole(
        implementation: str, protocol: Protocol) -> None:
    # series smaller than their stamps grow many times their size in the splice (12x for
    # 44-byte series and long names: 1.8 GiB for 64 MiB decoded), past what the byte
    # budget reserved; past its limit the splice stops, and says what it would need
    sp = Splicer(PLAN, implementation)  # type: ignore[arg-type]
    sp.table.set(b"ml", b"p", LONG_STAMP)
    sets = _tiny_stamped(3000)
    raw = request_v2(*sets) if protocol is Protocol.V2 else request_v1(
        *(series_v1(s) for s in sets))
    splice = sp.splice_v2 if protocol is Protocol.V2 else sp.splice_v1
    whole = splice(raw)
    grown = len(whole.body) - len(raw)
    # RW 1.0 repeats the stamp in every series; RW 2.0 adds its strings once, and refs
    assert grown > (2 * len(raw) if protocol is Protocol.V1 else len(raw) // 10)
    with pytest.raises(OverLimit) as stopped:
        splice(raw, grown // 2)
    # the native splice counts its scratch too (spans, the stamps it copies, the RW 2.0
    # series' places): more
    assert grown <= stopped.value.need <= 4 * grown + 2 * len(raw)
    # asked for more as it grows, it goes on: no redo
    asked: list[int] = []

    def grow(need: int) -> int:
        asked.append(need)
        return need + need // 4

    again = splice(raw, grown // 2, grow)
    assert (again.body, again.counts, again.attributed) == (
        whole.body, whole.counts, whole.attributed)
    assert 1 <= len(asked) <= 3, asked
    assert sp.splice_snappy(protocol, raw, snappy.compress(raw), 0, grown // 2,
                            grow).counts == whole.counts
    # refused more (0, or no more than held): stopped
    with pytest.raises(OverLimit):
        sp.splice_snappy(protocol, raw, snappy.compress(raw), 0, grown // 2, lambda need: 0)


def test_a_grow_that_fails_is_the_splices_error(implementation: str) -> None:
    sp = Splicer(PLAN, implementation)  # type: ignore[arg-type]
    sp.table.set(b"ml", b"p", LONG_STAMP)
    raw = request_v1(*(series_v1(s) for s in _tiny_stamped(100)))

    def grow(need: int) -> int:
        raise KeyError("no budget here")

    with pytest.raises(KeyError):
        sp.splice_v1(raw, 0, grow)


def test_an_untouched_body_is_within_any_limit_in_rw1(implementation: str) -> None:
    sp = Splicer(PLAN, implementation)  # type: ignore[arg-type]
    raw = request_v1(*(series_v1({"__name__": "m", "i": str(i)}) for i in range(500)))
    assert sp.splice_v1(raw, 0).body == raw


def test_the_native_splice_holds_no_more_than_its_limit() -> None:
    # measured in a process of its own: the high-water mark of its memory past the body
    code = (
        "import sys\n"
        "from proxy.wire.native import Splicer\n"
        "from proxy.wire.plan import OverLimit\n"
        "from tests.wire.conftest import PLAN\n"
        "from tests.wire.test_native import LONG_STAMP\n"
        "def mib(key):\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith(key):\n"
        "            return int(line.split()[1]) / 1024\n"
        "sp = Splicer(PLAN, 'native')\n"
        "sp.table.set(b'ml', b'p', LONG_STAMP)\n"
        "def lab(n, v):\n"
        "    b = b'\\x0a' + bytes([len(n)]) + n + b'\\x12' + bytes([len(v)]) + v\n"
        "    return b'\\x0a' + bytes([len(b)]) + b\n"
        "ts = lab(b'__name__', b'm') + lab(b'namespace', b'ml') + lab(b'pod', b'p')\n"
        "one = b'\\x0a' + bytes([len(ts)]) + ts\n"
        "raw = one * ((32 << 20) // len(one))\n"
        "base = mib('VmRSS')\n"
        "try:\n"
        "    sp.splice_v1(raw, len(raw))\n"
        "except OverLimit as e:\n"
        "    print(mib('VmHWM') - base, e.need / 2**20)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True)
    held, need = map(float, out.stdout.split())
    assert held < 32 + 8, out.stdout  # the limit (the body's size), and slack
    assert need > 5 * 32  # what it would have held: ~0.9 GiB
