"""The benchmarks still run: bench_train.py --cpu-tiny prints seven rows and row (c)'s profile, bench_data.py three,
bench_autotune_compile.py --quick two."""

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
    # torchtitan's own data-loading share, read from the rows' metrics: what a dataloader worker removes
    waits = re.findall(r"measured \([b-g]\).*waiting for data (\d+\.\d)% of the step", proc.stdout)
    assert len(waits) == 6 and all(0 <= float(w) < 100 for w in waits), proc.stdout[-3000:]
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")[1:]]
        # on the CPU no allocated peak: n/a, and so its ratio; every other figure a number
        assert cells[2:4] == ["n/a", "n/a"], row
        numbers = [float(cell.replace(",", "")) for cell in cells[:2] + cells[4:]]
        assert len(numbers) == 6 and all(math.isfinite(n) and n >= 0 for n in numbers), row
        assert numbers[0] > 0 and numbers[2] > 0, row  # tokens/s, seconds to step 1
    assert "peak alloc: n/a on the CPU" in proc.stdout, proc.stdout[-3000:]
    # row (c)'s last two steps under torch.profiler: its top ops (the CPU's), after the rows
    profile = proc.stdout[proc.stdout.index("Top 15 ops by CPU time"):].splitlines()
    assert "of (c), steps 6-7" in profile[0] and profile[1].startswith("| kernel (CPU: op)"), profile[:3]
    ops = [line for line in profile[3:] if line.startswith("| ")]
    assert len(ops) == 15 and any(line.startswith("| aten::mm ") for line in ops), profile[:18]


def test_bench_report_keeps_every_column_as_a_ratio_beside_its_figure():
    """What a lease pastes into bench/RESULTS.md: the rows side by side, each figure beside its ratio to the first
    row, n/a where a figure is missing, then the profile's table."""
    bench_train = bench_module("bench_train")
    args = bench_train.parse_args(["--rows", "a,c,d"])
    rows = [bench_train.Row("(a) plain PyTorch loop", 1000.0, 10.0, 50.0),
            bench_train.Row("(c) (b) + compile", 1500.0, 8.0, 25.0, data_loading_percent=2.5),
            bench_train.Row("(d) (b) + Float8", 1800.0, float("nan"), 100.0, data_loading_percent=3.0)]
    hotspots = [bench_train.Hotspot("chunk_gla_fwd_kernel_o", 30.0, 60.0, 96),
                bench_train.Hotspot("sm90_gemm", 20.0, 40.0, 3)]
    lines = bench_train.report(rows, hotspots, flops=2_000_000_000, peak=1e15, args=args)
    assert lines[0].startswith("GLA train_configs/gla_340M.toml, batch 16 x seq 2048, median of steps 11-27"), lines[0]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("| (")]
    header = next(line for line in lines if line.startswith("| run"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == [
        "run", "tokens/s", "vs base", "peak alloc GiB", "vs base", "first step s", "vs base", "MFU %", "data wait %"]
    assert table[1] == ["(c) (b) + compile", "1,500.0", "1.500", "8.00", "0.800", "25.0", "0.500", "0.300", "2.5"]
    assert table[2][3:5] == ["n/a", "n/a"] and table[2][2] == "1.800", table[2]
    profile = lines[lines.index("") + 1:]
    assert profile[0].startswith("Top 2 ") and profile[0].endswith(" of (c), steps 28-30 (torch.profiler)"), profile[0]
    assert [cell.strip() for cell in profile[1].strip("|").split("|")] == ["kernel (CPU: op)", "ms/step", "share %", "calls/step"]
    assert [cell.strip() for cell in profile[3].strip("|").split("|")] == ["chunk_gla_fwd_kernel_o", "10.00", "60.0", "32"]


def test_bench_rows_option_picks_rows_in_order_and_refuses_unknown_letters(capsys):
    import pytest

    bench_train = bench_module("bench_train")
    assert bench_train.parse_args(["--rows", "c,g"]).rows == "cg"
    assert bench_train.parse_args([]).rows == "abcdefg"
    for rows, error in (("c,x", "unknown rows x"), (",", "no rows")):
        with pytest.raises(SystemExit):
            bench_train.parse_args(["--rows", rows])
        assert f"--rows {rows.replace(',', '')!r}: {error}" in capsys.readouterr().err


def test_bench_data_quick_check_prints_three_rows_of_tokens_per_second_and_two_of_waits():
    proc = subprocess.run(
        [sys.executable, "bench/bench_data.py", "--mb", "0.3", "--batches", "10", "--seq", "128", "--batch", "4",
         "--wait-batches", "3", "--step-ms", "20"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.startswith(("stream order", "shuffle buffer"))]
    assert len(rows) == 3, proc.stdout[-3000:]
    assert all(float(row[-2].replace(",", "")) > 0 and math.isfinite(float(row[-1])) for row in rows), rows
    waits = [line.split() for line in proc.stdout.splitlines() if line.startswith(("0 dataloader", "1 dataloader"))]
    assert len(waits) == 2 and all(float(row[-2]) >= 0 for row in waits), proc.stdout[-3000:]


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
    assert gpu_proof.parse_stage("eager:debug_gla@90") == ("eager", "debug_gla", 90.0)
    assert gpu_proof.parse_stage("tests") == ("tests", "", None)
    for stages, error in ([["train:nope"], "no train_configs/nope.toml"], [["tests:x"], "use tests, bench, bench:ROWS"],
                          [["bench:c,x"], "unknown rows x; give letters of abcdefg"], [["train"], "or eager:CONFIG"],
                          [["tests@soon"], "'soon' after @ is not a number of seconds, e.g. tests@300"],
                          [["bench@0"], "'0' after @ is not a number"]):
        with pytest.raises(SystemExit):
            gpu_proof.parse_args([*stages, "--out", str(tmp_path)])
        assert error in capsys.readouterr().err


def test_gpu_proof_stops_a_stage_at_its_time_with_every_process_it_started_and_keeps_its_log(tmp_path):
    """A lease's stage that runs out of time must not hold the GPU for the next one (torchrun's workers
    live in sessions of their own), and what it printed must survive (the first leases lost theirs)."""
    import time

    gpu_proof = bench_module("gpu_proof")
    child_pid = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "print('step:  1  loss: 9.0', flush=True)\n"
        "time.sleep(120)\n"
    )
    log = tmp_path / "stage.log"
    start = time.monotonic()
    code, first_step, took, timed_out = gpu_proof.run_logged([sys.executable, "-c", script], log, seconds=3)
    assert timed_out and code != 0 and took < 30 and time.monotonic() - start < 30
    assert first_step is not None and first_step < 3
    assert "step:  1  loss: 9.0" in log.read_text() and "stopped after 3 s" in log.read_text()
    assert took < 10  # stopped at once, not after the grace a process that ignores SIGTERM gets
    assert not gpu_proof.alive(int(child_pid.read_text()))
    code, _, _, timed_out = gpu_proof.run_logged([sys.executable, "-c", "print('done')"], log, seconds=30)
    assert (code, timed_out) == (0, False) and log.read_text() == "done\n"


TRITON_RESULT = (  # what fla's autotuned kernels do (Autotuner.check_disk_cache): Triton's cache manager, by key
    "import os, sys; from triton.runtime.cache import get_cache_manager; key, name, mode = sys.argv[1:]; "
    "cache = get_cache_manager(key); "
    "print(cache.put('{\\\"configs_timings\\\": []}', name, binary=False) if mode == 'put' else cache.get_file(name))"
)


def triton_result(cache: Path, key: str, name: str, mode: str) -> str:
    """Triton's own cache manager with ``TRITON_CACHE_DIR=cache/triton``: ``put`` writes a result, ``get`` prints
    the path Triton's autotuner would read it from (None when it finds none)."""
    env = {**__import__("os").environ, "TRITON_CACHE_DIR": str(cache / "triton")}
    proc = subprocess.run([sys.executable, "-c", TRITON_RESULT, key, name, mode], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


def test_a_leases_autotuning_results_join_the_committed_file_and_unpack_where_triton_looks(tmp_path):
    """Each lease's results (Triton's files under TRITON_CACHE_DIR, as fla's kernels save them) join
    bench/gpu-autotune.tgz (``gpu_lease.sh --keep``), which the next lease unpacks into its Triton cache, where
    Triton's autotuner finds them by key; results of earlier leases stay, a broken archive changes nothing."""
    import tarfile

    lease, results = str(REPO / "bench" / "gpu_lease.sh"), str(REPO / "bench" / "autotune_results.sh")
    assert subprocess.run(["bash", "-n", lease]).returncode == 0 and subprocess.run(["bash", "-n", results]).returncode == 0
    repo, returned = tmp_path / "repo", tmp_path / "files_at"
    (repo / "bench").mkdir(parents=True)
    returned.mkdir()

    def run(*argv):
        return subprocess.run(["bash", *argv], cwd=repo, capture_output=True, text=True)

    def kept() -> list[str]:
        with tarfile.open(repo / "bench" / "gpu-autotune.tgz") as tar:
            return sorted(name.rsplit("/", 1)[1] for name in tar.getnames() if name.endswith(".json"))

    wrong = run(lease, "--keep", str(returned))
    assert wrong.returncode == 2 and "DIR is a device call's files_at" in wrong.stdout
    (returned / "summary.jsonl").write_text("{}\n")
    none = run(lease, "--keep", str(returned))
    assert none.returncode == 1 and "bench/gpu-autotune.tgz unchanged" in none.stdout
    for lease_number, (key, name) in enumerate([("a1" * 32, "chunk_fwd_kernel_h.autotune.json"),
                                                ("b2" * 32, "chunk_gla_fwd_kernel_o.autotune.json")]):
        machine = tmp_path / f"lease{lease_number}"
        assert triton_result(machine, key, name, "put") != "None"
        assert run(results, "pack", str(machine), str(returned / "autotune.tgz")).returncode == 0  # the lease's end
        added = run(lease, "--keep", str(returned))
        assert added.returncode == 0 and f"{lease_number + 1} autotuning results" in added.stdout, added.stdout + added.stderr
    assert kept() == ["chunk_fwd_kernel_h.autotune.json", "chunk_gla_fwd_kernel_o.autotune.json"]
    fresh = tmp_path / "next_lease"
    assert triton_result(fresh, "a1" * 32, "chunk_fwd_kernel_h.autotune.json", "get") == "None"
    unpacked = run(results, "unpack", "bench/gpu-autotune.tgz", str(fresh))  # the next lease's start
    assert unpacked.returncode == 0 and "from past leases: 2" in unpacked.stdout, unpacked.stdout + unpacked.stderr
    found = triton_result(fresh, "a1" * 32, "chunk_fwd_kernel_h.autotune.json", "get")
    assert found.startswith(str(fresh / "triton")) and Path(found).is_file(), found
    assert triton_result(fresh, "b2" * 32, "chunk_gla_fwd_kernel_o.autotune.json", "get") != "None"
    (returned / "autotune.tgz").write_bytes(b"cut short")
    broken = run(lease, "--keep", str(returned))
    assert broken.returncode == 1 and "bench/gpu-autotune.tgz unchanged" in broken.stdout
    assert kept() == ["chunk_fwd_kernel_h.autotune.json", "chunk_gla_fwd_kernel_o.autotune.json"]


def test_bench_autotune_compile_quick_check_compiles_the_same_kernels_both_ways():
    proc = subprocess.run(
        [sys.executable, "bench/bench_autotune_compile.py", "--quick"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith(("| Triton as shipped", "| configs compiled together"))]
    assert len(rows) == 2, proc.stdout[-3000:]
    (_, _, serial_kernels, serial_threads, _), (_, _, kernels, threads, _) = rows
    assert serial_kernels == kernels and int(kernels) > 1 and serial_threads == "0" and int(threads) > 1, rows
    assert re.search(r"configs chosen: [1-9]\d* tuning keys, 0 differ", proc.stdout), proc.stdout[-3000:]


def test_gpu_proof_summarises_a_training_stage_from_its_metrics(tmp_path):
    """A lease's figures come from this summary: it is checked here, on a debug model without compile."""
    import json

    gpu_proof = bench_module("gpu_proof")
    assert gpu_proof.main(["--out", str(tmp_path), "--steps", "4", "eager:debug_gla@240"]) == 0
    (summary,) = [json.loads(line) for line in (tmp_path / "summary.jsonl").read_text().splitlines()]
    assert summary["stage"] == "eager:debug_gla" and summary["exit"] == 0 and summary["steps_done"] == 4, summary
    assert summary["seconds_to_step_1"] > 0 and summary["recompiles"] == 0, summary
    assert summary["tokens_per_s"] > 0 and 0 <= summary["data_loading_percent"] < 100, summary
    assert math.isfinite(summary["loss_first"]) and math.isfinite(summary["loss_last"]), summary
