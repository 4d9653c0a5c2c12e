"""pyproject.toml's lower bounds are releases the proxy and its checks work on.

A user whose environment already holds an older allowed release (a distro package, a
shared image) gets it: a bound older than an API the code uses is an install that succeeds
and a proxy that fails at run time. Each floor below is the first release with something
the code relies on, found by installing every bound as it is declared
(``bash .ci/lowest-deps``) and bisecting the failing package; a bound lowered past one,
or a floor raised here without the bound, fails this test before it reaches a user.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

#: package -> (first release that works, what needs it)
FLOORS: dict[str, tuple[str, str]] = {
    "aiohttp": ("3.14.4", "RequestHandler._pause_transport_reading, _resume_transport_reading "
                          "and _buffer_paused (proxy/connection_guard.py's hold)"),
    "cachetools": ("5.5", "TTLCache.expire() returning what expired (proxy/index.py's "
                          "tombstones; before 5.5 /metrics failed mid-page)"),
    "cramjam": ("2.11", "zstd.compress declaring the frame's content size (proxy/compression"
                        ".py: the upstream body's size is checked before it is decoded)"),
    "jq": ("1.9.1", "error(v) of a value not a string raising ValueError (1.6.0 to 1.9.0 "
                   "abort the process: libjq's assertion in jv_string_length_bytes)"),
    "kubernetes-asyncio": ("34.3.3", "load_from_exec_plugin raising an exec plugin's "
                                     "failure (30.1 to 33.3 logged it and went on without "
                                     "credentials: every request 401, no start-up error)"),
    "msgspec": ("0.18.6", "msgspec.json.Encoder(order=\"sorted\") (proxy/karta/packed.py: "
                          "0.18.0 to 0.18.5 install and fail at import)"),
    "pytest": ("8.2", "pytest-asyncio 0.24's own floor"),
    "pytest-asyncio": ("0.24", "the asyncio_default_fixture_loop_scope option (pyproject); "
                               "0.23.0-0.23.4 fail collection on pytest 8"),
    "ruff": ("0.15.8", "`ruff check .` clean (older: F811/F821/UP027/UP038 here)"),
    "setuptools": ("77", "project.license as an SPDX string (tests/wire build with setup.py)"),
    "packaging": ("24.2", "packaging.licenses (this file's check of project.license)"),
    "mypy": ("1.20.1", "`mypy proxy tests benchmarks` clean (older: 1 to 31 errors)"),
}


def declared() -> dict[str, Requirement]:
    """The runtime dependencies and the test extra, by canonical name."""
    project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]
    reqs = [Requirement(r) for r in
            project["dependencies"] + project["optional-dependencies"]["test"]]
    return {canonicalize_name(r.name): r for r in reqs}


def lower_bound(req: Requirement) -> Version | None:
    """The ``>=`` bound, the version a lowest-bounds install takes."""
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    return max(lows) if lows else None


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_a_bound_is_no_older_than_its_floor(package: str) -> None:
    floor, needs = FLOORS[package]
    req = declared()[canonicalize_name(package)]
    low = lower_bound(req)
    assert low is not None and low >= Version(floor), (
        f"pyproject.toml declares {req}, but {package} {floor} is the first with {needs}")


def test_every_dependency_has_a_lower_bound() -> None:
    """What .ci/lowest-deps pins: a dependency with no ``>=`` is untested at its oldest.
    The stub packages are the exception (types only; mypy's floor covers them)."""
    unbounded = [str(r) for name, r in declared().items()
                 if lower_bound(r) is None and not name.startswith("types-")]
    assert not unbounded


def test_the_installed_releases_meet_the_floors() -> None:
    """An environment assembled around pip (a distro package, --no-deps) can still hold
    an older release than the bound: the suite says so first, by name."""
    from importlib.metadata import PackageNotFoundError, version

    old = []
    for package, (floor, needs) in FLOORS.items():
        try:
            have = Version(version(package))
        except PackageNotFoundError:
            continue
        if have < Version(floor):
            old.append(f"{package} {have} < {floor}: {needs}")
    assert not old


def test_the_license_is_an_spdx_expression_and_the_build_backend_reads_it() -> None:
    """setuptools deprecated ``license = {text = ...}`` (a table) at 77 and stops building
    projects that declare it after 2027-02-18: ``pip install -e .`` on a fresh machine
    takes the newest setuptools, so the README's set-up command would fail from that day.
    The SPDX string is what 77 and later read, hence the build requirement's floor."""
    from packaging.licenses import canonicalize_license_expression

    doc = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))
    license_ = doc["project"]["license"]
    assert isinstance(license_, str), "project.license must be an SPDX string, not a table"
    assert canonicalize_license_expression(license_) == license_
    backend = {canonicalize_name(r.name): r for r in
               map(Requirement, doc["build-system"]["requires"])}
    setuptools = backend[canonicalize_name("setuptools")]
    floor = lower_bound(setuptools)
    assert floor is not None and floor >= Version("77"), setuptools
