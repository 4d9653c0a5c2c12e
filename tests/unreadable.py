"""Folders that cannot be listed, made for real wherever the tests can make them.

``chmod 000`` denies listing a folder to anyone but root: the tests may run as root
(``.ci/run`` does), whose CAP_DAC_READ_SEARCH lists it anyway. In process, where that is
so, listing that one folder is refused at the one seam the proxy lists folders through
(``os.scandir``, which ``os.walk`` calls); a real process is started without those
capabilities instead (``setpriv``), so the kernel refuses it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: the capabilities that let root list and read what its permissions deny
_DAC_CAPS = "-dac_override,-dac_read_search"


def _denied(folder: Path) -> bool:
    try:
        with os.scandir(folder):
            return False
    except PermissionError:
        return True


@contextlib.contextmanager
def unreadable(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """``folder`` cannot be listed while in the block: by its permissions where they
    deny this process, else by ``os.scandir`` refusing that folder (and only it) as the
    kernel does, ``EACCES``. Yields which of the two (``"permissions"``, ``"scandir"``)."""
    mode = folder.stat().st_mode & 0o7777
    folder.chmod(0)
    try:
        if _denied(folder):
            yield "permissions"
            return
        real = os.scandir
        target = os.path.normpath(os.path.abspath(folder))

        def refused(path: Any = ".") -> Any:
            if not isinstance(path, int) and os.path.normpath(
                    os.path.abspath(os.fspath(path))) == target:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES),
                                      os.fspath(path))
            return real(path)

        with monkeypatch.context() as m:
            m.setattr(os, "scandir", refused)
            yield "scandir"
    finally:
        folder.chmod(mode)


def unprivileged() -> list[str]:
    """The command prefix that starts a process whose folder permissions are enforced:
    none when this one's are, else ``setpriv`` without root's DAC capabilities. Skips the
    test, saying why, when neither works."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "closed"
        probe.mkdir()
        probe.chmod(0)
        try:
            if _denied(probe):
                return []
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                pytest.skip("running as root, which lists a folder its permissions deny, "
                            "and no setpriv to drop CAP_DAC_READ_SEARCH for the process")
            prefix = [setpriv, f"--inh-caps={_DAC_CAPS}", f"--bounding-set={_DAC_CAPS}"]
            code = f"import os; os.listdir({str(probe)!r})"
            run = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True,
                                 text=True, timeout=30)
            if "PermissionError" not in run.stderr:
                pytest.skip("setpriv could not take root's DAC capabilities away: "
                            f"{run.stderr.strip()[-300:] or 'the folder was listed'}")
            return prefix
        finally:
            probe.chmod(0o700)
