"""The files a folder stands for, as snapshot folders and description folders are read."""

from __future__ import annotations

from pathlib import Path


def folder_files(folder: Path) -> list[Path]:
    """Every file below ``folder``, recursively, in sorted order, but hidden ones and
    those in hidden folders: editor swap files, ``.git``, and what kubelet keeps in a
    mounted ConfigMap besides its keys (a ``..<timestamp>/`` folder per version, ``..data``
    linking to the current one). The keys are links through ``..data``: read through
    them only, each file is read once, in its current version (walked into, the versions
    read two or three times, and during an update the stale one, sorting last, won)."""
    return sorted(f for f in folder.rglob("*")
                  if f.is_file() and not any(part.startswith(".")
                                             for part in f.relative_to(folder).parts))
