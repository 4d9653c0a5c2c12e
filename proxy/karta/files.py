"""The files a folder stands for, as snapshot folders and description folders are read."""

from __future__ import annotations

import os
from pathlib import Path


def folder_files(folder: Path) -> list[Path]:
    """Every file below ``folder``, recursively, in sorted order, but hidden ones and
    those in hidden folders: editor swap files, ``.git``, and what kubelet keeps in a
    mounted ConfigMap besides its keys (a ``..<timestamp>/`` folder per version, ``..data``
    linking to the current one). The keys are links through ``..data``: read through
    them only, each file is read once, in its current version (walked into, the versions
    read two or three times, and during an update the stale one, sorting last, won).
    A link to a folder is not walked into (it is not a file either).

    Raises ``OSError`` (its ``filename`` the folder) when ``folder`` or a visible folder
    below it cannot be listed: ``Path.rglob`` skipped such a folder without a word, so
    its files read as removed (a snapshot folder's objects deleted, a description
    folder's descriptions gone). A folder removed while it is walked is as if it had not
    been listed: that is a removal, not a failure to read."""

    def refused(error: OSError) -> None:
        gone = isinstance(error, FileNotFoundError | NotADirectoryError)
        if not gone or os.path.normpath(str(error.filename)) == os.path.normpath(folder):
            raise error

    found: list[Path] = []
    for top, dirs, names in os.walk(folder, onerror=refused):
        # hidden folders are not walked: nothing in them is read, so an unreadable one
        # (a ConfigMap version kubelet is swapping) is not a failure
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        base = Path(top)
        for name in names:
            f = base / name
            if not name.startswith(".") and f.is_file():
                found.append(f)
    return sorted(found)
