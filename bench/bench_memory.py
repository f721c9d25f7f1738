"""Long-context memory on the CPU, side by side in one run: the loss, and document masking.

One training step (forward and backward) of a Qwen3-shaped model (vocabulary 151,936, tied head, qk-norm, GQA;
small depth and width so that it runs on a 2-core, 24 GiB machine) at each token count, one case per fresh
subprocess (its peak resident memory, Linux's ``VmHWM``, is that case's alone, and is reset before the loss; glibc is told to return every large
block to the system, so resident memory follows what torch holds):

- loss: torchtitan's cross-entropy over the whole logits (``full``) vs ``[titan_ext] loss = "chunked"``. The
  loss's peak is the step's peak above the memory held when the model's final hidden states are ready; its
  time share is the head and loss (forward and backward) over the whole step.
- documents (with the chunked loss): no document masking, masking with the ``B x 1 x T x T`` block-causal mask
  (titan_ext's path before per-document attention), and per-document attention from ``cu_seqlens``
  (``kernels.document_attention``, what a job with ``--titan_ext.document_mask`` runs). Extra memory and time
  are against no masking, as a share of that step's.

Beside each measured case, the planner's figure for the same job (``python -m titan_ext.plan``'s step peak: the
most the step's own tensors hold at once, the gradients from where backward computes each, planned on fake
tensors, in a process of its own) and its ratio to the measured step peak above what the process held before
the step (the model, the process itself; the step allocates its gradients, as after torchtitan's ``zero_grad``).

A case whose estimated need exceeds the memory available now is skipped and says so (the full loss at 32k
tokens needs ~80 GB). One step per case, no warm-up: times include first-call costs, the same for every case.

    python bench/bench_memory.py                       # 8k and 32k tokens
    python bench/bench_memory.py --tokens 2048 8192    # other sizes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VOCAB = 151_936
QWEN3_SHAPED = dict(
    model_type="qwen3", vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True,
    max_position_embeddings=40_960, rope_theta=1_000_000.0,
)
DOCUMENT_TOKENS = 2048
"""Mean document length of the document cases (uniform in [1, 2 x this)), cut by the window's edge."""
CASES = ("loss:full", "loss:chunked", "docs:none", "docs:mask", "docs:per_document")
GIB = 2**30


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    """The process's peak resident memory since the last ``reset_peak`` (Linux: ``VmHWM``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def document_positions(tokens: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    positions, start = torch.empty(tokens, dtype=torch.long), 0
    while start < tokens:
        length = int(torch.randint(1, 2 * DOCUMENT_TOKENS, (1,), generator=g))
        end = min(start + length, tokens)
        positions[start:end] = torch.arange(end - start)
        start = end
    return positions[None]


def run_case(case: str, tokens: int) -> dict:
    """One step in this process: its figures."""
    import torch
    import torch.nn.functional as F

    from titan_ext.data import documents
    from titan_ext.job_plan import LossChoice
    from titan_ext.models import loss as job_loss
    from titan_ext.models.adapter import build_model
    from titan_ext.models.args import HFModelArgs
    from titan_ext.models.forward_plan import ForwardPlan

    torch.manual_seed(0)
    kind, variant = case.split(":")
    model = build_model(HFModelArgs(library="transformers", config=dict(QWEN3_SHAPED)))
    model.init_weights()
    chunked = not (kind == "loss" and variant == "full")
    if chunked:
        job_loss.apply_chunked_loss(model, LossChoice(chunk_tokens=0))  # the head runs in the loss
    if variant == "per_document":
        documents.apply_document_attention(model)
    model.forward_plan = ForwardPlan(head_in_loss=chunked, document_attention=variant == "per_document")
    tokens_in = torch.randint(0, VOCAB, (1, tokens))
    labels = torch.randint(0, VOCAB, (1, tokens))
    extra = {"document_positions": document_positions(tokens)} if kind == "docs" and variant != "none" else {}
    if extra:
        labels[extra["document_positions"] == 0] = -100
    for p in model.parameters():
        p.grad = None  # as torchtitan's zero_grad leaves them: the step allocates its gradients (the planner's grads)
    held_before_step = rss_bytes()
    reset_peak()
    start = time.perf_counter()
    head, model.lm_head = model.lm_head, None  # the trunk alone: its hidden states (as a pipeline stage returns them)
    hidden = model(tokens_in, **extra)
    model.lm_head = head
    trunk_forward = time.perf_counter() - start
    trunk_peak = peak_bytes()
    held_before_loss = rss_bytes()
    reset_peak()
    detached = hidden.detach().requires_grad_()
    start = time.perf_counter()
    if chunked:
        loss = head(detached, labels=labels)
    else:
        logits = head(detached)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum", ignore_index=-100)
        del logits
    (loss / tokens).backward()
    loss_seconds = time.perf_counter() - start
    loss_peak = peak_bytes() - held_before_loss
    start = time.perf_counter()
    hidden.backward(detached.grad)
    trunk_backward = time.perf_counter() - start
    step = trunk_forward + loss_seconds + trunk_backward
    peak = max(trunk_peak, peak_bytes())
    return {"case": case, "tokens": tokens, "peak": peak, "step_peak": peak - held_before_step, "loss_peak": loss_peak,
            "step_s": step, "loss_s": loss_seconds, "loss": float(loss)}


def plan_flags(case: str, tokens: int, config_path: str) -> list[str] | None:
    """The job a case's step is one step of, as ``python -m titan_ext.plan`` takes it (one rank); None for the
    block-causal mask, which no job builds any more."""
    kind, variant = case.split(":")
    if variant == "mask":
        return None
    chunked = not (kind == "loss" and variant == "full")
    return ["--job.config_file", str(REPO / "train_configs" / "debug_llama.toml"), "--model.name", "hf",
            "--model.flavor", "from_config", "--titan_ext.hf_config", config_path, "--training.seq_len", str(tokens),
            "--training.local_batch_size", "1", "--titan_ext.loss", "chunked" if chunked else "full",
            *(["--titan_ext.document_mask"] if variant == "per_document" else [])]


def plan_case(case: str, tokens: int) -> dict:
    """The planner's step peak and saved bytes for a case, in this process."""
    import tempfile

    from titan_ext.planner import job_config_of, prepare
    from titan_ext.planner.rank import simulate_rank

    with tempfile.NamedTemporaryFile("w", suffix=".json") as config:
        json.dump(QWEN3_SHAPED, config)
        config.flush()
        flags = plan_flags(case, tokens, config.name)
        if flags is None:
            return {"planned_peak": None}
        prepare()
        planned = simulate_rank(job_config_of(flags), 1)
    return {"planned_peak": planned.peak_bytes, "planned_grads": planned.grad_bytes, "planned_saved": planned.saved_bytes}


def estimate_bytes(case: str, tokens: int) -> float:
    """A rough upper bound of a case's peak, to skip what cannot fit now."""
    base = GIB + tokens * 50_000  # model, grads, activations of the small trunk (0.85 GiB measured at 1k tokens)
    if case == "loss:full":
        return base + 3.2 * tokens * VOCAB * 4  # logits, log-softmax, their gradients: 3.0x the fp32 logits at 1k
    if case == "docs:mask":
        return base + 10 * tokens * tokens  # the bool mask and SDPA's float copy of it
    return base


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024


def measure(case: str, tokens: int) -> dict:
    need, free = estimate_bytes(case, tokens), available_bytes()
    if need > 0.85 * free:
        return {"case": case, "tokens": tokens, "skipped": f"needs ~{need / GIB:.0f} GiB, {free / GIB:.0f} GiB available"}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    figures = {}
    for option in ("--case", "--plan"):  # the step, then the planner, each in a process of its own
        done = subprocess.run([sys.executable, __file__, option, case, "--tokens", str(tokens)], env=env,
                              capture_output=True, text=True)
        if done.returncode != 0:
            return {"case": case, "tokens": tokens, "skipped": f"{option[2:]} failed (exit {done.returncode}): "
                    f"{(done.stderr.strip().splitlines() or ['?'])[-1][:120]}"}
        figures.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return figures


def report(results: list[dict]) -> None:
    by = {(r["case"], r["tokens"]): r for r in results}
    print("\nThe loss: torchtitan's (full) vs chunked, one training step")
    print(f"{'tokens':>7}  {'loss':8} {'step peak GiB':>14} {'loss peak GiB':>14} {'vs full':>8} {'loss time share':>16}")
    for (case, tokens), r in by.items():
        if not case.startswith("loss:"):
            continue
        name = case.split(":")[1]
        if "skipped" in r:
            print(f"{tokens:>7}  {name:8} skipped: {r['skipped']}")
            continue
        full = by.get(("loss:full", tokens), {})
        ratio = f"{r['loss_peak'] / full['loss_peak']:.3f}" if "loss_peak" in full else "-"
        print(f"{tokens:>7}  {name:8} {r['peak'] / GIB:>14.2f} {r['loss_peak'] / GIB:>14.3f} {ratio:>8} "
              f"{r['loss_s'] / r['step_s']:>15.0%}  ({r['step_s']:.1f} s step)")
    print("\nDocument masking (chunked loss): against no masking (docs:none, or loss:chunked: the same step)")
    print(f"{'tokens':>7}  {'masking':12} {'step peak GiB':>14} {'extra GiB':>10} {'extra share':>12} {'time':>8}")
    for (case, tokens), r in by.items():
        if not case.startswith("docs:"):
            continue
        name = case.split(":")[1]
        if "skipped" in r:
            print(f"{tokens:>7}  {name:12} skipped: {r['skipped']}")
            continue
        none = by.get(("docs:none", tokens)) or by.get(("loss:chunked", tokens), {})  # the same step
        if "peak" in none:
            extra = r["peak"] - none["peak"]
            share, time_ratio = f"{extra / none['peak']:.1%}", f"{r['step_s'] / none['step_s']:.2f}x"
        else:
            extra, share, time_ratio = float("nan"), "-", "-"
        print(f"{tokens:>7}  {name:12} {r['peak'] / GIB:>14.2f} {extra / GIB:>10.3f} {share:>12} {time_ratio:>8}")


def planner_report(results: list[dict]) -> None:
    print("\nThe planner (python -m titan_ext.plan, one rank) vs the measured step peak above what was held before it")
    print("(both with the gradients the step allocates; grads: the planner's gradient bytes, all held at the step's end)")
    print(f"{'tokens':>7}  {'case':18} {'planned GiB':>12} {'grads GiB':>10} {'measured GiB':>13} {'planned/measured':>17}")
    for r in results:
        if "skipped" in r:
            continue
        planned, measured = r.get("planned_peak"), r["step_peak"]
        if planned is None:
            print(f"{r['tokens']:>7}  {r['case']:18} {'-':>12} {'-':>10} {measured / GIB:>13.3f}  (no job builds this mask)")
            continue
        print(f"{r['tokens']:>7}  {r['case']:18} {planned / GIB:>12.3f} {r['planned_grads'] / GIB:>10.3f} "
              f"{measured / GIB:>13.3f} {planned / measured:>17.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process (the subprocess)
    parser.add_argument("--plan", help=argparse.SUPPRESS)  # the planner's figures for one case, in this process
    args = parser.parse_args()
    if args.plan:
        print(json.dumps(plan_case(args.plan, args.tokens[0])))
        return
    if args.case:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        print(json.dumps(run_case(args.case, args.tokens[0])))
        return
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, Qwen3-shaped: {QWEN3_SHAPED}")
    results = []
    for tokens in args.tokens:
        for case in args.cases:
            results.append(measure(case, tokens))
            print(json.dumps(results[-1]), flush=True)
    report(results)
    planner_report(results)


if __name__ == "__main__":
    main()
