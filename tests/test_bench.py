"""The benchmarks still run: bench_train.py --cpu-tiny prints seven rows, bench_data.py three."""

import math
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bench_module(name: str):
    """A script of bench/ imported as a module (they import each other by name, as they run from there)."""
    import importlib

    sys.path.insert(0, str(REPO / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_bench_cpu_tiny_prints_seven_finite_rows():
    proc = subprocess.run(
        [sys.executable, "bench/bench_train.py", "--cpu-tiny"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| \([a-g]\) ", line)]
    assert [r[2:5] for r in rows] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)"], proc.stdout[-3000:]
    # each row is printed as it is measured, before the table: a run cut short keeps its finished rows
    measured = [line[9:12] for line in proc.stdout.splitlines() if line.startswith("measured (")]
    assert measured == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)"], proc.stdout[-3000:]
    assert proc.stdout.index("measured (g)") < proc.stdout.index("| (a) "), proc.stdout[-3000:]
    for row in rows:
        numbers = [float(cell.replace(",", "")) for cell in row.strip("|").split("|")[1:]]
        assert len(numbers) == 4 and all(math.isfinite(n) and n >= 0 for n in numbers), row
        assert numbers[0] > 0, row


def test_bench_rows_option_picks_rows_in_order_and_refuses_unknown_letters(capsys):
    import pytest

    bench_train = bench_module("bench_train")
    assert bench_train.parse_args(["--rows", "c,g"]).rows == "cg"
    assert bench_train.parse_args([]).rows == "abcdefg"
    for rows, error in (("c,x", "unknown rows x"), (",", "no rows")):
        with pytest.raises(SystemExit):
            bench_train.parse_args(["--rows", rows])
        assert f"--rows {rows.replace(',', '')!r}: {error}" in capsys.readouterr().err


def test_bench_data_quick_check_prints_three_rows_of_tokens_per_second():
    proc = subprocess.run(
        [sys.executable, "bench/bench_data.py", "--mb", "0.3", "--batches", "10", "--seq", "128", "--batch", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("stream order", "shuffle buffer"))]
    assert len(rows) == 3, proc.stdout[-3000:]
    assert all(float(row[-2].replace(",", "")) > 0 and math.isfinite(float(row[-1])) for row in rows), rows


def test_gpu_proof_sums_kernel_time_by_name_and_refuses_unknown_stages(tmp_path, capsys):
    import json

    import pytest

    gpu_proof = bench_module("gpu_proof")
    trace = tmp_path / "rank0_trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        {"cat": "kernel", "name": "chunk_gla_fwd_kernel_o", "dur": 1500},
        {"cat": "kernel", "name": "chunk_gla_fwd_kernel_o", "dur": 500},
        {"cat": "kernel", "name": "sm90_gemm", "dur": 3000},
        {"cat": "cpu_op", "name": "aten::mm", "dur": 9000},
        {"cat": "kernel", "name": "no_duration"},
    ]}))
    assert gpu_proof.top_kernels(trace) == [("sm90_gemm", 3.0), ("chunk_gla_fwd_kernel_o", 2.0)]
    assert gpu_proof.parse_args(["bench:c,g", "--out", str(tmp_path)]).stages == ["bench:c,g"]
    for stages, error in ([["train:nope"], "no train_configs/nope.toml"], [["tests:x"], "use tests, bench, bench:ROWS"],
                          [["bench:c,x"], "unknown rows x; give letters of abcdefg"], [["train"], "or train:CONFIG"]):
        with pytest.raises(SystemExit):
            gpu_proof.parse_args([*stages, "--out", str(tmp_path)])
        assert error in capsys.readouterr().err
