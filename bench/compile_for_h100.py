"""Before a GPU lease: does every fla kernel titan_ext's models reach compile for an H100? Checked on the CPU.

The interpreter checks (``tests/interpret_checks.py``) run fla's kernels as NumPy, which takes what Triton's
compiler may refuse (a type, a shape, shared memory). This script builds titan_ext's models on the ``fla``
kernel path (fla's at 340M widths, Qwen3.5's and Kimi Linear's at transformers' own; two layers), feeds one row of 2,048 tokens in three documents, and runs
forward and backward through a driver that compiles every kernel for an H100 and launches nothing
(``compile_only_h100.py``): every config fla autotunes is compiled, in threads as in titan_ext's CUDA jobs.
A kernel that does not compile stops it with Triton's error. Minutes on 2 cores; values are not computed.

    python bench/compile_for_h100.py                     # gla, gla_hybrid, gated_deltanet, kda, qwen3_5, kimi_linear
    python bench/compile_for_h100.py kda
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import time

import torch

MODELS = ("gla", "gla_hybrid", "gated_deltanet", "kda", "qwen3_5", "kimi_linear")


def model_args(name: str):
    from titan_ext.models.args import transformers_model
    from titan_ext.models.gated_deltanet import gated_deltanet_flavors
    from titan_ext.models.gla import gla_flavors
    from titan_ext.models.kda import kda_flavors

    if name in ("qwen3_5", "kimi_linear"):  # transformers' own widths (train_configs/qwen3_5.json, kimi_linear.json)
        args = transformers_model("qwen3_5_text" if name == "qwen3_5" else "kimi_linear",
                                  layer_types=["linear_attention", "full_attention"])
        if name == "kimi_linear":  # its special tokens' ids lie beyond the cut vocabulary
            args.config.update(mlp_layer_types=["dense", "dense"], pad_token_id=None, bos_token_id=None,
                               eos_token_id=None)
    else:
        flavor = {"gla": gla_flavors["340M"], "gla_hybrid": gla_flavors["340M_hybrid"],
                  "gated_deltanet": gated_deltanet_flavors["340M"], "kda": kda_flavors["340M"]}[name]
        args = copy.deepcopy(flavor)
    args.config.update(num_hidden_layers=2, vocab_size=512)
    if name == "gla_hybrid":  # GLA, then fla's softmax Attention
        args.config["attn"] = {**args.config["attn"], "layers": [1]}
    args.kernel_path = "fla"
    return args


def main(names) -> None:
    import fla.ops.gla  # noqa: F401 - fla reads the machine's driver when imported
    from compile_only_h100 import compile_only_h100, compiles_recorded

    from titan_ext import patching
    from titan_ext.kernels import host_patches as kernel_patches
    from titan_ext.models.adapter import build_model

    patching.apply_once(kernel_patches.CUDA)
    tokens = torch.randint(0, 512, (1, 2048))
    positions = torch.cat([torch.arange(700), torch.arange(800), torch.arange(548)]).view(1, 2048)
    with compiles_recorded() as compiles:  # one record: the models share kernels, which keep the recorder they bound
        for name in names:
            start, before = time.perf_counter(), len(compiles)
            with torch.device("meta"):
                model = build_model(model_args(name))
            model = model.to_empty(device="cpu").to(torch.bfloat16)
            with compile_only_h100():
                model(tokens, document_positions=positions).float().sum().backward()
            print(f"{name}: {len(compiles) - before} kernels compiled for an H100 in "
                  f"{time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    chosen = sys.argv[1:] or list(MODELS)
    unknown = sorted(set(chosen) - set(MODELS))
    if unknown:
        sys.exit(f"unknown models {unknown}: use any of {', '.join(MODELS)}")
    with tempfile.TemporaryDirectory() as cache:  # cold: every config compiled, none read from an earlier run
        os.environ["TRITON_CACHE_DIR"] = cache
        main(chosen)
