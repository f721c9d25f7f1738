"""Integration matrix: every train spec x parallelism, activation checkpointing, compile and checkpoint row (CPU).

    python tests/integration_matrix.py [--spec fla_gla ...] [--rows fsdp2 tp2 ...]

prints one line per spec x row (ok / MISMATCH / ERROR / unsupported, with the largest relative difference) and
exits non-zero unless every row that ran is ok. ``tests/test_integration_matrix.py`` runs it once (one torchrun
launch of ``tests/matrix_driver.py``, beside the rest of the suite) and makes one test per row. docs/matrix.md
holds each row's measured time and why the rows are what they are.

Every row starts from one fp32 seed checkpoint per spec (``--debug.seed 0``: the same figures every run) and
is compared with one single-process run from it ("single"): losses and gradient norms at every step within a
relative 1e-4 (TP2: 1e-5), validation losses too where the row validates. Only the order of float reductions
differs: the corpus is one block repeated ``MAX_DP`` times, so every data-parallel rank's batch is the single
process's; clipping is off, so a wrong gradient scale shows in the gradient norm.

The kinds of row:

- parallelisms (``fsdp2``, ``hsdp2x2``, ``tp2``, ``cp2*``, ``pp2*``, ``ep2*`` and their products): the same
  losses as one process, each under the layouts its spec's code paths reach;
- checkpoints: ``resume`` (steps after a resume equal the uninterrupted run's, ==), ``hf`` (HF export, then
  training from it), ``hub_*`` and ``walkthrough`` (a ``save_pretrained`` folder in, its tensors out, step 1's
  loss equal to transformers' own forward; the walkthrough's command read from docs/checkpoints-and-hf.md);
- ``*_docs``: document masking, against one process that masks too;
- ``ac_*`` and ``compile_*``: recompute and compile change nothing; every compiled job runs with dynamo's
  ``error_on_recompile``;
- ``Row.kind`` ``trains`` (the job trains, not compared: emulated Float8) and ``fails`` (every rank stops with the
  expected error: the non-finite guard's ``nan_stop``);
- one spec's rows (``Row.specs``): the extension example (``readme_ext``, as its page writes it), the non-finite
  guard (``nan_*``), emulated Float8; torchtitan's own Llama in CPU mode is a spec (``llama3``);
- opt-in rows (``Row.opt_in``, not in CI: 8 ranks or Triton's interpreter).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from pathlib import Path

import readme_example
import tiktoken_folder
import walkthrough

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"
CORPUS = REPO / "titan_ext" / "assets" / "tiny" / "corpus.jsonl"
DRIVER = Path(__file__).resolve().parent / "matrix_driver.py"

RTOL = 1e-4
TP_RTOL = 1e-5  # the tensor-parallel issue's bar for TP2 against one process
LOG_RTOL = 5e-4  # torchtitan's own models: metrics read from the console, which rounds the grad norm to 4 decimals
STEPS = 5
MAX_DP = 4
CORPUS_BLOCK = 64  # lines; ~5k tokens, more than any rank reads in STEPS steps
# 80 tokens: fla's GLA layer runs its training kernel (chunk_gla) only above 64, fused_recurrent below.
COMMON = (
    "--training.steps", str(STEPS), "--training.seq_len", "80", "--training.local_batch_size", "2",
    "--training.max_norm", "1e9", "--metrics.log_freq", "1",
    # A job that fails on one rank only must not hold the others for long.
    "--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "60",
)

# Rows with ``Row.validation`` validate too (titan_ext.host.validate), on 2 windows of the corpus after steps
# 1, 2 and 4: their validation losses must match the single-process run's like their training figures.
VALIDATION = (
    "--validation.enable", "--validation.freq", "2", "--validation.steps", "2", "--validation.dataset",
    "titan_ext_tiny", "--validation.seq_len", "80", "--validation.local_batch_size", "2",
)
VALIDATED_STEPS = [1, 2, 4]
ACCUMULATE = ("--training.global_batch_size", "4")
"""2 batches of 2 per optimizer step, at data-parallel degree 1 (the PP rows')."""


def parallel(shard: int = 1, replicate: int = 1, tp: int = 1, cp: int = 1, pp: int = 1) -> tuple[str, ...]:
    return (
        "--parallelism.data_parallel_shard_degree", str(shard),
        "--parallelism.data_parallel_replicate_degree", str(replicate),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.pipeline_parallel_degree", str(pp),
    )


@dataclass(frozen=True)
class Spec:
    config: str
    flags: tuple[str, ...] = ()
    recompiles: str = ""
    """Why this spec's compiled blocks recompile (then allowed), or '' (a recompile is an error)."""
    hf_config: dict | None = None
    """The architecture as a config.json (``--titan_ext.hf_config``), for the generic specs."""
    rows: tuple[str, ...] | None = None
    """The rows this spec runs (None: every row meant for all specs)."""


# Generic specs, each on a model type no named spec has: a tiny Qwen3 from its config.json, sharded by its
# own HF plan (base_model_tp_plan, translated), and Gated DeltaNet through --model.name fla.
TINY_QWEN3 = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 2048,
              "max_position_embeddings": 512, "tie_word_embeddings": True}
GENERIC_ROWS = ("single", "fsdp2", "tp2", "ac_op_compile", "pp2")
# A mixture of experts through the generic hf spec (the shipped debug config.json: 8 experts, 2 per token, the
# routers' balancing loss at router_aux_loss_coef 0.01): FSDP2, and full AC (a block's recompute in backward
# routes again, which must not count twice).
TINY_QWEN3_MOE = json.loads((CONFIGS / "debug_qwen3_moe.json").read_text())

# An fla hybrid: GLA with fla's softmax Attention at layer 1 (fla's attn config, grouped-query heads).
GLA_HYBRID = {"model_type": "gla", "attn": {"layers": [1], "num_heads": 4, "num_kv_heads": 2}}
# (FSDP2: the cp2 rows shard over their CP ranks, and each hybrid's ``*_shipped`` spec runs ``fsdp2``.)
HYBRID_ROWS = ("single", "tp2", "cp2", "cp2_docs", "pp2", "ac_op_compile")
# transformers' Qwen3.5: Gated DeltaNet (linear_attn, titan_ext's portable kernel on the CPU) then gated attention.
TINY_QWEN3_5 = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
                "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"], "vocab_size": 2048,
                "max_position_embeddings": 512}
# Qwen3-Next: the same layers with a MoE FFN (4 experts, 2 per token, and a shared expert), experts FSDP-sharded.
TINY_QWEN3_NEXT = {**TINY_QWEN3_5, "model_type": "qwen3_next", "num_experts": 4, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                   "router_aux_loss_coef": 0.01}  # the balancing loss counted over CP (cp2, ep2_cp2) and PP (pp2)

# Qwen2-MoE: a shared expert whose linears its HF plan leaves out (they take its dense FFN's entries under TP).
TINY_QWEN2_MOE = {"model_type": "qwen2_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "vocab_size": 2048,
                  "max_position_embeddings": 512}

# Multi-head latent attention: DeepSeek-V3 (q and kv latents, interleaved rotary dims, value heads narrower than
# query-key heads; a dense layer, then a MoE layer: grouped routing, a shared expert) under TP2 (heads split, each
# expert's intermediate dim split).
TINY_DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "first_k_dense_replace": 1,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "n_group": 2, "topk_group": 1, "vocab_size": 2048, "max_position_embeddings": 512}
# transformers' Kimi Linear: KDA (titan_ext's portable kernel on the CPU) then MLA, MoE FFNs (4 experts): the
# shipped debug TOML (3 KDA layers to 1 MLA, train_configs/kimi_linear_debug.json); 2 layers with dense FFNs for
# its CP rows without EP.
TINY_KIMI_LINEAR_DENSE = {"model_type": "kimi_linear", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
                          "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 12, "linear_num_heads": 4,
                          "linear_head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
                          "mlp_layer_types": ["dense", "dense"], "vocab_size": 2048, "max_position_embeddings": 512,
                          "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}

# A family titan_ext's code never names (transformers' Nemotron-H): a Mamba2 mixer (one group of B and C: under TP2
# both ranks share it), attention and an FFN-only layer each held as ``mixer``, the final norm ``norm_f``.
TINY_NEMOTRON_H = {"model_type": "nemotron_h", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
                   "layers_block_type": ["linear_attention", "full_attention", "mlp"], "num_attention_heads": 4,
                   "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
                   "ssm_state_size": 16, "n_groups": 1, "chunk_size": 16, "vocab_size": 2048,
                   "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# transformers' LFM2: a gated short convolution (titan_ext's forward of it, by structure) then attention (untied:
# a tied weight's DTensor norm rounds apart from one process's by ~1.5e-5, TIED_DTENSOR_RTOL).
TINY_LFM2 = {"model_type": "lfm2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv", "full_attention"],
             "vocab_size": 2048, "max_position_embeddings": 512, "tie_word_embeddings": False}

# transformers' MiniMax: lightning attention (titan_ext's forward of it: simple GLA) then attention, MoE FFNs.
TINY_MINIMAX = {"model_type": "minimax", "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"], "num_local_experts": 4, "num_experts_per_tok": 2,
                "block_size": 16, "vocab_size": 2048, "max_position_embeddings": 512}

# A sliding window on every layer (Mistral's): under CP the attention is masked by it over all-gathered keys and
# values, with and without documents.
TINY_MISTRAL_WINDOW = {"model_type": "mistral", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 24,
                       "vocab_size": 2048, "max_position_embeddings": 512}

# gpt-oss: attention sinks (one logit per head in each softmax's denominator) on a sliding-window layer and a full
# one, and a MoE FFN whose router is ``router`` and whose experts add biases and a clamped SwiGLU: under CP and
# with documents its attention runs over all-gathered keys and values, rescored per block (the ring applies no
# sinks); under TP its HF plan splits nothing in a block (attention and experts kept whole); its balancing loss in
# every row.
TINY_GPT_OSS = {"model_type": "gpt_oss", "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
                "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24,
                "router_aux_loss_coef": 0.01, "vocab_size": 2048, "max_position_embeddings": 512}


TINY_FLA_MAMBA2 = {"model_type": "mamba2", "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16,
                   "state_size": 16, "n_groups": 1, "chunk_size": 16, "vocab_size": 2048}
SPECS = {
    "fla_gla": Spec("debug_gla.toml"),
    "fla_transformer": Spec(
        "debug_transformer.toml",
        recompiles="fla's RotaryEmbedding fills its cos/sin cache lazily in step 1 (_seq_len_cached is a "
        "guarded int): each block's code recompiles once, at step 2 (tests/test_ac_compile.py)",
    ),
    "hf_llama": Spec("debug_llama.toml"),
    "fla_gated_deltanet": Spec("debug_gated_deltanet.toml", flags=("--model.name", "fla", "--model.flavor",
                                                                    "gated_deltanet-debugmodel"),
                               rows=(*GENERIC_ROWS, "cp2", "cp2_docs", "pp2_cp2_docs", "interpret_cp2")),
    # KDA's own spec: its TP plan, state passing (with and without documents) and PP.
    "fla_kda": Spec("debug_kda.toml", rows=("single", "fsdp2", "tp2", "cp2", "cp2_docs", "pp2")),
    "fla_gla_hybrid": Spec(
        "debug_gla.toml", flags=("--model.name", "fla", "--model.flavor", "gla-debugmodel"), hf_config=GLA_HYBRID,
        rows=HYBRID_ROWS,
    ),
    # the shipped hybrid debug TOMLs as a user runs them (GLA with attention at layers 1 and 3; Qwen3.5 3:1)
    "fla_gla_hybrid_shipped": Spec("debug_gla_hybrid.toml", rows=("single", "fsdp2")),
    "hf_qwen3_5_shipped": Spec("debug_qwen3_5.toml", rows=("single", "fsdp2")),
    "hf_qwen3_5": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_QWEN3_5,
                       rows=("single", "tp2", "pp2", "hf", "cp2", "cp2_docs", "hub_fsdp2")),
    "hf_qwen3_next": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_QWEN3_NEXT,
                          rows=("single", "fsdp2", "pp2", "hf", "cp2", "ep2_cp2", "ep2_tp2", "docs_tp2", "hub_ep2")),
    "hf_qwen2_moe": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_QWEN2_MOE,
                         rows=("single", "ep2_tp2", "cp2")),
    "hf_mistral_window": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_MISTRAL_WINDOW,
                              rows=("single", "cp2", "cp2_docs")),
    "hf_gpt_oss": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_GPT_OSS,
                       rows=("single", "cp2", "cp2_docs", "tp2")),
    "hf_deepseek_v3": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_DEEPSEEK_V3,
                           rows=("single", "tp2", "hub_fsdp2")),
    "hf_kimi_linear": Spec("debug_kimi_linear.toml", rows=("single", "ep2_hf", "pp2", "hf", "tp2", "ep2_tp2_fsdp2", "ep2_cp2",
                                                            "hub_tp2", "hub_ep2", "walkthrough")),
    "hf_kimi_linear_dense": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_KIMI_LINEAR_DENSE,
                                 rows=("single", "cp2", "cp2_docs")),
    "hf_qwen3": Spec("debug_llama.toml", flags=("--model.name", "hf"),
                     hf_config=TINY_QWEN3, rows=(*GENERIC_ROWS, "walkthrough")),
    # asking for router logits, as some hub configs do: the balancing loss counted once, by titan_ext, in every row
    "hf_qwen3_moe": Spec("debug_llama.toml", flags=("--model.name", "hf"),
                         hf_config={**TINY_QWEN3_MOE, "output_router_logits": True},
                         rows=("single", "fsdp2", "ac_full", "ep2_resume", "ep2_hf", "ep2_pp2", "ep2_pp2_tp2", "ep2_tp2_etp2", "ep2_cp2",
                               "ep2_tp2_docs", "ep4_tp2", "tp2_hf", "compile_aot_eager", "hub_fsdp2", "hub_tp2", "hub_ep2",
                               "walkthrough")),
    # torchtitan's auxiliary-loss-free balancing (a routing bias, the same on every rank) under EP x HSDP and EP x TP
    "hf_moe_bias": Spec("debug_llama.toml", flags=("--model.name", "hf", "--titan_ext.moe_balance", "bias"),
                        hf_config=TINY_QWEN3_MOE, rows=("single", "ep2_hsdp2x2", "ep2_tp2", "pp2")),
    "hf_lfm2": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_LFM2,
                    rows=("single", "tp2", "cp2", "cp2_docs")),
    "hf_minimax": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_MINIMAX,
                       rows=("single", "tp2", "cp2", "cp2_docs")),
    "hf_nemotron_h": Spec("debug_llama.toml", flags=("--model.name", "hf"), hf_config=TINY_NEMOTRON_H,
                          rows=("single", "fsdp2", "tp2", "pp2", "cp2", "cp2_docs")),
    # fla's own Mamba2 layer (FlaMamba2): its heads under TP (one group, shared by both ranks), state passing and the
    # convolution's halo under CP, with and without documents
    "fla_mamba2": Spec("debug_gla.toml", flags=("--model.name", "fla"), hf_config=TINY_FLA_MAMBA2,
                       rows=("single", "tp2", "cp2", "cp2_docs")),
    # torchtitan's own model, on titan_ext's shipped data and tokenizer (CPU mode covers it too).
    "llama3": Spec("debug_llama.toml", flags=("--model.name", "llama3", "--model.flavor", "debugmodel"),
                   rows=("single", "fsdp2")),
}


@dataclass(frozen=True)
class Row:
    world: int
    flags: tuple[str, ...]
    kind: str = "train"
    """``train``: one job; ``resume``: full job then resumed job; ``hf``: HF export then import."""
    cost: int = 1
    """Rough relative run time: the longest rows start first, so that no lane ends the phase alone."""
    rtol: float = RTOL
    specs: tuple[str, ...] | None = None
    """The specs the row applies to (None: titan_ext's three)."""
    env: tuple[tuple[str, str], ...] = ()
    expect: str = ""
    """kind "fails": the job's error must contain this."""
    documents: bool = False
    """Document masking on, in this row and in the single-process run it is compared with."""
    short_conv: bool = False
    """GLA with short convolutions (``use_short_conv``), in this row and its single-process run."""
    accumulate: bool = False
    """Gradient accumulation over 2 batches per optimizer step (``ACCUMULATE``), in this row and its
    single-process run (torchtitan's own accumulation)."""
    spec_rtol: tuple[tuple[str, float], ...] = ()
    """(spec, rtol) where a spec's figures differ by more than ``rtol`` for a stated reason."""
    log_expect: str = ""
    """A line rank 0's log must hold."""
    console: bool = False
    """The row's job prints what the README's quick start says (``console_problem``): rank 0's lines only (under PP
    the step lines from the last stage's first rank), ``step: N/TOTAL ... left: H:MM:SS``, no colour codes in a
    file, no MFU on the CPU."""
    seed_in_folder: tuple[str, ...] = ()
    """Specs whose job starts as torchtitan documents it: a seed checkpoint created by one process in the job's
    own dump folder (``--checkpoint.create_seed_checkpoint``), then loaded by the job as its ``step-0``
    (model only), rather than through ``--checkpoint.initial_load_path``."""

    opt_in: bool = False
    """Not part of the CI matrix (``ALL_ROWS``): run by name (``--rows``), e.g. rows of 8 ranks
    (``bench/compose_8ranks.py``)."""

    validation: bool = False
    """The row validates (``VALIDATION``) and its validation losses must match the single-process run's.
    Not for compiled rows: a no_grad forward recompiles the blocks (dynamo guards the grad mode), once per
    job, and the matrix runs compiled jobs under ``error_on_recompile``."""

    steps: int = STEPS
    """Steps the row trains and compares with the single-process run's first as many (kind ``train``, no
    validation): fewer where each step is slow (Triton's interpreter)."""

    def tolerance(self, spec: str) -> float:
        return dict(self.spec_rtol).get(spec, self.rtol)



AC = ("--activation_checkpoint.mode",)
EP2 = ("--parallelism.expert_parallel_degree", "2")
# Llama's CP=2 grad norms equal those of FSDP2 without CP to every logged digit (1.45391357 at step 1).
# Their gap to one process (1.0e-5 on 2 ranks, 1.5e-5 on 4) is FSDP's, not CP's: torch's total norm over
# FSDP's DTensor shards (torch.nn.utils.get_total_norm) differs from the same gradients' plain norm by
# ~4e-6 (the gradients themselves agree to 2e-7; DDP2's grad norms equal one process's bit for bit), and
# the clip at max_norm 1.0 carries it into every update. In fp64 CP equals one process to 1e-15
# (tests/test_context_parallel.py).
CP_ATTENTION_RTOL = (("hf_llama", 2e-5), ("fla_transformer", 2e-5), ("hf_mistral_window", 2e-5), ("hf_qwen2_moe", 2e-5))
# Gated DeltaNet's gate gradients (A_log, dt_bias, a_proj) carry fp32 noise of ~1e-5 in the kernel itself
# (its one-pass and per-document paths each differ from fp64 by 7e-6); head-tail pieces of packed documents
# reorder them so that five AdamW steps move the loss by up to 4.8e-5. In fp64 the exchange is exact to
# 1e-14 (tests/test_context_parallel.py).
# GLA's compiled, fully checkpointed CP row with documents: on this session's CPU (2026-11-29) its grad norm
# differed by 1.05e-5 from one process at main's HEAD before this change too (the same figures to every digit);
# on earlier machines under 1e-5. Reduction order in fp32, not a path: its cp2 and cp2_tp2_docs rows hold 1e-5.
CP_DOCS_RTOL = (*CP_ATTENTION_RTOL, ("fla_gated_deltanet", 1e-4), ("hf_qwen3_5", 3e-5), ("fla_gla", 2e-5),
                ("hf_minimax", 2e-5))  # (see CP_RTOL below)
# Qwen3.5 and Qwen3-Next: CP2 differs from one process by 8.5e-6 and 9.3e-6 (6.8e-6 with documents), exactly as
# much as FSDP2 without CP does (the grad norm over FSDP's DTensor shards, see above; their RMSNorms compute in
# fp32); a margin over TP_RTOL. In fp64 the exchange is exact to 1e-12 but for those norms
# (tests/test_context_parallel.py, ``hf_qwen3_5``).
# KDA's gate gradients (A_log, dt_bias) carry fp32 noise as Gated DeltaNet's do (above): from the seed every
# initializer now sets, step 5's grad norm under cp2 differs by 2.1e-5 (2026-11-29).
# MiniMax (lightning attention, MoE FFNs): its cp2 and tp2 grad norms differ from one process by 9.4e-6, cp2_docs's
# (compiled, full AC) by 1.1e-5, their losses by 1e-7 and their routing not at all (2026-11-29): the norm over
# FSDP's DTensor shards again; in fp64 its forward equals transformers' to 1e-9 (tests/test_lightning.py) and the
# scalar decay's state passing one pass to 1e-10 (tests/test_state_passing.py).
CP_RTOL = (*CP_ATTENTION_RTOL, ("hf_qwen3_5", 3e-5), ("hf_qwen3_next", 3e-5), ("fla_kda", 3e-5), ("hf_minimax", 2e-5))
# Tied specs under TP (and under PP with FSDP or TP): the one vocab-sharded weight carries the embedding's and
# the head's gradients, the largest of the model, and torch's total norm over its DTensor shards rounds
# differently from the plain norm of the same gradient (as FSDP's does: hf_llama's fsdp2 row differs from one
# process by the same 1.0e-5; its pp2_fsdp2 and pp2_tp2 grad norms by 1.05e-5, their losses by 1.3e-7).
# The gradients themselves agree to 1e-5 (tests/test_hf_tp_plan.py, tied cases).
TIED_DTENSOR_RTOL = (("hf_llama", 2e-5), ("hf_qwen3", 2e-5))
NAN = ("--experimental.custom_import", "nan_injection", "--model.name", "fla_gla_nan")
PP_SPECS = ("fla_gla", "hf_llama", "fla_transformer")
CHUNKED = ("--titan_ext.loss", "chunked", "--titan_ext.loss_chunk_tokens", "48")
"""The chunked loss, 48 tokens a chunk: a batch of 2 x 80 tokens runs 4 chunks (the last one shorter)."""
README_COMMAND = "{readme}"
"""Stands for the extension example's command-line arguments (docs/extending.md)."""
ROWS = {
    "single": Row(1, parallel(), validation=True),
    "fsdp2": Row(2, parallel(shard=2), validation=True, seed_in_folder=("fla_gla",), console=True),
    "ddp2": Row(2, parallel(replicate=2)),
    "tp2": Row(2, parallel(tp=2), rtol=TP_RTOL, validation=True, cost=4,  # sequence parallel and loss parallel on (the defaults)
               spec_rtol=TIED_DTENSOR_RTOL),
    "hsdp2x2": Row(4, parallel(shard=2, replicate=2), specs=("fla_gla",),  # apply_fsdp's 2D mesh: any model
                   seed_in_folder=("fla_gla",)),
    "fsdp2_tp2": Row(
        4,
        (*parallel(shard=2, tp=2), "--parallelism.disable_loss_parallel", "--titan_ext.disable_sequence_parallel"),
        # 2D sums over 4 ranks reorder fp32 reductions further: grad norms differ by up to ~1.1e-5.
        specs=("fla_gla", "hf_llama"),  # the fla transformer's TP plan: its tp2 and cp2_tp2 rows
    ),
    "ac_full": Row(1, (*parallel(), *AC, "full")),
    # expert parallelism: 4 experts per rank, tokens all-to-all'd to them and back
    # (titan_ext.parallel.expert_parallel.apply_ep)
    "ep2_hf": Row(2, (*parallel(shard=2), *EP2), kind="hf", cost=2, specs=("hf_qwen3_moe",)),
    # EP x PP x FSDP: the stages carry their routers' statistics to the balancing loss on the last stage
    "ep2_pp2": Row(4, (*parallel(shard=2, pp=2), *EP2), specs=("hf_qwen3_moe",)),
    # EP x PP x TP with sequence parallel: each TP rank sends its shard of the hidden states and the whole sequences'
    # router statistics (folded into its shard's tokens' channels) to the balancing loss on the last stage
    "ep2_pp2_tp2": Row(4, (*parallel(tp=2, pp=2), *EP2), rtol=TP_RTOL, validation=True, specs=("hf_qwen3_moe",)),
    # EP x TP (torchtitan's ETP=1): the EP mesh spans the TP ranks, each dispatching its share of the tokens
    # (2D sums over 4 ranks: grad norms differ from one process by ~1e-5, as fsdp2_tp2's do)
    "ep2_tp2_fsdp2": Row(4, (*parallel(shard=2, tp=2), *EP2), validation=True, specs=("hf_kimi_linear",)),
    # EP with HSDP: the experts sharded over efsdp and replicated over dp_replicate, the rest over both dims
    "ep2_hsdp2x2": Row(4, (*parallel(shard=2, replicate=2), *EP2), validation=True, specs=("hf_moe_bias",)),
    # torchtitan's ETP=TP: experts split over the EP ranks (the data-parallel ones) and each expert's intermediate
    # dim over the TP ranks, every TP rank dispatching all its tokens over its EP group
    "ep2_tp2_etp2": Row(4, (*parallel(shard=2, tp=2), *EP2, "--parallelism.expert_tensor_parallel_degree", "2"),
                        specs=("hf_qwen3_moe",)),
    # EP beyond the TP ranks (EP4 x TP2 on 4 ranks: the expert mesh spans both TP pairs, 2 experts per rank);
    # opt-in: the CI's EP x TP row covers the same code with EP = TP
    "ep4_tp2": Row(4, (*parallel(shard=2, tp=2), "--parallelism.expert_parallel_degree", "4"), opt_in=True,
                   specs=("hf_qwen3_moe",)),
    # EP with document masking: EP over the TP ranks (which share one batch: the single process's documents)
    "ep2_tp2_docs": Row(2, (*parallel(tp=2), *EP2), rtol=TP_RTOL, documents=True, specs=("hf_qwen3_moe",)),
    # EP x TP on 2 ranks: Qwen3-Next's TP (its shared expert a dense FFN inside the MoE block, the routed experts
    # split by EP over the TP ranks)
    # (its grad norms differ from one process by 8.9e-6, as its cp2 row's do: CP_RTOL)
    "ep2_tp2": Row(2, (*parallel(tp=2), *EP2), rtol=TP_RTOL, specs=("hf_qwen3_next", "hf_qwen2_moe", "hf_moe_bias"),
                   spec_rtol=CP_RTOL),
    # EP x CP: the EP mesh spans the CP ranks (torchtitan's ep within dp_shard x cp), each dispatching the tokens of
    # its own sequence pieces (routing is per token)
    "ep2_cp2": Row(2, (*parallel(cp=2), *EP2), rtol=TP_RTOL, specs=("hf_qwen3_next", "hf_kimi_linear", "hf_qwen3_moe"),
                   spec_rtol=CP_RTOL),
    "ep2_resume": Row(2, (*parallel(shard=2), *EP2), kind="resume", cost=4, specs=("hf_qwen3_moe",)),
    # TP without EP: HF export and import of the experts split over TP (the packed gate_up_proj whole in the file)
    "tp2_hf": Row(2, parallel(tp=2), kind="hf", rtol=TP_RTOL, specs=("hf_qwen3_moe",)),
    # a hub folder as transformers' save_pretrained writes it (sharded, one tensor per expert), imported under
    # FSDP2, TP2 and EP2 x FSDP2: step 1's loss equals transformers' own forward's on the same batch, and the job's
    # export (one step at learning rate 0) holds the folder's tensors under its names (``evaluate_hub``)
    "hub_fsdp2": Row(2, parallel(shard=2), kind="hub", rtol=TP_RTOL, specs=("hf_llama",)),
    "hub_tp2": Row(2, parallel(tp=2), kind="hub", rtol=TP_RTOL, specs=("hf_llama",)),
    "hub_ep2": Row(2, (*parallel(shard=2), *EP2), kind="hub", rtol=TP_RTOL, specs=()),
    # docs/checkpoints-and-hf.md's continued pretraining from a hub checkpoint, its 8-GPU command read from the page
    # and run on 2 ranks (``tests/walkthrough.py``: FSDP 2, or EP 2 x FSDP 2), from the spec's hub folder
    # (``WALKTHROUGH``): step 1's loss equals transformers' forward, 2 steps train, the export loads
    # (``evaluate_walkthrough``)
    "walkthrough": Row(2, (), kind="walkthrough", rtol=TP_RTOL, cost=3, specs=()),
    "ac_selective_layer": Row(1, (*parallel(), *AC, "selective", "--activation_checkpoint.selective_ac_option", "1")),
    "ac_selective_op": Row(1, (*parallel(), *AC, "selective", "--activation_checkpoint.selective_ac_option", "op")),
    # Each block compiled: aot_eager checks the graphs, inductor the generated code too (~15-65 s cold per spec).
    # titan_ext's three specs compile with inductor here and with aot_eager in ac_op_compile, cp2_docs and
    # chunked_fsdp2 or cp2_ac_compile: compile_aot_eager is the MoE spec's (whose only compiled row it is).
    "compile_aot_eager": Row(1, (*parallel(), "--compile.enable", "--compile.backend", "aot_eager"), cost=6,
                             specs=("hf_qwen3_moe",)),
    "compile_inductor": Row(1, (*parallel(), "--compile.enable", "--compile.backend", "inductor"), cost=9),
    "ac_op_compile": Row(1, (*parallel(), *AC, "selective", "--activation_checkpoint.selective_ac_option", "op",
                             "--compile.enable", "--compile.backend", "aot_eager"), cost=5),
    "resume": Row(2, parallel(shard=2), kind="resume", cost=4),
    "hf": Row(1, parallel(), kind="hf", cost=2),
    # The README's extension example as written (tests/readme_example.py): a user's model type and TP plan
    # from custom_import, trained TP2 through --model.name fla; its architecture is fla_gla's debugmodel.
    "readme_ext": Row(2, (README_COMMAND,), rtol=TP_RTOL, specs=("fla_gla",), cost=6,
                      log_expect="Applied MyGLATPPlan (registered by my_gla, for model_type 'my_gla')"),
    "float8_emulate": Row(1, (*parallel(), "--model.converters", "quantize.linear.float8",
                              "--quantize.linear.float8.emulate"), kind="trains", specs=("fla_gla",)),
    # titan_ext_stream over parquet shards with a shuffle buffer and document masking: a resumed run replays
    # the same batches (positions included).
    "stream_resume": Row(2, (*parallel(shard=2), "--training.dataset", "titan_ext_stream", "--training.dataset_path",
                             "{shards}", "--titan_ext.shuffle_buffer", "16", "--titan_ext.document_mask"),
                         kind="stream_resume", cost=4, specs=("fla_gla",)),
    # Sequences split across ranks, GLA's states exchanged (titan_ext.parallel.context_parallel): torchtitan's
    # head-tail pieces (2 per rank), contiguous pieces, and CP with FSDP and with TP.
    "cp2": Row(2, parallel(cp=2), rtol=TP_RTOL, specs=("fla_gla", "fla_transformer", "hf_llama"), spec_rtol=CP_RTOL,
               validation=True),
    # (contiguous attention pieces are checked in fp64 on two ranks: tests/test_context_parallel.py)
    "cp2_contiguous": Row(2, (*parallel(cp=2), "--parallelism.context_parallel_load_balancer", "None"),
                          rtol=TP_RTOL, specs=("fla_gla",)),
    "cp2_fsdp2": Row(4, (*parallel(shard=2, cp=2), "--parallelism.context_parallel_rotate_method", "alltoall"),
                     rtol=TP_RTOL, specs=("fla_gla", "hf_llama"), spec_rtol=CP_ATTENTION_RTOL),
    "cp2_tp2": Row(4, parallel(tp=2, cp=2), rtol=TP_RTOL, specs=("fla_gla", "fla_transformer", "hf_llama"), spec_rtol=CP_ATTENTION_RTOL),
    "cp2_short_conv": Row(2, parallel(cp=2), rtol=TP_RTOL, specs=("fla_gla",), short_conv=True),
    "cp2_ac_compile": Row(2, (*parallel(cp=2), *AC, "full", "--compile.enable", "--compile.backend", "aot_eager"),
                          rtol=TP_RTOL, cost=6, specs=("fla_gla", "hf_llama"), spec_rtol=CP_ATTENTION_RTOL),
    # ... with document masking: states, halos, rotary positions and attention restart at every document start
    # on whichever rank it falls; compiled, with full AC (for the attention specs the compiled CP row),
    # against one process that masks too.
    "cp2_tp2_docs": Row(4, parallel(tp=2, cp=2), rtol=TP_RTOL, documents=True, specs=("fla_gla",), validation=True),
    "cp2_docs": Row(2, (*parallel(cp=2), *AC, "full", "--compile.enable", "--compile.backend", "aot_eager"),
                    rtol=TP_RTOL, cost=5, documents=True, spec_rtol=CP_DOCS_RTOL,
                    specs=("fla_gla", "fla_transformer", "hf_llama")),
    # Pipeline parallelism (titan_ext.parallel.pipeline): 1F1B, Interleaved1F1B with 2 stages per rank, and PP x FSDP.
    "pp2": Row(2, parallel(pp=2), rtol=TP_RTOL, specs=PP_SPECS, console=True),
    "pp2_interleaved": Row(2, (*parallel(pp=2), "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"),
                           rtol=TP_RTOL, specs=PP_SPECS),
    "pp2_fsdp2": Row(4, parallel(shard=2, pp=2), rtol=TP_RTOL, specs=PP_SPECS, spec_rtol=TIED_DTENSOR_RTOL),
    "pp2_tp2": Row(4, parallel(tp=2, pp=2), rtol=TP_RTOL, specs=PP_SPECS, validation=True,  # SP and loss parallel on
                   spec_rtol=TIED_DTENSOR_RTOL),
    # the remaining schedules torchtitan offers, on GLA; a V (rank 0 runs the first and the last stage: the tied
    # Llama's two copies of its weight on one rank) on Llama too
    **{f"pp2_{name.lower()}": Row(2, (*parallel(pp=2), "--parallelism.pipeline_parallel_schedule", name),
                                  rtol=TP_RTOL, specs=("fla_gla", "hf_llama") if name == "ZBVZeroBubble" else ("fla_gla",))
       for name in ("GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")},
    # DualPipeV needs a microbatch per stage (4): a batch of 4, so it trains on other data than the reference.
    "pp2_dualpipev": Row(2, (*parallel(pp=2), "--parallelism.pipeline_parallel_schedule", "DualPipeV",
                             "--training.local_batch_size", "4",
                             "--parallelism.no-pipeline_parallel_expert_parallel_overlap"), kind="trains",
                         specs=("fla_gla", "hf_llama")),
    # gradient accumulation: 2 batches per optimizer step, against one process accumulating the same 2
    "pp2_accum2": Row(2, parallel(pp=2), rtol=TP_RTOL, specs=("fla_gla", "hf_llama"), accumulate=True),
    # ... with context parallelism (each stage's mixers pass states, or keys and values, across the CP ranks),
    # and with document masking: each micro-batch's boundaries reach every stage (torchtitan's extra kwargs),
    # also where full AC recomputes a block in its backward after later micro-batches' forwards (Interleaved1F1B)
    "pp2_cp2": Row(4, parallel(cp=2, pp=2), rtol=TP_RTOL, specs=("fla_gla", "hf_llama"), spec_rtol=CP_ATTENTION_RTOL),
    "pp2_docs": Row(2, parallel(pp=2), rtol=TP_RTOL, documents=True, specs=("fla_gla", "hf_llama")),
    "pp2_cp2_docs": Row(4, (*parallel(cp=2, pp=2), *AC, "full", "--parallelism.pipeline_parallel_schedule",
                            "Interleaved1F1B"), rtol=TP_RTOL, documents=True, validation=True,
                        specs=("fla_gla", "hf_llama", "fla_transformer"), spec_rtol=CP_DOCS_RTOL),
    # Outside CI (8 ranks; bench/compose_8ranks.py): TP2 x PP2 x CP2 with document masking, and FSDP2 x PP2 x CP2.
    "pp2_tp2_cp2_docs": Row(8, parallel(tp=2, cp=2, pp=2), rtol=TP_RTOL, documents=True, validation=True,
                            specs=("fla_gla",), opt_in=True),
    "pp2_fsdp2_cp2": Row(8, parallel(shard=2, cp=2, pp=2), rtol=TP_RTOL, specs=("fla_gla",), opt_in=True),
    # checkpoints under PP: the tied Llama's weight is one key, written by both stages, read by one process and back
    "pp2_resume": Row(2, parallel(pp=2), kind="resume", cost=2, specs=("fla_gla", "hf_llama")),
    "pp2_hf": Row(2, parallel(pp=2), kind="hf", cost=2, specs=("fla_gla", "hf_llama")),
    "pp2_resume_pp1": Row(2, parallel(pp=2), kind="resume_pp1", specs=("fla_gla", "hf_llama")),
    "pp2_resume_from_pp1": Row(2, parallel(pp=2), kind="resume_from_pp1", specs=("fla_gla", "hf_llama")),
    # fla's own Triton kernels (the GPU code path) under Triton's interpreter, TP2 with sequence and loss parallel,
    # against one process on titan_ext's portable kernels ("single"); GLA. Gated DeltaNet's torch op under TP2 is
    # tests/interpret_checks.py's tp case in CI (a 1-layer model; this row on its spec took 76 s on 2 cores).
    # Two steps: the kernels' forward and backward at the seed's weights and after one update (~10 s a step).
    "interpret_tp2": Row(2, (*parallel(tp=2), "--titan_ext.kernels", "fla"), rtol=TP_RTOL,
                         specs=("fla_gla",), cost=12,
                         steps=2),
    # ... and CP2 (state passing around titan_ext::chunk_gated_delta_rule_fwd), opt-in: 148 s on 2 cores (2026-11-29);
    # tests/interpret_checks.py's cp case checks the same path in CI on a 1-layer model
    "interpret_cp2": Row(2, (*parallel(cp=2), "--titan_ext.kernels", "fla"), rtol=TP_RTOL,
                         specs=("fla_gated_deltanet",), spec_rtol=CP_RTOL, cost=12, steps=2, opt_in=True),
    # Packed windows as separate documents (fla: cu_seqlens, Llama: position_ids) under TP2, against one process.
    "docs_tp2": Row(2, parallel(tp=2), rtol=TP_RTOL, documents=True, validation=True, cost=3),
    # The chunked loss (titan_ext.loss), against one process on torchtitan's loss: FSDP2 with compiled blocks
    # (GLA's untied head is a group of its own, resharded after forward; Llama's tied head is the root's), TP2
    # with sequence and loss parallel and document masking (Llama's vocab-sharded tied weight), PP2 with gradient
    # accumulation (the last stage's tied copy).
    "chunked_fsdp2": Row(2, (*parallel(shard=2), *CHUNKED, "--parallelism.fsdp_reshard_after_forward", "always",
                             "--compile.enable", "--compile.backend", "aot_eager"),
                         specs=("fla_gla", "hf_llama"), spec_rtol=TIED_DTENSOR_RTOL, cost=4),
    "chunked_tp2_docs": Row(2, (*parallel(tp=2), *CHUNKED), rtol=TP_RTOL, documents=True, validation=True,
                            specs=("hf_llama",), spec_rtol=TIED_DTENSOR_RTOL, cost=3),
    "chunked_pp2_accum2": Row(2, (*parallel(pp=2), *CHUNKED), rtol=TP_RTOL, accumulate=True, specs=("hf_llama",)),
    # opt-in (4 ranks): the last stage's vocab-sharded tied head under PP2 x TP2
    "chunked_pp2_tp2": Row(4, (*parallel(tp=2, pp=2), *CHUNKED), rtol=TP_RTOL, specs=("hf_llama",),
                           spec_rtol=TIED_DTENSOR_RTOL, opt_in=True),
    "nan_skip": Row(2, (*parallel(shard=2), *NAN, "--titan_ext.nonfinite_loss", "skip"), kind="nan_skip",
                    specs=("fla_gla",), env=(("NAN_AT_STEP", "3"),)),
    "nan_stop": Row(2, (*parallel(shard=2), *NAN, "--checkpoint.interval", "1"), kind="fails", specs=("fla_gla",),
                    env=(("NAN_AT_STEP", "3"),), expect="non-finite loss (NaN or Inf) at step 3: stopped before its update"),
}


MIXER_SPECS = {
    "gla": ("fla", "gla", "fla_gla"),
    "gated deltanet": ("fla", "gated_deltanet", "fla_gated_deltanet"),
    "kda": ("fla", "kda", "fla_kda"),
    "fla attention": ("fla", "transformer", "fla_transformer"),
    "transformers attention": ("transformers", "llama", "hf_llama"),
    "transformers mla": ("transformers", "deepseek_v3", "hf_deepseek_v3"),
    "transformers' gated deltanet": ("transformers", "qwen3_5_text", "hf_qwen3_5"),
    "transformers' kda": ("transformers", "kimi_linear", "hf_kimi_linear"),
    "transformers' mamba2": ("transformers", "nemotron_h", "hf_nemotron_h"),
    "transformers' short convolution": ("transformers", "lfm2", "hf_lfm2"),
    "transformers' lightning attention": ("transformers", "minimax", "hf_minimax"),
    "fla mamba2": ("fla", "mamba2", "fla_mamba2"),
}
"""One model per mixer kind (as the census names it) whose matrix rows stand for that kind's multi-rank columns in
docs/models.md: (library, census model type, matrix spec). The census reads it (``mixer_runs``); a mixer kind
not here has plan-time checks only."""

RUN_COLUMNS = {
    "FSDP2": "--parallelism.data_parallel_shard_degree",
    "TP": "--parallelism.tensor_parallel_degree",
    "CP": "--parallelism.context_parallel_degree",
    "PP": "--parallelism.pipeline_parallel_degree",
    "EP": "--parallelism.expert_parallel_degree",
}
"""The census's multi-rank columns and the degree each stands for."""


def _degrees(flags: tuple[str, ...]) -> dict[str, int]:
    """The parallel degrees above 1 a row's flags set (the last value of a repeated flag wins, as argparse's)."""
    given = dict(zip(flags[::2], flags[1::2]))
    return {column: int(given[flag]) for column, flag in RUN_COLUMNS.items()
            if given.get(flag, "1").isdigit() and int(given.get(flag, "1")) > 1}


def mixer_runs() -> dict[str, dict[str, str]]:
    """For each mixer kind of ``MIXER_SPECS``, each of its model's multi-rank columns (and ``documents``) -> the
    matrix row (``spec/row``) that trains it equal to one process, the plainest (fewest other parallelisms, no
    documents unless they are the column, fewest flags); a column no row of that spec runs is left out."""
    runs = {}
    for mixer, (_, _, spec) in MIXER_SPECS.items():
        rows = sorted((len(_degrees(r.flags)), r.documents, len(r.flags), name) for name, r in ROWS.items()
                      if r.kind in ("train", "resume", "hf") and applies(spec, name))
        found = {}
        for *_, name in rows:
            for column in (*_degrees(ROWS[name].flags), *(("documents",) if ROWS[name].documents else ())):
                found.setdefault(column, f"{spec}/{name}")
        runs[mixer] = found
    return runs


_unknown = {f"{spec}/{row}" for spec, s in SPECS.items() for row in s.rows or () if row not in ROWS}
_unknown |= {f"{row}/{spec}" for row, r in ROWS.items() for spec in r.specs or () if spec not in SPECS}
assert not _unknown, f"the matrix names rows or specs it does not define (a row would silently not run): {_unknown}"


def applies(spec: str, row: str) -> bool:
    """Whether ``row`` is part of the matrix for ``spec``."""
    if SPECS[spec].rows is not None:
        return row in SPECS[spec].rows
    specs = ROWS[row].specs if row in ROWS else None
    return specs is None or spec in specs


def _release(package: str) -> tuple[int, int]:
    return tuple(int(n) for n in version(package).split(".")[:2])


def _tensor_parallel(flags: tuple[str, ...]) -> bool:
    degrees = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--parallelism.tensor_parallel_degree"]
    return bool(degrees) and int(degrees[-1]) > 1


UNSUPPORTED = {
    "float8_tp2": "gloo cannot all-gather float8 tensors (RuntimeError: Invalid scalar type); needs NCCL",
    "async_tp2": "needs CUDA symmetric memory (torchtitan 0.2.2 also never enables it for the TP group)",
}
TENSOR_PARALLEL_ROWS = tuple(row for row, r in ROWS.items() if _tensor_parallel(r.flags))
SOFTMAX_TOP_K_ROUTED = ("hf_qwen3_moe", "hf_qwen3_next", "hf_qwen2_moe", "hf_moe_bias")
"""The specs behind transformers' softmax top-k routers (``titan_ext.parallel.moe_plan._softmax_top_k``)."""
UNSUPPORTED_PAIRS: dict[tuple[str, str], str] = {}
"""Rows unsupported for some specs only: (spec, row) -> why."""
if _release("triton") < (3, 9):  # titan_ext refuses it in one line
    UNSUPPORTED |= dict.fromkeys(("interpret_tp2", "interpret_cp2"), "Triton's interpreter runs fla's kernels from triton 3.9")
if _release("torch") < (2, 13):  # titan_ext refuses these in one line
    UNSUPPORTED |= dict.fromkeys(("pp2_zbvzerobubble", "pp2_dualpipev"),
                                 "V-shaped schedules on gloo need torch 2.13 (earlier ones send to their own rank)")
    UNSUPPORTED_PAIRS |= {(spec, row): "experts under TP behind a softmax top-k router need torch 2.13 (torch 2.11's "
                          "DTensor cannot backpropagate top-k values)"
                          for spec in SOFTMAX_TOP_K_ROUTED for row in TENSOR_PARALLEL_ROWS}
if _release("transformers") < (5, 21):  # titan_ext refuses TP in one line, naming the plan to register
    UNSUPPORTED_PAIRS |= {("hf_qwen2_moe", row): "transformers' Qwen2-MoE plan places no experts before 5.21 (5.17 "
                          "and 5.20.2 checked)" for row in TENSOR_PARALLEL_ROWS}
if _release("transformers") < (5, 24):
    UNSUPPORTED_PAIRS[("hf_qwen3_moe", "compile_aot_eager")] = (
        "transformers 5.17 (checked; 5.24 not) compiles its _can_use_grouped_mm once per expert weight shape: the "
        "job trains, with one recompile, which this row refuses")


@dataclass(frozen=True)
class Job:
    id: str
    world: int
    argv: tuple[str, ...]
    env: dict


@dataclass
class Result:
    spec: str
    row: str
    status: str  # ok, MISMATCH, ERROR, unsupported
    max_rel: float | None = None
    detail: str = ""
    seconds: float | None = None
    """The row's jobs' time (rank 0's, summed; not its seed's or reference's): what the row costs the matrix."""


@dataclass(frozen=True)
class Guest:
    """Jobs of another test file run inside the matrix's launch, so that their processes' start-up is paid once
    (``tests/conftest.py``, ``guest_runs``): units of (world, cost, jobs), and modules its jobs need imported."""

    units: tuple[tuple[int, int, tuple[Job, ...]], ...]
    preload: tuple[str, ...] = ()


@dataclass
class Matrix:
    """The jobs of a selection of specs x rows, laid out under ``root``, and the guests' jobs."""

    root: Path
    specs: list[str]
    rows: list[str]
    guests: dict[str, Guest] = field(default_factory=dict)

    def applies(self, spec: str, row: str) -> bool:
        return applies(spec, row) and (spec, row) not in UNSUPPORTED_PAIRS

    def variant(self, spec: str, row: str) -> str:
        """What the row and its single-process reference share: "base", or its tags ("docs", "conv", "accum")."""
        r = ROWS[row]
        tags = ["docs"] * r.documents + ["conv"] * r.short_conv
        tags += ["accum"] * r.accumulate
        return "+".join(tags) or "base"

    def variant_flags(self, spec: str, variant: str) -> tuple[str, ...]:
        spec_def = SPECS[spec]
        flags = ("--job.config_file", str(CONFIGS / spec_def.config), "--training.dataset_path", str(self.corpus),
                 *spec_def.flags)
        if spec_def.hf_config:
            flags += ("--titan_ext.hf_config", str(self.root / spec / "config.json"))
        tags = variant.split("+")
        if "docs" in tags:
            flags += ("--titan_ext.document_mask",)
        if "conv" in tags:
            flags += ("--titan_ext.hf_config", str(self.root / "short_conv.json"))
        if "accum" in tags:
            flags += ACCUMULATE
        return flags

    @property
    def corpus(self) -> Path:
        return self.root / "corpus.jsonl"

    @property
    def shards(self) -> Path:
        """The corpus as 4 parquet shards, for ``titan_ext_stream``."""
        return self.root / "shards"

    def job(self, spec: str, variant: str, name: str, world: int, *flags: str, folder: str = "", env=()) -> Job:
        """A job named ``name`` training in ``folder`` (default: its own, named after it)."""
        id_ = f"{spec}.{variant}.{name}"
        folder = self.root / spec / variant / (folder or name)
        argv = (
            *self.variant_flags(spec, variant), *COMMON,
            "--job.dump_folder", str(folder), "--titan_ext.metrics_jsonl", str(self.metrics_path(id_)), *flags,
        )
        return Job(id_, world, argv, dict(env))

    def folder(self, spec: str, row: str) -> Path:
        return self.root / spec / self.variant(spec, row) / row

    def metrics_path(self, job_id: str) -> Path:
        return self.root / "metrics" / f"{job_id}.jsonl"

    def seed(self, spec: str, variant: str, row: str = "") -> Job:
        """The variant's seed checkpoint, or (``row``) the same one in that row's own dump folder."""
        return self.job(spec, variant, f"{row}@seed" if row else "seed", 1, *parallel(), "--training.steps", "1",
                        "--debug.seed", "0", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
                        folder=row)

    def seeds(self) -> list[Job]:
        """Every seed checkpoint: one per variant, and one per row that starts from its own dump folder."""
        rows = [(spec, row) for spec in self.specs for row in self.rows
                if self.applies(spec, row) and spec in ROWS[row].seed_in_folder]
        return [*(self.seed(*variant) for variant in self.variants()),
                *(self.seed(spec, self.variant(spec, row), row) for spec, row in rows)]

    def seed_path(self, spec: str, variant: str) -> Path:
        return self.root / spec / variant / "seed" / "checkpoint" / "step-0"

    def from_seed(self, spec: str, variant: str) -> tuple[str, ...]:
        return ("--checkpoint.enable", "--checkpoint.initial_load_path", str(self.seed_path(spec, variant)),
                "--checkpoint.interval", "1000")

    def row_jobs(self, spec: str, row: str, variant: str | None = None) -> list[Job]:
        """The jobs of one row, in the order they must run."""
        variant = variant or self.variant(spec, row)
        r = ROWS[row]
        flags = tuple(flag.replace("{shards}", str(self.shards)) for flag in r.flags)
        if README_COMMAND in flags:
            i = flags.index(README_COMMAND)
            flags = (*flags[:i], *self.readme_argv(), *flags[i + 1:])
        if r.validation and spec != "llama3":  # torchtitan's own model keeps torchtitan's validator
            flags = (*flags, *VALIDATION, "--validation.dataset_path", str(self.corpus))
        if r.steps != STEPS:
            flags = (*flags, "--training.steps", str(r.steps))
        train = (*self.from_seed(spec, variant), *flags)
        if spec in r.seed_in_folder:  # the seed is this job's own step-0: no initial_load_path
            train = ("--checkpoint.enable", "--checkpoint.interval", "1000", *flags)
        if r.kind in ("resume_pp1", "resume_from_pp1"):  # a checkpoint resumed at another PP degree
            every2 = (*train, "--checkpoint.interval", "2")
            one = (*self.from_seed(spec, variant), *parallel(), "--checkpoint.interval", "2")
            if r.kind == "resume_pp1":  # the PP job's step-2 checkpoint, resumed by one process
                return [self.job(spec, variant, row, r.world, *every2),
                        self.job(spec, variant, row + "@pp1", 1, *one, "--checkpoint.load_step", "2", folder=row)]
            return [self.job(spec, variant, row + "@pp1", 1, *one, folder=row),  # one process's, resumed under PP
                    self.job(spec, variant, row, r.world, *every2, "--checkpoint.load_step", "2")]
        if r.kind in ("resume", "stream_resume"):
            every2 = (*train, "--checkpoint.interval", "2")
            return [self.job(spec, variant, row, r.world, *every2),
                    self.job(spec, variant, row + "@resumed", r.world, *every2, "--checkpoint.load_step", "2",
                             folder=row)]
        if r.kind == "walkthrough":
            return [self.walkthrough_job(spec, row)]
        if r.kind == "hub":  # import the hub folder (config, shards, tokenizer) as a user does, export it again
            return [self.job(spec, variant, row, r.world, *r.flags, "--model.hf_assets_path", str(self.hub_folder(spec)),
                             "--checkpoint.enable", "--checkpoint.initial_load_in_hf", "--training.steps", "1",
                             "--optimizer.lr", "0", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
                             "--checkpoint.export_dtype", "float32")]
        if r.kind == "hf":
            export = self.job(spec, variant, row + "@export", r.world, *train, "--training.steps", "1",
                              "--optimizer.lr", "0", "--checkpoint.last_save_in_hf",
                              "--checkpoint.last_save_model_only", "--checkpoint.export_dtype", "float32")
            hf_folder = self.hf_export_folder(spec, variant, row)
            return [export, self.job(spec, variant, row, r.world, *r.flags, "--checkpoint.enable",
                                     "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_path",
                                     str(hf_folder), "--checkpoint.load_only")]
        env = (*r.env, ("MATRIX_ALLOW_RECOMPILES", "1")) if SPECS[spec].recompiles else r.env
        # torchtitan saves a full checkpoint at the last step: nothing reads this job's (but nan_stop's)
        no_save = () if r.kind == "fails" else ("--checkpoint.load_only",)
        return [self.job(spec, variant, row, r.world, *train, *no_save, env=env)]

    def walkthrough_job(self, spec: str, row: str) -> Job:
        """The page's training command for the spec's model on 2 CPU ranks (``walkthrough.cpu_argv``), then the
        matrix's corpus and short-run flags, 2 steps in the row's folder, and ``walkthrough.CPU_FLAGS``."""
        id_ = f"{spec}.base.{row}"
        model = walkthrough.model_of(WALKTHROUGH[spec])
        argv = (*walkthrough.cpu_argv(model, self.hub_folder(spec)), "--training.dataset", "titan_ext_tiny",
                "--training.dataset_path", str(self.corpus), *COMMON, "--training.steps", str(WALKTHROUGH_STEPS),
                "--job.dump_folder", str(self.folder(spec, row)), "--titan_ext.metrics_jsonl",
                str(self.metrics_path(id_)), *walkthrough.CPU_FLAGS)
        return Job(id_, ROWS[row].world, argv, {})

    @property
    def readme_folder(self) -> Path:
        return self.root / "readme"

    def readme_argv(self) -> list[str]:
        files, argv = readme_example.example()
        return [str(self.readme_folder / arg) if arg in files else arg for arg in argv]

    def hub_folder(self, spec: str) -> Path:
        """The spec's model as transformers' ``save_pretrained`` writes it, in small shards, with the tokenizer."""
        return self.root / spec / "hub"

    def hub_export_folder(self, spec: str, row: str) -> Path:
        steps = WALKTHROUGH_STEPS if ROWS[row].kind == "walkthrough" else 1
        return self.root / spec / "base" / row / "checkpoint" / f"step-{steps}"

    def hf_export_folder(self, spec: str, variant: str, row: str = "hf") -> Path:
        return self.root / spec / variant / f"{row}@export" / "checkpoint" / "step-1"

    def variants(self) -> list[tuple[str, str]]:
        """(spec, variant) pairs the rows use; each needs a seed and a single-process reference."""
        return sorted({(spec, self.variant(spec, row)) for spec in self.specs for row in self.rows if self.applies(spec, row)})

    def units(self) -> list[tuple[int, int, list[Job], bool]]:
        """(world, cost, jobs, late) per row, plus the references not among the rows; ``late`` units run
        after all others (a ``resume_pp1`` row's single-process resume needs its PP job's checkpoint)."""
        units = []
        for spec in self.specs:
            for row in self.rows:
                if not self.applies(spec, row):
                    continue
                r, jobs = ROWS[row], self.row_jobs(spec, row)
                if r.kind == "resume_pp1":  # the PP job, then (after every multi-rank phase) one process
                    units += [(r.world, r.cost, jobs[:1], False), (1, 1, jobs[1:], True)]
                elif r.kind == "resume_from_pp1":  # one process first (the 1-rank phase), then the PP job
                    units += [(1, 1, jobs[:1], False), (r.world, r.cost, jobs[1:], False)]
                else:
                    units.append((r.world, r.cost, jobs, False))
        for spec, variant in self.variants():
            if variant != "base" or "single" not in self.rows:
                units.append((1, 1, self.row_jobs(spec, "single", variant), False))
        guests = [(world, cost, list(jobs), False) for g in self.guests.values() for world, cost, jobs in g.units]
        return units + guests

    def plan(self, nproc: int) -> dict:
        units = self.units()
        phases = [phase(nproc, 1, [(1, [seed]) for seed in self.seeds()])]
        for late in (False, True):
            for world in sorted({unit[0] for unit in units}):
                work = [(cost, jobs) for w, cost, jobs, is_late in units if w == world and is_late == late]
                if work:
                    phases.append(phase(nproc, world, work))
        # Preload what every job imports (not titan_ext: each job's Trainer must import it to set up the job).
        preload = ["fla.models", "transformers", "torchao.float8", *(m for g in self.guests.values() for m in g.preload)]
        return {"name": self.root.name, "root": str(self.root), "preload": preload, "phases": phases}

    def write_inputs(self) -> None:
        for sub in ("metrics", "results", "logs"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        (self.root / "short_conv.json").write_text(json.dumps({"use_short_conv": True}))
        block = [line for line in CORPUS.read_text().splitlines() if line.strip()][:CORPUS_BLOCK]
        self.corpus.write_text("\n".join(block * MAX_DP) + "\n")
        if any(ROWS[row].kind == "stream_resume" for row in self.rows if row in ROWS):
            import pyarrow as pa
            import pyarrow.parquet as pq

            self.shards.mkdir(exist_ok=True)
            records = [json.loads(line) for line in block * MAX_DP]
            for shard in range(4):
                pq.write_table(pa.Table.from_pylist(records[shard::4]), self.shards / f"part-{shard}.parquet")
        if "readme_ext" in self.rows:
            readme_example.write_example(self.readme_folder)
        for spec in self.specs:
            if SPECS[spec].hf_config:
                (self.root / spec).mkdir(exist_ok=True)
                (self.root / spec / "config.json").write_text(json.dumps(SPECS[spec].hf_config))
            if any(ROWS[row].kind in ("hub", "walkthrough") and self.applies(spec, row) for row in self.rows):
                hub = self.hub_folder(spec)
                write_hub_folder(hub_config(spec), hub, walkthrough_tokenizer_json(spec, hub))


def hub_config(spec: str) -> dict:
    """The spec's architecture as a config.json: its hf_config, its TOML's, or its flavor's."""
    if SPECS[spec].hf_config:
        return SPECS[spec].hf_config
    if spec == "hf_kimi_linear":
        return json.loads((CONFIGS / "kimi_linear_debug.json").read_text())
    from torchtitan.protocols.train_spec import get_train_spec

    import titan_ext  # noqa: F401  (train specs)

    return get_train_spec(spec).model_args["debugmodel"].checkpoint_config().to_dict()


HUB_SHARD = "40KB"
"""save_pretrained's max_shard_size for the hub folders: 10-20 shards and an index for the tiny models."""
HUB_NOISE = 0.1
"""Added to every initialized tensor of a hub folder's model, times a standard normal draw."""


def write_hub_folder(config: dict, folder: Path, tokenizer_json: list[str] | None = None) -> None:
    """A tiny model of ``config`` as the hub ships one: transformers' ``save_pretrained`` (its own initialization,
    one tensor per expert, sharded with an index) and the shipped tokenizer's files; or, given the arguments of
    ``python -m titan_ext.tokenizer_json`` (the walkthrough's for that model), a tokenizer in tiktoken's format as
    Kimi's folders ship it (``tests/tiktoken_folder.py``) and that command's tokenizer.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {key: value for key, value in config.items() if key not in ("model_type", "architectures")}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **fields))
    with torch.no_grad():  # off the initialization's near-uniform logits, so that a misplaced tensor moves the loss
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=HUB_NOISE)
    model.save_pretrained(folder, max_shard_size=HUB_SHARD)
    if tokenizer_json is None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(REPO / "titan_ext" / "assets" / "tiny" / name, folder)
        return
    from titan_ext.tokenizer_json import main

    tiktoken_folder.write_folder(folder, tiktoken_folder.train_ranks(tiktoken_folder.TRAINING_TEXT, HUB_MERGES))
    if main(tokenizer_json) != 0:
        raise RuntimeError(f"python -m titan_ext.tokenizer_json {' '.join(tokenizer_json)} failed (its line above)")


HUB_MERGES = 200
"""At most this many BPE merges in a tiktoken-format hub folder's ranks (its short text yields fewer)."""


def walkthrough_tokenizer_json(spec: str, hub: Path) -> list[str] | None:
    """The page's ``tokenizer_json`` arguments for the spec's hub folder ``hub``, where its walkthrough model has
    one."""
    if spec not in WALKTHROUGH:
        return None
    model = walkthrough.model_of(WALKTHROUGH[spec])
    return walkthrough.tokenizer_json_argv(model, hub) if model.tokenizer_json else None


def phase(nproc: int, world: int, work: list[tuple[int, list[Job]]]) -> dict:
    """``nproc`` processes as lanes of ``world``, and the units of work, longest first: each free lane takes
    the next (``tests/matrix_driver.py``)."""
    return {"lanes": [list(range(i, i + world)) for i in range(0, nproc, world)],
            "units": [[job.__dict__ for job in jobs] for _, jobs in sorted(work, key=lambda w: -w[0])]}


def launch(matrix: Matrix, niceness: int = 0) -> subprocess.Popen:
    """Start the matrix's one torchrun launch (its output: ``driver.log``), its processes at ``niceness``."""
    matrix.write_inputs()
    nproc = max(2, *(ROWS[row].world for row in matrix.rows), *(unit[0] for unit in matrix.units()))
    plan_path = matrix.root / "plan.json"
    plan_path.write_text(json.dumps(matrix.plan(nproc), indent=1, default=str))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(DRIVER), str(plan_path)]
    # this checkout's titan_ext (not an installed copy of another), the drivers, and the extension example's module
    python_path = os.pathsep.join([str(REPO), str(REPO / "tests"), str(matrix.readme_folder)])
    # TRITON_INTERPRET: Triton's interpreter for the jobs that run fla's kernels (--titan_ext.kernels fla; read
    # when fla is imported, so for the whole launch); the others run titan_ext's portable kernels, no Triton.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": python_path,
           "TRITON_INTERPRET": "1"}
    with open(matrix.root / "driver.log", "w") as log:
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=(lambda: os.nice(niceness)) if niceness else None)


def stop(proc: subprocess.Popen) -> None:
    """Stop a launch: torchrun stops its workers on SIGTERM (they run in sessions of their own, so killing
    torchrun alone would leave them running)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- evaluation

STEP_LINE = re.compile(r"step:\s+(\d+)(?:/\d+)?\s+\S*loss:\s+([-\d.naninf]+)\s+\S*grad_norm:\s+([-\d.naninf]+)")


def read_metrics(matrix: Matrix, job: Job) -> list[dict]:
    """Per-step metrics: titan_ext's full-precision JSON lines, or the console log for torchtitan's own models."""
    path = matrix.metrics_path(job.id)
    if path.exists():
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [m for m in lines if "loss_metrics/global_avg_loss" in m]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", job_log(matrix, job))
    return [{"step": int(s), "loss_metrics/global_avg_loss": float(loss), "grad_norm": float(norm)}
            for s, loss, norm in STEP_LINE.findall(plain)]


def read_validation(matrix: Matrix, job: Job) -> dict[int, float]:
    """Each validated step's validation loss."""
    lines = [json.loads(line) for line in matrix.metrics_path(job.id).read_text().splitlines() if line.strip()]
    return {m["step"]: m["validation_metrics/loss"] for m in lines if "validation_metrics/loss" in m}


def compare_validation(run: dict[int, float], ref: dict[int, float], rtol: float) -> tuple[float, str]:
    if sorted(run) != VALIDATED_STEPS or sorted(ref) != VALIDATED_STEPS:
        return math.inf, f"validated steps {sorted(run)} (reference {sorted(ref)}), expected {VALIDATED_STEPS}"
    step, worst = max(((s, abs(run[s] - ref[s]) / max(abs(ref[s]), 1e-30)) for s in VALIDATED_STEPS), key=lambda d: d[1])
    return worst, "" if worst <= rtol else f"validation loss at step {step}: {run[step]!r} vs {ref[step]!r}"


def job_error(matrix: Matrix, job: Job) -> str:
    """'' if every process of the job reported ok, else the first error (or its absence)."""
    for rank in range(job.world):
        path = matrix.root / "results" / f"{job.id}.rank{rank}.json"
        if not path.exists():
            return f"{job.id}: no result from rank {rank} (driver died or timed out; see {matrix.root}/driver.log)"
        result = json.loads(path.read_text())
        if result["status"] != "ok":
            return f"{job.id} rank {rank}: {result['error']} (log: {matrix.root}/logs/{job.id}.rank{rank}.log)"
    return ""


def series(metrics: list[dict]) -> dict[str, list[float]]:
    """Loss and grad norm; for a MoE model its balancing loss (per token) and how unevenly the experts were used
    (max / mean tokens per expert: the counts themselves grow with the data-parallel ranks' duplicate batches)."""
    compared = {"loss": [m["loss_metrics/global_avg_loss"] for m in metrics], "grad_norm": [m["grad_norm"] for m in metrics]}
    if metrics and all("moe/aux_loss" in m for m in metrics):
        compared["moe/aux_loss"] = [m["moe/aux_loss"] for m in metrics]
    if metrics and all("moe/tokens_per_expert_max" in m for m in metrics):
        compared["moe/max_over_mean"] = [m["moe/tokens_per_expert_max"] / m["moe/tokens_per_expert_mean"] for m in metrics]
    return compared


def compare(run: list[dict], ref: list[dict], steps: list[int], rtol: float = RTOL) -> tuple[float, str]:
    """Largest relative difference of loss and grad norm over ``steps``, and what is wrong ('' if nothing)."""
    got, want = [m["step"] for m in run], steps
    if got != want:
        return math.inf, f"logged steps {got}, expected {want}"
    by_step = {m["step"]: m for m in ref}
    if not all(s in by_step for s in steps):
        return math.inf, "the reference run is incomplete"
    diffs = []
    want, got = series([by_step[s] for s in steps]), series(run)
    if missing := sorted(set(want) - set(got)):
        return math.inf, f"no {', '.join(missing)} logged (the reference logs it)"
    for what, values in got.items():
        for step, x, y in zip(steps, values, want.get(what, values)):
            rel = abs(x - y) / max(abs(x), abs(y), 1e-30)
            diffs.append((math.inf if math.isnan(rel) else rel, f"{what} at step {step}: {x!r} vs {y!r}"))
    worst, detail = max(diffs, key=lambda d: d[0])  # the first of the worst
    return worst, detail if worst > rtol else ""


def job_log(matrix: Matrix, job: Job, rank: int = 0) -> str:
    path = matrix.root / "logs" / f"{job.id}.rank{rank}.log"
    return path.read_text() if path.exists() else ""


BEFORE_TITAN_EXT = ("torchtitan version:", "Starting job:")
"""What every rank prints before torchtitan imports titan_ext (``custom_import``)."""


def console_problem(matrix: Matrix, job: Job, steps: int) -> str:
    """'' if the job's console (written to files: not a terminal) is the README's: one rank prints the step
    lines (rank 0; under PP the last stage's first rank), ``step: N/steps`` and, from the second on, the time
    left; no colour codes, no MFU (the CPU has no peak); ranks other than 0 print no other INFO line after
    torchtitan's first two."""
    logs = [job_log(matrix, job, rank) for rank in range(job.world)]
    step_lines = {rank: [line for line in log.splitlines() if " - INFO - step: " in line] for rank, log in enumerate(logs)}
    printing = [rank for rank, lines in step_lines.items() if lines]
    if len(printing) != 1:
        return f"ranks {printing} print step lines: one rank should"
    lines = step_lines[printing[0]]
    wanted = [f"step: {n}/{steps}" for n in range(1, steps + 1)]
    if [line.split(" - INFO - ")[1].split("  ")[0] for line in lines] != wanted:
        return f"rank {printing[0]}'s step lines are not {wanted}: {lines}"
    if not all(re.search(r"  left: \d+:\d\d:\d\d$", line) for line in lines[1:]) or not lines[0].endswith("left: ?"):
        return f"rank {printing[0]}'s step lines do not end in the time left: {lines}"
    if any("\x1b[" in log or "mfu" in log for log in logs):
        return "a rank's log holds colour codes or an MFU figure"
    for rank in range(1, job.world):
        info = [line for line in logs[rank].splitlines() if " - INFO - " in line and " - INFO - step: " not in line
                and not line.split(" - INFO - ")[1].startswith(BEFORE_TITAN_EXT)]
        if info:
            return f"rank {rank} printed INFO lines: {info[:3]}"
    return ""


def evaluate_failure(matrix: Matrix, spec: str, row: str) -> Result:
    """kind "fails": every rank stopped with the expected error, and no checkpoint after the step before it."""
    (job,) = matrix.row_jobs(spec, row)
    expected = ROWS[row].expect
    errors = [job_error(matrix, job)]
    if expected not in errors[0]:
        return Result(spec, row, "MISMATCH", None, f"expected an error with {expected!r}, got {errors[0]!r}")
    saved = sorted(p.name for p in (matrix.folder(spec, row) / "checkpoint").glob("step-*"))
    if saved != ["step-1", "step-2"]:
        return Result(spec, row, "MISMATCH", None, f"checkpoints {saved}, expected step-1 and step-2 only")
    return Result(spec, row, "ok", None, "stopped before step 3's update and checkpoint")


def evaluate(matrix: Matrix, spec: str, row: str) -> Result:
    if not matrix.applies(spec, row):
        return Result(spec, row, "n/a", None, "")
    if ROWS[row].kind == "fails":
        return evaluate_failure(matrix, spec, row)
    if ROWS[row].kind == "hub":
        return evaluate_hub(matrix, spec, row)
    if ROWS[row].kind == "walkthrough":
        return evaluate_walkthrough(matrix, spec, row)
    jobs = matrix.row_jobs(spec, row)
    variant = matrix.variant(spec, row)
    ref_jobs = [matrix.seed(spec, variant), *matrix.row_jobs(spec, "single", variant)]
    own_seed = [matrix.seed(spec, variant, row)] if spec in ROWS[row].seed_in_folder else []
    for job in [*ref_jobs, *own_seed, *jobs]:
        if error := job_error(matrix, job):
            return Result(spec, row, "ERROR", None, error)
    ref = read_metrics(matrix, ref_jobs[-1])
    all_steps = list(range(1, ROWS[row].steps + 1))
    kind = ROWS[row].kind
    checks = []  # (what, max rel, problem)
    if kind == "resume":
        full, resumed = (read_metrics(matrix, job) for job in jobs)
        checks.append(("vs single", *compare(full, ref, all_steps)))
        rel, problem = compare(resumed, full, all_steps[2:])
        checks.append(("resumed vs uninterrupted", 0.0, problem or (f"not bit-identical (rel {rel:.1e})" if rel else "")))
    elif kind in ("resume_pp1", "resume_from_pp1"):  # DCP reshards between the stages and the whole model
        full, resumed = (read_metrics(matrix, job) for job in jobs)  # both kinds list the uninterrupted run first
        checks.append(("vs single", *compare(full, ref, all_steps, TP_RTOL)))
        checks.append(("resumed at another PP degree vs uninterrupted", *compare(resumed, full, all_steps[2:], TP_RTOL)))
    elif kind == "stream_resume":  # other data than the single-process reference: compare with itself
        full, resumed = (read_metrics(matrix, job) for job in jobs)
        losses = series(full)["loss"]
        checks.append(("trains", 0.0, "" if len(losses) == STEPS and losses[-1] < losses[0] else f"losses {losses}"))
        streamed = f"Streaming {matrix.shards} (titan_ext_stream" in job_log(matrix, jobs[0])
        checks.append(("streamed", 0.0, "" if streamed else "the log does not show titan_ext_stream reading the shards"))
        rel, problem = compare(resumed, full, all_steps[2:])
        checks.append(("resumed vs uninterrupted", 0.0, problem or (f"not bit-identical (rel {rel:.1e})" if rel else "")))
    elif kind == "hf":
        export, imported = (read_metrics(matrix, job) for job in jobs)
        checks.append(("HF export step 1 vs single", *compare(export, ref, [1])))
        checks.append(("from HF vs single", *compare(imported, ref, all_steps)))
        checks.append(("export folder", 0.0, hf_folder_problem(matrix.hf_export_folder(spec, variant, row))))
    elif kind == "trains":
        losses = series(read_metrics(matrix, jobs[0]))["loss"]
        fell = len(losses) == STEPS and losses[-1] < losses[0]
        checks.append(("trains", 0.0, "" if fell else f"losses {losses} did not fall over {STEPS} steps"))
    elif kind == "nan_skip":
        losses = series(read_metrics(matrix, jobs[0]))["loss"]
        ok = len(losses) == STEPS and math.isnan(losses[2]) and all(math.isfinite(x) for i, x in enumerate(losses) if i != 2)
        skipped = job_log(matrix, jobs[0]).count("non-finite loss at step 3: skipped its update")
        checks.append(("nan skipped", 0.0, "" if ok and skipped == 1 else f"losses {losses}, skip logged {skipped}x"))
    else:
        rtol = LOG_RTOL if spec == "llama3" else ROWS[row].tolerance(spec)
        checks.append(("vs single", *compare(read_metrics(matrix, jobs[0]), ref, all_steps, rtol)))
        if spec != "llama3" and ROWS[row].validation:
            run_validation, ref_validation = read_validation(matrix, jobs[0]), read_validation(matrix, ref_jobs[-1])
            checks.append(("validation vs single", *compare_validation(run_validation, ref_validation, rtol)))
    if ROWS[row].console and spec != "llama3" and (problem := console_problem(matrix, jobs[0], ROWS[row].steps)):
        checks.append(("console", math.inf, problem))
    if ROWS[row].log_expect and ROWS[row].log_expect not in job_log(matrix, jobs[0]):
        checks.append(("log", math.inf, f"rank 0's log lacks {ROWS[row].log_expect!r}"))
    worst = max(rel for _, rel, _ in checks)
    problems = [f"{what}: {problem}" for what, _, problem in checks if problem]
    if problems:
        return Result(spec, row, "MISMATCH", worst, "; ".join(problems))
    note = "reference" if row == "single" and variant == "base" else f"vs single{'' if variant == 'base' else f' ({variant})'}"
    if kind == "stream_resume":
        note = "trains; resumed == uninterrupted"
    elif kind == "resume":
        note += "; resumed == uninterrupted"
    elif kind == "resume_pp1":
        note += "; resumed at PP=1 from step 2"
    elif kind == "resume_from_pp1":
        note += "; resumed at PP=2 from one process's step 2"
    return Result(spec, row, "ok", worst, note)


def step_one_against_transformers(matrix: Matrix, spec: str, row: str, job) -> tuple[list, float, list[str]]:
    """(the job's losses, step 1's relative difference from transformers' own forward of the spec's hub folder
    on the job's first batch, the problem when past the row's tolerance)."""
    losses = series(read_metrics(matrix, job))["loss"]
    reference = transformers_loss(matrix.hub_folder(spec), job)
    rel = abs(losses[0] - reference) / abs(reference) if losses else math.inf
    problems = [] if rel <= ROWS[row].tolerance(spec) else [f"step 1 loss {losses[:1]} vs transformers' {reference!r}"]
    return losses, rel, problems


def evaluate_hub(matrix: Matrix, spec: str, row: str) -> Result:
    """Step 1's loss against transformers' own forward on the job's first batch, and the export against the folder."""
    (job,) = matrix.row_jobs(spec, row)
    if error := job_error(matrix, job):
        return Result(spec, row, "ERROR", None, error)
    losses, rel, problems = step_one_against_transformers(matrix, spec, row, job)
    export = matrix.hub_export_folder(spec, row)
    problems += [p for p in (hf_folder_problem(export), hub_tensors_problem(matrix.hub_folder(spec), export)) if p]
    return Result(spec, row, "MISMATCH" if problems else "ok", rel, "; ".join(problems) or
                  "step 1 == transformers' forward; export == the hub folder")


WALKTHROUGH = {"hf_qwen3": "Qwen3-0.6B", "hf_qwen3_moe": "Qwen3-30B-A3B", "hf_kimi_linear": "Kimi-Linear-48B-A3B-Instruct"}
"""The spec whose hub folder stands in for each model of docs/checkpoints-and-hf.md's walkthrough (its model type)."""
WALKTHROUGH_STEPS = 2
WALKTHROUGH_MOVE = 1e-2
"""An exported tensor's largest move from the folder's over the row's steps: AdamW moves an element by about the
learning rate a step (the TOMLs' 1e-4 and 3e-4; 1.7e-4 to 7.5e-4 measured, 2026-11-29); a tensor put in another's
place differs from it by ~0.1 an element (``HUB_NOISE``), by far more at its largest."""


def evaluate_walkthrough(matrix: Matrix, spec: str, row: str) -> Result:
    """The page's command trained from the hub folder: step 1 against transformers' forward of the folder, every
    step's loss finite, the export the folder's tensors (names, moved a little), loaded by ``from_pretrained`` and by
    the page's own loading block."""
    (job,) = matrix.row_jobs(spec, row)
    if error := job_error(matrix, job):
        return Result(spec, row, "ERROR", None, error)
    losses, rel, problems = step_one_against_transformers(matrix, spec, row, job)
    if len(losses) != WALKTHROUGH_STEPS or not all(map(math.isfinite, losses)):
        problems.append(f"losses {losses}, expected {WALKTHROUGH_STEPS} finite ones")
    export = matrix.hub_export_folder(spec, row)
    problems += [p for p in (hf_folder_problem(export), trained_tensors_problem(matrix.hub_folder(spec), export),
                             loading_problem(export)) if p]
    return Result(spec, row, "MISMATCH" if problems else "ok", rel, "; ".join(problems) or
                  "step 1 == transformers' forward; trained; the export loads")


def trained_tensors_problem(hub: Path, export: Path) -> str:
    """'' if the export holds the hub folder's tensors under the same names, each within ``WALKTHROUGH_MOVE`` of
    the folder's, and training moved some."""
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        return {k: v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}

    theirs, ours = tensors(hub), tensors(export)
    if sorted(theirs) != sorted(ours):
        odd = sorted(set(theirs) ^ set(ours))
        return f"export names differ from the hub folder's: {odd[:3]} ({len(odd)} in all)"
    moves = {k: (ours[k].float() - theirs[k].float()).abs().max().item() for k in theirs}
    far = [k for k, move in moves.items() if not move < WALKTHROUGH_MOVE]
    if far:
        return f"exported tensors {far[:3]} ({len(far)} in all) moved by {max(moves[k] for k in far):.3g} from the folder's"
    return "" if any(moves.values()) else "no exported tensor moved: nothing trained"


def loading_problem(export: Path) -> str:
    """'' if ``from_pretrained`` loads the export with no missing or unexpected keys and the page's loading block
    runs on it (the export's path for the page's)."""
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    if info["missing_keys"] or info["unexpected_keys"]:
        return f"from_pretrained({export}): {info}"
    code, path = walkthrough.load_example()
    exec(compile(code.replace(path, str(export)), "docs/checkpoints-and-hf.md (loading the export)", "exec"), {})
    return ""


def first_batch(job: Job):
    """The job's first batch (inputs, labels), from the dataloader its flags build (one data-parallel rank: the
    matrix's ranks all read the same stream)."""
    from torchtitan.config import ConfigManager

    import titan_ext  # noqa: F401  (the datasets)
    from titan_ext.data import build_dataloader, build_tokenizer

    package = sys.modules["titan_ext"]
    config = ConfigManager().parse_args(list(job.argv))
    sys.modules["titan_ext"] = package  # the parse forgets it for a Trainer's import (titan_ext.config): none follows
    loader = build_dataloader(1, 0, build_tokenizer(config), config)
    inputs, labels = next(iter(loader))
    return inputs["input"], labels


def transformers_loss(folder: Path, job: Job) -> float:
    """transformers' own forward of the hub folder on the job's first batch: the mean token loss, plus for a MoE model
    its routers' balancing loss (``aux_loss``) at the config's coefficient, per sequence as titan_ext counts it
    (``titan_ext.models.moe.balance_loss``: each sequence's own, weighted by its valid tokens). Hybrids' recurrent
    kernels run on titan_ext's portable kernels (``titan_ext.kernels``)."""
    import torch

    from titan_ext import pretrained

    tokens, labels = first_batch(job)
    model = pretrained.from_pretrained(str(folder))
    with torch.no_grad():
        logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        coefficient = getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0
        if coefficient and hasattr(model.config, "output_router_logits"):
            valid = (labels != -100).sum(dim=1)
            balance = [model(sequence[None], output_router_logits=True).aux_loss for sequence in tokens]
            loss = loss + coefficient * (torch.stack(balance) * valid).sum() / valid.sum()
    return loss.item()


def hub_tensors_problem(hub: Path, export: Path) -> str:
    """'' if the export holds the hub folder's tensors under the same names, equal."""
    import torch
    from safetensors.torch import load_file

    def tensors(folder: Path) -> dict:
        return {k: v for p in sorted(folder.glob("*.safetensors")) for k, v in load_file(p).items()}

    theirs, ours = tensors(hub), tensors(export)
    if sorted(theirs) != sorted(ours):
        odd = sorted(set(theirs) ^ set(ours))
        return f"export names differ from the hub folder's: {odd[:3]} ({len(odd)} in all)"
    differ = [k for k in theirs if not torch.equal(theirs[k], ours[k])]
    return f"export tensors differ from the hub folder's: {differ[:3]} ({len(differ)} in all)" if differ else ""


def hf_folder_problem(folder: Path) -> str:
    """'' if ``folder`` is a self-contained HF directory (config, weights, tokenizer, nothing else)."""
    names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    needed = ["config.json", "tokenizer.json"]
    missing = [n for n in needed if n not in names] + ([] if any(n.endswith(".safetensors") for n in names) else ["*.safetensors"])
    if missing or "sharded" in names:
        return f"{folder} holds {names}: missing {missing}" + (", leftover sharded/" if "sharded" in names else "")
    return ""


def row_seconds(matrix: Matrix, spec: str, row: str) -> float | None:
    if not matrix.applies(spec, row):
        return None
    paths = [matrix.root / "results" / f"{job.id}.rank0.json" for job in matrix.row_jobs(spec, row)]
    return sum(json.loads(path.read_text()).get("seconds", 0.0) for path in paths if path.exists())


@dataclass
class Launch:
    """A matrix launch under way (``start_matrix``); ``results`` waits for it."""

    matrix: Matrix
    specs: list[str]
    rows: list[str]
    timeout: float
    proc: subprocess.Popen | None
    begin: float

    def results(self) -> tuple[list[Result], float]:
        """One Result per spec x row, unsupported rows listed with the reason; and the launch's seconds."""
        code = 0
        if self.proc is not None:
            try:
                code = self.proc.wait(max(0.0, self.begin + self.timeout - time.monotonic()))
            except subprocess.TimeoutExpired:
                stop(self.proc)
                code = -1
        seconds = time.monotonic() - self.begin if self.proc is not None else 0.0
        matrix, results = self.matrix, []
        for spec in self.specs:
            for row in self.rows:
                if row in UNSUPPORTED:
                    status = "unsupported" if applies(spec, row) else "n/a"
                    results.append(Result(spec, row, status, None, UNSUPPORTED[row]))
                elif (spec, row) in UNSUPPORTED_PAIRS and applies(spec, row):
                    results.append(Result(spec, row, "unsupported", None, UNSUPPORTED_PAIRS[spec, row]))
                else:
                    results.append(replace(evaluate(matrix, spec, row), seconds=row_seconds(matrix, spec, row)))
        if code != 0 and all(r.status in ("ok", "unsupported", "n/a") for r in results):
            results.append(Result("-", "driver", "ERROR", None, f"exit {code}; see {matrix.root}/driver.log"))
        return results, seconds

    def guest_finished(self, name: str) -> Path:
        """Wait until every rank of the guest's jobs has written its result (or the launch has ended); the
        launch's root, where the results lie (``results/{job id}.rank{R}.json``, logs in ``logs/``)."""
        jobs = [job for _, _, jobs in self.matrix.guests[name].units for job in jobs]
        paths = [self.matrix.root / "results" / f"{job.id}.rank{rank}.json" for job in jobs for rank in range(job.world)]
        while not all(path.exists() for path in paths) and self.proc.poll() is None:
            if time.monotonic() > self.begin + self.timeout:
                self.stop()
            time.sleep(1)
        return self.matrix.root

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def start_matrix(root: Path, specs: list[str], rows: list[str], timeout: float = 1500, niceness: int = 0,
                 guests: dict[str, Guest] | None = None) -> Launch:
    """Start the launch that runs ``rows`` of ``specs`` (and the ``guests``' jobs); it runs in the background
    until ``Launch.results``."""
    matrix = Matrix(root, specs, [row for row in rows if row not in UNSUPPORTED], guests or {})
    begin = time.monotonic()
    return Launch(matrix, specs, rows, timeout, launch(matrix, niceness) if matrix.units() else None, begin)


def run_matrix(root: Path, specs: list[str], rows: list[str], timeout: float = 1500) -> tuple[list[Result], float]:
    """Run ``rows`` of ``specs``; one Result per spec x row, unsupported rows listed with the reason."""
    return start_matrix(root, specs, rows, timeout).results()


ALL_ROWS = [*(row for row in ROWS if not ROWS[row].opt_in), *(row for row in UNSUPPORTED if row not in ROWS)]
"""The CI matrix's rows (``tests/test_integration_matrix.py``)."""
OPT_IN_ROWS = [row for row in ROWS if ROWS[row].opt_in]


def table(results: list[Result]) -> str:
    lines = [f"{'spec':<16} {'row':<19} {'status':<11} {'max rel':>8} {'s':>5}  detail"]
    for r in results:
        rel = "" if r.max_rel is None else f"{r.max_rel:.1e}"
        seconds = "" if r.seconds is None else f"{r.seconds:.1f}"
        if r.status != "n/a":
            lines.append(f"{r.spec:<16} {r.row:<19} {r.status:<11} {rel:>8} {seconds:>5}  {r.detail}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", nargs="+", choices=list(SPECS), default=list(SPECS))
    parser.add_argument("--rows", nargs="+", choices=[*ALL_ROWS, *OPT_IN_ROWS], default=ALL_ROWS)
    parser.add_argument("--root", type=Path, default=REPO / "outputs" / "integration_matrix")
    args = parser.parse_args()
    if args.root.exists():
        shutil.rmtree(args.root)
    results, seconds = run_matrix(args.root, args.spec, args.rows)
    print(table(results))
    print(f"\nmatrix: {seconds:.0f} s in one torchrun launch; logs under {args.root}")
    return 0 if all(r.status in ("ok", "unsupported", "n/a") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
