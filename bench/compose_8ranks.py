"""Every parallelism at once on 8 gloo ranks, against one process from the same seed checkpoint (outside CI).

    python bench/compose_8ranks.py [--root DIR]

Runs the integration matrix's opt-in rows (``tests/integration_matrix.py``, ``Row.opt_in``) for GLA:
``pp2_tp2_cp2_docs`` (tensor x pipeline x context parallel, 2 each, with document masking and validation)
and ``pp2_fsdp2_cp2`` (FSDP x pipeline x context parallel), in one ``torchrun --nproc_per_node=8`` launch,
and prints each row's largest relative difference of losses and gradient norms from one process. CI's
matrix stops at 4 ranks (its machine has 2 cores); 8 processes there take a few minutes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from integration_matrix import OPT_IN_ROWS, run_matrix, table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "compose_8ranks")
    parser.add_argument("--rows", nargs="+", choices=OPT_IN_ROWS, default=OPT_IN_ROWS)
    args = parser.parse_args()
    if args.root.exists():
        shutil.rmtree(args.root)
    results, seconds = run_matrix(args.root, ["fla_gla"], args.rows, timeout=3000)
    print(table(results))
    print(f"\n{seconds:.0f} s in one torchrun launch; logs under {args.root}")
    return 0 if all(r.status in ("ok", "n/a") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
