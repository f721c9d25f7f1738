"""The integration matrix's runs, one model per mixer kind: they stand for those model types' multi-rank cells."""

from __future__ import annotations

import sys
from pathlib import Path

from titan_ext.census.columns import LAYOUTS, PLANS

MATRIX = Path(__file__).resolve().parents[2] / "tests" / "integration_matrix.py"
"""The integration matrix, in a clone: its runs stand for one model per mixer kind's multi-rank columns."""


def matrix_runs() -> dict[str, tuple[tuple[str, str, str], dict[str, str]]]:
    """Mixer kind -> ((library, model type, matrix spec), {column: ``spec/row``}) from the integration matrix
    (``MIXER_SPECS``, ``mixer_runs``); empty in an install without the repository's tests."""
    if not MATRIX.exists():
        return {}
    sys.path.insert(0, str(MATRIX.parent))
    try:
        import integration_matrix
    finally:
        sys.path.remove(str(MATRIX.parent))
    return {mixer: (integration_matrix.MIXER_SPECS[mixer], runs) for mixer, runs in integration_matrix.mixer_runs().items()}


def with_runs(cells: dict, runs: dict) -> dict:
    """The census's cells with each planned multi-rank cell of a matrix-run model type (``matrix_runs``) naming
    the matrix row that ran it instead."""
    ran = {(library, model_type): found for (library, model_type, _), found in runs.values()}
    return {key: {column: (f"ran: `{ran[key][column]}`" if value == PLANS and column in ran.get(key, {}) else value)
                  for column, value in cell.items()} for key, cell in cells.items()}


def runs_section(runs: dict) -> list[str]:
    """The table of the matrix's runs, one model per mixer kind."""
    if not runs:
        return []
    columns = [*(c for c in LAYOUTS if c != "documents"), "documents"]
    lines = ["", "## Runs on several ranks, one model per mixer kind", "",
             "Each cell names the integration-matrix row (`python tests/integration_matrix.py --spec SPEC --rows ROW`, "
             "`tests/integration_matrix.py: MIXER_SPECS`) that trains that model equal to one process from one seed "
             "checkpoint; `—`: no row runs it. The census table's cells of these model types say `ran:` with the same "
             "row where they plan (the matrix trains its own tiny config of that type, which may hold fewer kinds of layers "
             "than the census's). A mixer kind not listed has the plan-time checks above only.", "",
             "| mixer | model type (matrix spec) | " + " | ".join(columns) + " |", "|" + " --- |" * (len(columns) + 2)]
    for mixer, ((library, model_type, spec), found) in runs.items():
        cells = [f"`{found[c]}`" if c in found else "—" for c in columns]
        lines.append(f"| {mixer} | {library} `{model_type}` (`{spec}`) | " + " | ".join(cells) + " |")
    return lines
