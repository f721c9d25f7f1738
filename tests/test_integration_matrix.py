"""The integration matrix (``tests/integration_matrix.py``): run once per session, one test per spec x row.

Its launch starts with the session's first test and runs in the background (``conftest.matrix_launch``); these
tests run last and wait for it.

Rows that cannot run on CPU are reported as skipped, with the reason.
"""

import math
import time

import pytest
from integration_matrix import ALL_ROWS, RTOL, SPECS, Matrix, applies, compare, table


@pytest.fixture(scope="module")
def matrix_root(matrix_launch):
    return matrix_launch.matrix.root


@pytest.fixture(scope="module")
def matrix(matrix_launch):
    waited = time.monotonic()
    results, seconds = matrix_launch.results()
    print(f"\n{table(results)}\nmatrix: {seconds:.0f} s since it started, {time.monotonic() - waited:.0f} s of them waited for")
    return {(r.spec, r.row): r for r in results}


def test_driver_finished(matrix):
    assert ("-", "driver") not in matrix, matrix.get(("-", "driver"))


def test_every_job_frees_its_process_groups(matrix, matrix_root):
    """No job leaves a process group behind in the driver's processes (``matrix_driver.job_threads``): each
    group's gloo threads and sockets, and its store's, would live through every later job (once 83 groups a
    process, several loops busy: 446 s of system time in a 794 s launch)."""
    import json

    left = {path.stem: json.loads(path.read_text()).get("threads") for path in (matrix_root / "results").glob("*.json")}
    assert left and not {job: threads for job, threads in left.items() if threads != {}}


@pytest.mark.parametrize("spec,row", [(spec, row) for spec in SPECS for row in ALL_ROWS if applies(spec, row)])
def test_row(matrix, spec, row):
    result = matrix[spec, row]
    if result.status == "unsupported":
        pytest.skip(f"unsupported: {result.detail}")
    assert result.status == "ok", f"{spec} {row}: {result.status} (max rel {result.max_rel}): {result.detail}"


def metrics(*losses, grad=1.0, first=1):
    return [{"step": first + i, "loss_metrics/global_avg_loss": x, "grad_norm": grad} for i, x in enumerate(losses)]


@pytest.mark.parametrize(
    "run,problem",
    [
        (metrics(2.0, 1.0), ""),
        (metrics(2.0, 1.0 + 0.5 * RTOL), ""),
        (metrics(2.0, 1.0 + 2 * RTOL), "loss at step 2"),
        (metrics(2.0, 1.0, grad=0.5), "grad_norm at step 1"),  # e.g. DDP averaging instead of summing
        (metrics(2.0, math.nan), "loss at step 2"),
        (metrics(2.0), "logged steps [1]"),
    ],
)
def test_compare_flags_what_differs(run, problem):
    rel, detail = compare(run, metrics(2.0, 1.0), [1, 2])
    assert (problem in detail) if problem else (detail == "" and rel <= RTOL), (rel, detail)


EXPORTS = [("fla_gla", "hf"), ("fla_transformer", "hf"), ("hf_llama", "hf"), ("hf_kimi_linear", "hf"),
           ("hf_qwen3_moe", "tp2_hf"), ("hf_qwen3_5", "hf"), ("hf_qwen3_next", "hf"),
           *((spec, row) for spec in SPECS for row in ALL_ROWS if row.startswith("hub_") and applies(spec, row))]


@pytest.mark.parametrize("spec, row", EXPORTS)
def test_exported_hf_folder_loads_and_generates_on_cpu(matrix, matrix_root, spec, row):
    """Every export, as a user runs it on a CPU: model (through ``titan_ext.pretrained.from_pretrained``, whose
    portable kernels replace fla's Triton ones that fla models and transformers' hybrids call: Kimi Linear's KDA,
    Qwen3.5's and Qwen3-Next's Gated DeltaNet) and tokenizer from the folder, then ``generate`` (``tp2_hf``:
    exported under TP2 with each expert's intermediate dim split; ``hub_*``: imported from a ``save_pretrained``
    folder, exported in its layout)."""
    import torch
    from transformers import AutoTokenizer

    from titan_ext import pretrained

    if matrix[spec, row].status == "unsupported":
        pytest.skip(f"unsupported: {matrix[spec, row].detail}")
    assert matrix[spec, row].status == "ok", matrix[spec, row].detail
    layout = Matrix(matrix_root, [spec], [row])
    folder = layout.hub_export_folder(spec, row) if row.startswith("hub_") else layout.hf_export_folder(spec, "base", row)
    model, info = pretrained.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = tokenizer("The fox found a map", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4
