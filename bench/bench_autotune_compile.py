"""Time to autotune GLA 340M's fla kernels on a cold Triton cache: Triton as shipped vs titan_ext's
configs compiled together (``titan_ext.kernels.autotune``), side by side in one run.

Each side runs in a process of its own with an empty Triton cache: one forward and backward of fla's
``chunk_gla``, its gated output norm, the pre-norm with its residual, and SwiGLU with the down projection,
at GLA 340M's shapes (batch 16 x 2048 tokens, 4 heads, key 128, value 256, width 1024, bf16). Without a GPU
(the default), Triton compiles for an H100 through a driver that launches nothing
(``bench/compile_only_h100.py``): every config of every kernel is compiled as on the GPU, and each "times"
the same, so what is measured is the compiling. ``--cuda`` runs it on the GPU, tuning for real.

    python bench/bench_autotune_compile.py                # CPU: compiling for an H100, this machine's cores
    python bench/bench_autotune_compile.py --cuda         # on a GPU machine
    python bench/bench_autotune_compile.py --quick        # the pre-norm alone: CI checks that it still runs
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = {"serial": "Triton as shipped (one config at a time)", "together": "configs compiled together"}


def gla_340m_block(device: str, quick: bool = False) -> None:
    """One forward and backward of the fla kernels a GLA 340M block calls in training (``quick``: the
    pre-norm's alone)."""
    import torch
    from fla.modules.activations.ops import swiglu_linear
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.layernorm import rms_norm
    from fla.ops.gla import chunk_gla

    batch, seq, heads, key, value, width = 16, 2048, 4, 128, 256, 1024

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()

    x, residual = leaf(batch, seq, width), leaf(batch, seq, width)
    normed, new_residual = rms_norm(x, leaf(width), None, residual=residual, prenorm=True)
    if quick:
        (normed.float().sum() + new_residual.float().sum()).backward()
        return
    q, k = leaf(batch, seq, heads, key), leaf(batch, seq, heads, key)
    v, g = leaf(batch, seq, heads, value), leaf(batch, seq, heads, key, dtype=torch.float32)
    o, _ = chunk_gla(q, k, v, torch.nn.functional.logsigmoid(g) / 16)
    o = rms_norm_gated(o, leaf(batch, seq, heads, value), leaf(value), None, activation="swish")
    hidden = 2816
    y = swiglu_linear(leaf(batch, seq, hidden), leaf(batch, seq, hidden), leaf(width, hidden), None)
    (o.float().sum() + y.float().sum() + normed.float().sum() + new_residual.float().sum()).backward()


def run_side(side: str, cuda: bool, quick: bool) -> dict:
    import fla.ops.gla  # noqa: F401 - fla reads the machine's driver when imported
    import torch
    from compile_only_h100 import compile_only_h100, compiles_recorded
    from triton.runtime.autotuner import Autotuner

    from titan_ext import patching
    from titan_ext.kernels import host_patches as kernel_patches
    from titan_ext.kernels.autotune import COMPILE_THREADS, compile_workers

    if side == "together":
        patching.apply_once(kernel_patches.CUDA)
    start = time.perf_counter()
    with compiles_recorded() as compiles:
        if cuda:
            gla_340m_block("cuda", quick)
            torch.cuda.synchronize()
        else:
            with compile_only_h100():
                gla_340m_block("cpu", quick)
    seconds = time.perf_counter() - start
    chosen = {
        f"{tuner.base_fn.__name__}{list(key)}": str(config.all_kwargs())
        for tuner in gc.get_objects() if isinstance(tuner, Autotuner) for key, config in tuner.cache.items()
    }
    return {"side": side, "seconds": seconds, "compiles": len(compiles), "workers": compile_workers(),
            "in_threads": sum(name.startswith(COMPILE_THREADS) for name in compiles), "chosen": chosen}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cuda", action="store_true", help="tune on this machine's GPU instead of compiling only")
    parser.add_argument("--quick", action="store_true", help="the pre-norm's kernels alone (seconds: checks the script)")
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one side, in its own process
    args = parser.parse_args(argv)
    if args.side:
        print(json.dumps(run_side(args.side, args.cuda, args.quick)))
        return []
    flags = [flag for flag, on in (("--cuda", args.cuda), ("--quick", args.quick)) if on]
    results = []
    for side in SIDES:
        with tempfile.TemporaryDirectory() as cache:
            path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
            proc = subprocess.run([sys.executable, __file__, "--side", side, *flags], capture_output=True, text=True,
                                  env={**os.environ, "TRITON_CACHE_DIR": cache, "PYTHONPATH": path})
        if proc.returncode != 0:
            sys.exit(f"side {side!r} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        result = results[-1]
        print(f"measured {side}: {result['seconds']:.1f} s, {result['compiles']} kernels compiled", flush=True)
    serial, together = results
    where = "on this GPU" if args.cuda else "for an H100 on this CPU (nothing launched)"
    print(f"\nGLA 340M {'pre-norm' if args.quick else 'block'}, fla's kernels autotuned on a cold Triton cache, "
          f"{where}; {together['workers']} compile threads ({os.cpu_count()} cores)\n")
    print(f"| {'side':<44} | {'seconds':>8} | {'kernels compiled':>16} | {'in threads':>10} | {'ratio':>6} |")
    print(f"| {'-' * 44} | {'-' * 8} | {'-' * 16} | {'-' * 10} | {'-' * 6} |")
    for result in results:
        print(f"| {SIDES[result['side']]:<44} | {result['seconds']:>8.1f} | {result['compiles']:>16} | "
              f"{result['in_threads']:>10} | {serial['seconds'] / result['seconds']:>6.2f} |")
    differ = sorted(k for k in serial["chosen"] if serial["chosen"][k] != together["chosen"].get(k))
    print(f"\nconfigs chosen: {len(serial['chosen'])} tuning keys, {len(differ)} differ"
          + (f" (GPU timing noise): {', '.join(differ)}" if differ else ""))
    return results


if __name__ == "__main__":
    main()
