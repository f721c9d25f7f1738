"""A path a user gives that names a file shipped in the package (``titan_ext/assets/tiny``), from any directory."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def resolve_asset_path(path: str) -> str:
    """A ``titan_ext/...`` path that is not under the working directory names the installed package's file."""
    if not path or os.path.exists(path):
        return path
    parts = Path(path).parts
    if parts and parts[0] == PACKAGE_ROOT.name:
        return str(PACKAGE_ROOT.joinpath(*parts[1:]))
    return path
