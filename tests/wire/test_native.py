"""Which splice runs, and what a machine without the extension gets: the pure-Python
splice with a loud warning, named by --version (and the build info and landing page)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from proxy.wire import native
from proxy.wire.native import Splicer
from tests.wire.conftest import PLAN

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
