"""The benchmarks still run: bench_train.py --cpu-tiny prints five rows, bench_data.py three."""

import math
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_cpu_tiny_prints_five_finite_rows():
    proc = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--cpu-tiny"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \([a-e]\) ", line)]
    assert [r[2:5] for r in rows] == ["(a)", "(b)", "(c)", "(d)", "(e)"], proc.stdout[-3000:]
    for row in rows:
        numbers = [float(cell.replace(",", "")) for cell in row.strip("|").split("|")[1:]]
        assert len(numbers) == 4 and all(math.isfinite(n) and n >= 0 for n in numbers), row
        assert numbers[0] > 0, row


def test_bench_data_quick_check_prints_three_rows_of_tokens_per_second():
    proc = subprocess.run(
        [sys.executable, "bench/bench_data.py", "--mb", "0.3", "--batches", "10", "--seq", "128", "--batch", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("stream order", "shuffle buffer"))]
    assert len(rows) == 3, proc.stdout[-3000:]
    assert all(float(row[-2].replace(",", "")) > 0 and math.isfinite(float(row[-1])) for row in rows), rows
