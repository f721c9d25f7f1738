"""README.md and docs/*.md: every relative link resolves, every documented command is run or checked, and every
python, json and toml block parses.

Commands are the lines of the pages' fenced ``bash`` blocks (backslash continuations joined). Each one must
be in ``RUN_BY``, which names what runs it:

- ``matrix:SPEC/ROW``: a row of the integration matrix trains that job (on the matrix's corpus, with its
  short-run flags; ``readme_ext`` runs the extension example exactly as written);
- ``test:PATH::NAME``: a test of the suite runs it;
- ``ci``: ``.ci/run`` runs it;
- ``gpu``: a GPU, many nodes or minutes are needed; nothing here runs it;
- ``download``: it downloads from the Hugging Face hub; nothing here runs it (tests write tiny folders of the
  same model types).

Independently of that, every ``torchrun ... -m torchtitan.train`` and ``python -m titan_ext.plan`` command
is checked as a launch would check it, without launching: torchrun's own argument parser reads its world size
(``--nnodes`` x ``--nproc_per_node``), torchtitan's ``ConfigManager`` parses the job's TOML and flags, and
titan_ext's preflight and job plan run for that world size (``check_job_config``, then the model args'
``update_from_config``). A wrong flag, TOML path, flavor or layout in the docs fails here. The checks run in a
folder holding what the documented commands before them leave behind (``provide_outputs``): checkpoints
written by a debug run, a seed checkpoint, an HF export, and a folder of text shards for the pages' data path.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import first_error

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)

RUN_BY = {
    # README.md
    'pip install torch==2.13.0 && pip install -e ".[test]"': "ci",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml":
        "matrix:fla_gla/fsdp2",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/gla_340M.toml": "gpu",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/gla_340M.toml "
    "--training.dataset titan_ext_stream --training.dataset_path /data/fineweb-edu/sample/": "gpu",
    "torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 -m torchtitan.train "
    "--job.config_file train_configs/gla_340M.toml --parallelism.data_parallel_shard_degree 32": "gpu",
    "torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 -m torchtitan.train "
    "--job.config_file train_configs/gla_340M.toml --parallelism.data_parallel_replicate_degree 4 "
    "--parallelism.data_parallel_shard_degree 8": "gpu",
    "torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 -m torchtitan.train "
    "--job.config_file train_configs/gla_340M.toml --parallelism.data_parallel_replicate_degree 32 "
    "--parallelism.data_parallel_shard_degree 1": "gpu",
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --world 32 "
    "--parallelism.data_parallel_replicate_degree 4 --parallelism.data_parallel_shard_degree 8":
        "test:tests/test_plan.py::test_the_cli_reports_memory_collectives_bubble_and_time",
    "python -m pytest -q tests": "ci",
    # docs/data.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--training.dataset titan_ext_stream --training.dataset_path /data/fineweb-edu/sample/": "matrix:fla_gla/stream_resume",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--titan_ext.document_mask --parallelism.tensor_parallel_degree 2": "matrix:fla_gla/docs_tp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--validation.enable --validation.dataset titan_ext_tiny --validation.freq 5 --validation.steps 2":
        "matrix:fla_gla/fsdp2",
    "python bench/bench_data.py":
        "test:tests/test_bench.py::test_bench_data_quick_check_prints_three_rows_of_tokens_per_second_and_two_of_waits",
    # docs/parallelism.md
    "torchrun --nproc_per_node=4 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2":
        "matrix:fla_gla/hsdp2x2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--parallelism.tensor_parallel_degree 2": "matrix:fla_gla/tp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_llama.toml "
    "--parallelism.context_parallel_degree 2": "matrix:hf_llama/cp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule Interleaved1F1B":
        "matrix:fla_gla/pp2_interleaved",
    "python bench/compose_8ranks.py": "gpu",
    # docs/hybrids.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla_hybrid.toml":
        "matrix:fla_gla_hybrid_shipped/fsdp2",
    "echo '{\"model_type\": \"gla\", \"attn\": {\"layers\": [1], \"num_heads\": 4, \"num_kv_heads\": 2}}' > hybrid.json":
        "test:tests/test_docs.py::test_each_documented_launch_passes_the_checks_for_its_world_size",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--model.name fla --model.flavor gla-debugmodel --titan_ext.hf_config hybrid.json "
    "--parallelism.context_parallel_degree 2": "matrix:fla_gla_hybrid/cp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_5.toml":
        "matrix:hf_qwen3_5_shipped/fsdp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_5.toml "
    "--parallelism.context_parallel_degree 2 --titan_ext.document_mask": "matrix:hf_qwen3_5/cp2_docs",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_5.toml "
    "--parallelism.tensor_parallel_degree 2": "matrix:hf_qwen3_5/tp2",
    "python -m titan_ext.plan --job.config_file train_configs/debug_gla_hybrid.toml --world 8 "
    "--parallelism.context_parallel_degree 2 --parallelism.tensor_parallel_degree 2":
        "test:tests/test_hybrids.py::test_the_planner_plans_the_documented_hybrid_layout",
    # docs/kda.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_kda.toml":
        "matrix:fla_kda/fsdp2",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/kda_340M.toml": "gpu",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_kimi_linear.toml "
    "--parallelism.expert_parallel_degree 2": "matrix:hf_kimi_linear/ep2_hf",
    "torchrun --nproc_per_node=4 -m torchtitan.train --job.config_file train_configs/debug_kimi_linear.toml "
    "--parallelism.tensor_parallel_degree 2 --parallelism.expert_parallel_degree 2": "matrix:hf_kimi_linear/ep2_tp2_fsdp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_kimi_linear.toml "
    "--parallelism.context_parallel_degree 2 --parallelism.expert_parallel_degree 2": "matrix:hf_kimi_linear/ep2_cp2",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/kimi_linear.toml": "gpu",
    # docs/moe.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml":
        "matrix:hf_qwen3_moe/fsdp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--parallelism.expert_parallel_degree 2": "matrix:hf_qwen3_moe/ep2_resume",  # its first job: EP2 x FSDP2
    "torchrun --nproc_per_node=4 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--parallelism.expert_parallel_degree 2 --parallelism.tensor_parallel_degree 2": "matrix:hf_kimi_linear/ep2_tp2_fsdp2",  # that layout
    "torchrun --nproc_per_node=4 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--parallelism.expert_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2": "matrix:hf_moe_bias/ep2_hsdp2x2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--titan_ext.moe_balance bias": "matrix:hf_moe_bias/ep2_hsdp2x2",
    "python tests/integration_matrix.py --spec hf_qwen3_next --rows single cp2 ep2_cp2 pp2": "matrix:hf_qwen3_next/pp2",
    "python tests/integration_matrix.py --spec hf_qwen3_moe --rows single ep2_pp2 ep2_pp2_tp2":
        "matrix:hf_qwen3_moe/ep2_pp2_tp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2":
        "test:tests/test_plan.py::test_planned_ranks_equal_the_real_ranks",  # its tp2_moe layout runs it (2 steps)
    "torchrun --nproc_per_node=4 -m torchtitan.train --job.config_file train_configs/debug_qwen3_moe.toml "
    "--parallelism.expert_parallel_degree 2 --parallelism.tensor_parallel_degree 2 "
    "--parallelism.expert_tensor_parallel_degree 2": "matrix:hf_qwen3_moe/ep2_tp2_etp2",
    "python tests/integration_matrix.py --spec hf_qwen3_next --rows single docs_tp2": "matrix:hf_qwen3_next/docs_tp2",
    "python tests/integration_matrix.py --spec hf_deepseek_v3 hf_kimi_linear --rows single tp2":
        "matrix:hf_deepseek_v3/tp2",
    "python tests/integration_matrix.py --spec hf_qwen3_moe --rows single ep2_tp2_etp2": "matrix:hf_qwen3_moe/ep2_tp2_etp2",
    "python tests/integration_matrix.py --spec hf_qwen3_next --rows single ep2_cp2": "matrix:hf_qwen3_next/ep2_cp2",
    "python tests/integration_matrix.py --spec hf_qwen3_moe --rows single ep2_cp2": "matrix:hf_qwen3_moe/ep2_cp2",
    "python tests/integration_matrix.py --spec hf_qwen3_next --rows single ep2_tp2": "matrix:hf_qwen3_next/ep2_tp2",
    "torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 "
    "-m torchtitan.train --job.config_file train_configs/qwen3_moe_30B_A3B.toml": "gpu",  # 8 gloo ranks, minutes: the opt-in matrix rows
    # docs/checkpoints-and-hf.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--checkpoint.enable": "matrix:fla_gla/resume",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--checkpoint.enable --training.steps 20": "test:tests/test_docs.py::test_torchtitan_resumes_from_the_latest_step",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--checkpoint.enable --checkpoint.load_step 5": "matrix:fla_gla/resume",
    "torchrun --nproc_per_node=1 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--job.dump_folder outputs/seed --checkpoint.enable --checkpoint.create_seed_checkpoint": "matrix:fla_gla/single",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--checkpoint.enable --checkpoint.initial_load_path outputs/seed/checkpoint/step-0": "matrix:fla_gla/tp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--job.dump_folder outputs/seed --checkpoint.enable": "matrix:fla_gla/fsdp2",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--job.dump_folder outputs/gla_hf --checkpoint.enable --checkpoint.last_save_in_hf --checkpoint.last_save_model_only":
        "matrix:fla_gla/hf",
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--job.dump_folder outputs/from_hf --checkpoint.enable --checkpoint.initial_load_in_hf "
    "--checkpoint.initial_load_path outputs/gla_hf/checkpoint/step-10": "matrix:fla_gla/hf",
    "python tests/integration_matrix.py --spec hf_qwen3_moe --rows hub_fsdp2 hub_tp2 hub_ep2": "matrix:hf_qwen3_moe/hub_ep2",
    # docs/checkpoints-and-hf.md's walkthrough (tests/walkthrough.py reads its commands from the page)
    "hf download Qwen/Qwen3-0.6B --local-dir checkpoints/Qwen3-0.6B": "download",
    "python -m titan_ext.plan --job.config_file train_configs/llama_1B.toml --model.name hf --model.flavor from_config "
    "--titan_ext.hf_config checkpoints/Qwen3-0.6B --parallelism.data_parallel_shard_degree 8 --titan_ext.loss chunked "
    "--world 8": "test:tests/test_walkthrough.py::test_each_plan_output_shown_is_what_the_command_prints_today",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/llama_1B.toml --model.name hf "
    "--model.flavor from_config --titan_ext.hf_config checkpoints/Qwen3-0.6B --parallelism.data_parallel_shard_degree 8 "
    "--titan_ext.loss chunked --model.hf_assets_path checkpoints/Qwen3-0.6B --checkpoint.initial_load_in_hf "
    "--checkpoint.initial_load_model_only --checkpoint.last_save_in_hf --job.dump_folder outputs/qwen3_0.6B "
    "--training.dataset titan_ext_stream --training.dataset_path /data/fineweb-edu/sample/ --training.steps 1000":
        "matrix:hf_qwen3/walkthrough",
    "hf download Qwen/Qwen3-30B-A3B --local-dir checkpoints/Qwen3-30B-A3B": "download",
    "python -m titan_ext.plan --job.config_file train_configs/qwen3_moe_30B_A3B.toml "
    "--titan_ext.hf_config checkpoints/Qwen3-30B-A3B --parallelism.data_parallel_shard_degree 8 "
    "--parallelism.expert_parallel_degree 8 --titan_ext.loss chunked --world 8":
        "test:tests/test_walkthrough.py::test_each_plan_output_shown_is_what_the_command_prints_today",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/qwen3_moe_30B_A3B.toml "
    "--titan_ext.hf_config checkpoints/Qwen3-30B-A3B --parallelism.data_parallel_shard_degree 8 "
    "--parallelism.expert_parallel_degree 8 --titan_ext.loss chunked --model.hf_assets_path checkpoints/Qwen3-30B-A3B "
    "--checkpoint.initial_load_in_hf --checkpoint.initial_load_model_only --checkpoint.last_save_in_hf "
    "--job.dump_folder outputs/qwen3_30b_a3b --training.dataset titan_ext_stream "
    "--training.dataset_path /data/fineweb-edu/sample/ --training.steps 1000": "matrix:hf_qwen3_moe/walkthrough",
    "hf download moonshotai/Kimi-Linear-48B-A3B-Instruct --local-dir checkpoints/Kimi-Linear-48B-A3B-Instruct":
        "download",
    "python -m titan_ext.tokenizer_json checkpoints/Kimi-Linear-48B-A3B-Instruct": "matrix:hf_kimi_linear/walkthrough",
    "python -m titan_ext.plan --job.config_file train_configs/kimi_linear.toml "
    "--titan_ext.hf_config checkpoints/Kimi-Linear-48B-A3B-Instruct --parallelism.data_parallel_shard_degree 8 "
    "--parallelism.expert_parallel_degree 8 --activation_checkpoint.mode full --training.local_batch_size 2 "
    "--titan_ext.loss chunked --world 8":
        "test:tests/test_walkthrough.py::test_each_plan_output_shown_is_what_the_command_prints_today",
    "torchrun --nproc_per_node=8 -m torchtitan.train --job.config_file train_configs/kimi_linear.toml "
    "--titan_ext.hf_config checkpoints/Kimi-Linear-48B-A3B-Instruct --parallelism.data_parallel_shard_degree 8 "
    "--parallelism.expert_parallel_degree 8 --activation_checkpoint.mode full --training.local_batch_size 2 "
    "--titan_ext.loss chunked --model.hf_assets_path checkpoints/Kimi-Linear-48B-A3B-Instruct "
    "--checkpoint.initial_load_in_hf --checkpoint.initial_load_model_only --checkpoint.last_save_in_hf "
    "--job.dump_folder outputs/kimi_linear_48b --training.dataset titan_ext_stream "
    "--training.dataset_path /data/fineweb-edu/sample/ --training.steps 1000": "matrix:hf_kimi_linear/walkthrough",
    # docs/planning.md
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full --world 1024":
        "test:tests/test_plan.py::test_the_cli_reports_memory_collectives_bubble_and_time",
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full --world 1024 "
    "--parallelism.data_parallel_replicate_degree 128 --parallelism.data_parallel_shard_degree 4 "
    "--parallelism.tensor_parallel_degree 2": "test:tests/test_plan.py::test_planned_ranks_equal_the_real_ranks",
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 2 --activation_checkpoint.mode full --world 1024 "
    "--parallelism.pipeline_parallel_degree 2": "test:tests/test_plan.py::test_planned_ranks_equal_the_real_ranks",
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full --world 1024 --sweep":
        "test:tests/test_plan.py::test_sweep_ranks_the_layouts_that_fit_and_gives_titan_exts_reasons_for_the_rest",
    "python -m titan_ext.plan --job.config_file train_configs/debug_gla.toml --world 8 --sweep --memory-gib 0.008":
        "test:tests/test_plan.py::test_sweep_ranks_the_layouts_that_fit_and_gives_titan_exts_reasons_for_the_rest",
    "python -m titan_ext.plan --job.config_file train_configs/qwen3_moe_30B_A3B.toml "
    "--titan_ext.hf_config train_configs/qwen3_next_80b_a3b.json --titan_ext.no-document_mask --world 1024":
        "gpu",  # minutes of planning; tests/test_plan.py plans MoE (EP 2) and a hybrid (CP 2) against real runs
    "python bench/bench_autotune_compile.py":  # 4 minutes on 2 cores; the test runs --quick
        "test:tests/test_bench.py::test_bench_autotune_compile_quick_check_compiles_the_same_kernels_both_ways",
    "python bench/bench_memory.py --tokens 1024 8192": "gpu",  # minutes and ~16 GiB
    # docs/planning-sweep.md (the sweeps and the bench run for minutes: "gpu" marks what nothing here runs)
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--world 1024 --sweep --memory-gib 80": "gpu",
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full "
    "--world 1024 --sweep --memory-gib 80":
        "test:tests/test_plan.py::test_sweep_ranks_the_layouts_that_fit_and_gives_titan_exts_reasons_for_the_rest",
    "python -m titan_ext.plan --job.config_file train_configs/qwen3_moe_30B_A3B.toml "
    "--titan_ext.hf_config train_configs/qwen3_30b_a3b.json --world 1024 --sweep --memory-gib 80":
        "test:tests/test_plan.py::test_a_moe_sweep_lists_ep_layouts_each_as_planned_on_its_own",
    "python bench/bench_plan.py": "gpu",
    "python bench/bench_plan.py --baseline /path/to/old/checkout": "gpu",
    "python bench/bench_plan.py --sample 1 --baseline /path/to/old/checkout": "gpu",
    'python bench/bench_plan.py --layout "pp 8 x fsdp 128" --baseline /path/to/old/checkout': "gpu",
    "python bench/bench_plan.py -- "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full": "gpu",
    # docs/extending.md: the example's files and command, read from the page (tests/readme_example.py)
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--experimental.custom_import my_gla --model.name fla --titan_ext.hf_config my_gla.json "
    "--parallelism.tensor_parallel_degree 2": "matrix:fla_gla/readme_ext",
    # docs/troubleshooting.md
    "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml "
    "--model.name fla_glaa": "test:tests/test_bad_configs.py::test_the_user_sees_one_line_and_no_traceback",
    # docs/gpu.md
    "TRITON_INTERPRET=1 torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file "
    "train_configs/debug_gla.toml --titan_ext.kernels fla --parallelism.tensor_parallel_degree 2 "
    "--parallelism.data_parallel_shard_degree 1 --training.steps 3": "matrix:fla_gla/interpret_tp2",
    "python -m pytest -q tests/test_interpret.py": "ci",
    "python -m pytest -q -rs tests/test_gla_op.py tests/test_kda_op.py tests/test_gated_delta_op.py tests/test_sdpa_fallback.py "
    "tests/test_autotune_compile.py":
        "ci",  # they skip without CUDA
    "python bench/bench_train.py": "gpu",
    "python bench/bench_train.py --rows c,g": "gpu",  # the selection: test_bench_rows_option_picks_rows_in_order...
    "python bench/bench_train.py --cpu-tiny": "test:tests/test_bench.py::test_bench_cpu_tiny_prints_seven_finite_rows",
    "python bench/gpu_proof.py --out proof tests train:gla_340M bench": "gpu",
    "python bench/gpu_proof.py --out proof --deadline 480 bench:c,g,b,a@330 train:gla_340M@120 tests": "gpu",
    # docs/tested-versions.md
    "python scripts/test_versions.py latest": "gpu",  # builds a venv from the registry: minutes
    "python scripts/test_versions.py newest": "gpu",
    "python scripts/test_versions.py latest -- -x tests/test_context_parallel.py": "gpu",
    "python tests/integration_matrix.py --spec fla_gla --rows tp2 resume": "test:tests/test_integration_matrix.py::matrix",
}
"""Every command of the pages -> what runs it (see the module's docstring)."""

AS_WRITTEN = {"matrix:fla_gla/readme_ext"}
"""Run by the matrix exactly as the page shows it (its module is the page's own file): nothing to check here."""
FROM_THE_PAGE = {"matrix:hf_qwen3/walkthrough", "matrix:hf_qwen3_moe/walkthrough", "matrix:hf_kimi_linear/walkthrough"}
"""Read from the page by the matrix and run on 2 ranks with the changes ``tests/walkthrough.py`` lists; their 8-GPU
layouts are checked here through the page's plan commands (the same flags, ``tests/test_walkthrough.py``): the
commands themselves load a hub folder's weights, which no folder here holds."""

STAND_INS = {"/data/fineweb-edu/sample/": "shards"}
"""A user's own path in a command -> the folder (under the check's working folder) that stands in for it."""


# ---------------------------------------------------------------- reading the pages

def fenced(text: str) -> list[tuple[str, str]]:
    """(info string, body) of each fenced block."""
    return [(info.strip(), body) for info, body in FENCE.findall(text)]


def prose(text: str) -> str:
    """The page without its fenced blocks (links and headings in code are not links and headings)."""
    return FENCE.sub("", text)


def commands(text: str) -> list[str]:
    """The commands of a page's ``bash`` blocks, one per line after joining continuations."""
    found = []
    for info, body in fenced(text):
        if info.split()[:1] != ["bash"]:
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]|(?<!\w)_|_(?!\w)|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()  # a word's _ stays
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(title) for _, title in HEADING.findall(prose(path.read_text()))}


def documented() -> dict[str, list[str]]:
    """Each command -> the pages showing it."""
    where: dict[str, list[str]] = {}
    for page in PAGES:
        for command in commands(page.read_text()):
            where.setdefault(command, []).append(str(page.relative_to(REPO)))
    return where


# ---------------------------------------------------------------- the pages themselves

def test_pages_exist_and_the_readme_stays_short():
    names = {page.name for page in PAGES}
    assert {"data.md", "parallelism.md", "checkpoints-and-hf.md", "planning.md", "extending.md",
            "troubleshooting.md", "architecture.md", "tested-versions.md", "gpu.md"} <= names
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no {resolved}")
        elif anchor and (resolved.suffix != ".md" or anchor not in anchors(resolved)):
            broken.append(f"{target}: no heading '#{anchor}' in {resolved.name}")
    assert not broken, broken


def test_slugs_follow_github():
    assert slug("Resuming on another number of data-parallel ranks") == "resuming-on-another-number-of-data-parallel-ranks"
    assert slug("Data parallelism: FSDP, HSDP, DDP") == "data-parallelism-fsdp-hsdp-ddp"
    assert slug("Every layout: `--sweep`") == "every-layout---sweep"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_json_and_toml_block_parses(page):
    import json

    import tomli

    for info, body in fenced(page.read_text()):
        language = info.split()[:1]
        if language == ["python"]:
            compile(body, f"{page.name}: {info}", "exec")
        elif language == ["json"]:
            json.loads(body)
        elif language == ["toml"]:
            tomli.loads(body)


def test_every_command_is_run_by_something_named():
    where = documented()
    assert where, "no bash blocks found"
    unmapped = {command: pages for command, pages in where.items() if command not in RUN_BY}
    assert not unmapped, f"documented commands nothing runs (add them to RUN_BY): {unmapped}"
    stale = [command for command in RUN_BY if command not in where]
    assert not stale, f"RUN_BY names commands no page shows any more: {stale}"


@pytest.mark.parametrize("reference", sorted(set(RUN_BY.values())))
def test_what_runs_each_command_exists(reference):
    kind, _, what = reference.partition(":")
    if kind == "matrix":
        sys.path.insert(0, str(REPO / "tests"))
        import integration_matrix

        spec, row = what.split("/")
        assert row in integration_matrix.ROWS and integration_matrix.applies(spec, row), reference
        assert not integration_matrix.ROWS[row].opt_in, f"{reference}: not part of CI's matrix"
    elif kind == "test":
        path, name = what.split("::")
        assert re.search(rf"^def {re.escape(name)}\b", (REPO / path).read_text(), re.M), reference
    elif kind == "ci":
        assert reference == "ci"
    else:
        assert kind in ("gpu", "download"), reference


def test_ci_runs_the_readmes_test_command_and_every_command_mapped_to_ci():
    """``ci``: a line of ``.ci/run`` (pip's ``-q`` aside), or pytest on files of the suite CI runs."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "\npython -m pytest -q tests\n" in ci
    assert "python -m pytest -q tests" in commands((REPO / "README.md").read_text())
    lines = {" ".join(line.replace("python -m pip", "pip").replace(" -q ", " ").split()) for line in ci.splitlines()}
    for command in (c for c, run_by in RUN_BY.items() if run_by == "ci"):
        words = command.split()
        if words[:3] == ["python", "-m", "pytest"]:
            paths = [w for w in words[3:] if not w.startswith("-")]
            assert paths and all(p == "tests" or (REPO / p).is_file() and p.startswith("tests/") for p in paths), command
        else:
            assert all(part.strip() in lines for part in command.split("&&")), command


def test_the_extension_example_is_read_from_its_page():
    sys.path.insert(0, str(REPO / "tests"))
    import readme_example

    files, argv = readme_example.example()
    assert set(files) == {"my_gla.py", "my_gla.json"}
    command = next(c for c, run_by in RUN_BY.items() if run_by == "matrix:fla_gla/readme_ext")
    assert shlex.split(command)[shlex.split(command).index("torchtitan.train") + 1:] == argv


# ---------------------------------------------------------------- launches, checked without launching

def launch_of(command: str) -> tuple[dict[str, str], int, list[str]] | None:
    """(environment, world size, the job's arguments) of a torchrun or planner command, else None."""
    words = shlex.split(command)
    env = {}
    while words and re.match(r"^[A-Z_]+=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser, parse_min_max_nnodes

        args = get_args_parser().parse_args(words[1:])
        assert args.module and args.training_script == "torchtitan.train", command
        world = parse_min_max_nnodes(args.nnodes)[1] * int(args.nproc_per_node)
        return env, world, list(args.training_script_args)
    if words[:3] == ["python", "-m", "titan_ext.plan"]:
        from titan_ext.plan import parse

        options, rest = parse(words[3:])
        return env, options.world, rest
    return None


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """A working folder holding what the documented commands leave behind, for the checks to find."""
    folder = tmp_path_factory.mktemp("docs_world")
    provide_outputs(folder)
    return folder


def provide_outputs(folder: Path) -> None:
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import save as dcp_save
    from torchtitan.protocols.train_spec import get_train_spec

    import titan_ext  # noqa: F401  (train specs)
    from titan_ext.checkpoints.hf import checkpoint_config
    from titan_ext.models.adapter import meta_model

    (folder / "train_configs").symlink_to(REPO / "train_configs")
    args = get_train_spec("fla_gla").model_args["debugmodel"]
    weights = {name: torch.zeros(p.shape) for name, p in meta_model(args).named_parameters()}
    positions = {"dp_rank_0": b"x", "dp_rank_1": b"y", "world_size": 2}  # 2 data-parallel ranks, as torchtitan keys them
    for step in (5, 10):  # the debug run with --checkpoint.enable: a save every 5 steps
        dcp_save({**weights, "dataloader": positions}, checkpoint_id=str(folder / f"outputs/debug_gla/checkpoint/step-{step}"))
    dcp_save(dict(weights), checkpoint_id=str(folder / "outputs/seed/checkpoint/step-0"))
    hf = folder / "outputs/gla_hf/checkpoint/step-10"
    checkpoint_config(args).save_pretrained(hf)
    save_file(weights, hf / "model.safetensors")
    shards = folder / STAND_INS["/data/fineweb-edu/sample/"]
    shards.mkdir()
    for n in range(2):
        records = [{"text": f"shard {n} document {i} " + "word " * 40} for i in range(8)]
        pq.write_table(pa.Table.from_pylist(records), shards / f"part-{n}.parquet")
    assert json.loads((hf / "config.json").read_text())["model_type"] == "gla"
    sys.path.insert(0, str(REPO / "tests"))
    from test_walkthrough import REAL_CONFIGS

    for name, config in REAL_CONFIGS.items():  # the walkthrough's downloads: their config.json, for its plans
        (folder / "checkpoints" / name).mkdir(parents=True)
        (folder / "checkpoints" / name / "config.json").write_text(json.dumps(config))
    for command in documented():  # the files the pages write with echo for the launches after them
        if command.startswith("echo ") and " > " in command:
            subprocess.run(command, shell=True, cwd=folder, check=True)



def is_launch(command: str) -> bool:
    words = [w for w in command.split() if not re.match(r"^[A-Z_]+=", w)]
    return words[:1] == ["torchrun"] or words[:3] == ["python", "-m", "titan_ext.plan"]


LAUNCHES = [command for command, run_by in RUN_BY.items()
            if run_by not in AS_WRITTEN | FROM_THE_PAGE and is_launch(command)]
REFUSED = {"--model.name fla_glaa": "is not a registered train spec"}
"""Commands the pages show failing on purpose -> the line they must stop with."""


@pytest.mark.parametrize("command", LAUNCHES, ids=lambda c: c.replace("-m torchtitan.train --job.config_file train_configs/", "")[:90])
def test_each_documented_launch_passes_the_checks_for_its_world_size(outputs, command, monkeypatch):
    env, world, job_argv = launch_of(command)
    job_argv = [str(outputs / STAND_INS[arg]) if arg in STAND_INS else arg for arg in job_argv]
    monkeypatch.chdir(outputs)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    error = first_error(job_argv, world)
    if error and re.search(r"needs torch 2\.13 or later|install triton>=", error):  # never on CI's install
        pytest.skip(f"refused on this install, as titan_ext refuses it below a version: {error}")
    expected = next((line for flags, line in REFUSED.items() if flags in command), "")
    if expected:
        assert expected in error, f"{command}: {error!r}"
    else:
        assert error == "", f"{command} (world {world}): {error}"


def test_the_troubleshooting_example_is_the_line_the_code_prints(outputs, monkeypatch):
    """docs/troubleshooting.md shows a refused launch and the line it stops with ("..." stands for the lists the
    line goes on with): the line the check prints for that command."""
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    (command,) = [c for c in commands(page) if any(flags in c for flags in REFUSED)]
    shown = {line.split("titan_ext: ", 1)[1] for _, body in fenced(page) for line in body.splitlines()
             if "titan_ext: " in line and ("- ERROR -" in line or "traceback :" in line)}
    assert shown, "no refused line shown"
    env, world, argv = launch_of(command)
    monkeypatch.chdir(outputs)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    printed = first_error(argv, world)
    for line in shown:
        assert re.fullmatch(".*".join(map(re.escape, line.split("..."))), printed), (line, printed)


def test_the_checks_catch_a_wrong_flag_and_a_wrong_layout(outputs, monkeypatch):
    """The check above can fail: a misspelled TOML, flag or layout in a page would."""
    monkeypatch.chdir(outputs)
    good = "torchrun --nproc_per_node=2 -m torchtitan.train --job.config_file train_configs/debug_gla.toml"
    _, world, argv = launch_of(good + " --parallelism.tensor_parallel_degree 3")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    assert "tensor_parallel_degree" in first_error(argv, world)
    with pytest.raises(BaseException):  # torchtitan's parser: an unknown flag
        first_error(launch_of(good + " --parallelism.tensor_paralel_degree 2")[2], world)
    with pytest.raises(BaseException):  # a TOML that does not exist
        first_error(launch_of(good.replace("debug_gla", "debug_glaa"))[2], world)


# ---------------------------------------------------------------- figures and claims, as the code gives them

DATED_OUTPUTS = {
    "python -m titan_ext.plan --job.config_file train_configs/gla_340M.toml --model.flavor 7B "
    "--training.seq_len 32768 --training.local_batch_size 1 --activation_checkpoint.mode full --world 1024 --sweep":
        "2026-11-29",  # 2 minutes of planning on 2 cores
}
"""Planner commands whose outputs the pages show with their date instead (each would cost the suite minutes)."""


def planner_outputs() -> list[tuple[str, object]]:
    """(page, shown output) of every planner output the pages show (scripts/doc_outputs.py), but for commands
    of minutes (``gpu``, ``DATED_OUTPUTS``), whose outputs the pages date."""
    sys.path.insert(0, str(REPO / "scripts"))
    import doc_outputs

    return [(str(page.relative_to(REPO)), shown) for page in PAGES for shown in doc_outputs.shown_outputs(page.read_text())
            if RUN_BY.get(shown.command) != "gpu" and shown.command not in DATED_OUTPUTS]


def test_a_dated_output_states_its_date():
    pages = {page: page.read_text() for page in PAGES}
    for command, date in DATED_OUTPUTS.items():
        assert any(command in " ".join(t.replace("\\\n", " ").split()) and date in t for t in pages.values()), command


@pytest.mark.parametrize("page,shown", planner_outputs(), ids=lambda x: x if isinstance(x, str) else x.command[-60:])
def test_each_planner_output_on_the_pages_is_what_the_planner_prints(page, shown):
    """``python scripts/doc_outputs.py --write PAGE`` writes them; the planning time (the last line) aside."""
    import doc_outputs

    assert shown.command in RUN_BY, shown.command
    problem = doc_outputs.difference(shown, doc_outputs.printed(shown.command))
    assert not problem, f"{page}: {shown.command}\n{problem}\n(python scripts/doc_outputs.py --write {page})"


MEASURED = re.compile(r"\d[\d.,]*\s?(?:GiB|MiB|tokens/s|ms|s|seconds|minutes|min)\b")
"""A figure someone measured: memory, throughput, time."""
DATED = re.compile(r"20\d\d-\d\d-\d\d|bench/|tests/|scripts/|`python |titan_ext\.plan")
"""A date, or what prints the figure (a bench, a test, a script, a command)."""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_measured_figure_is_dated_or_names_what_prints_it(page):
    """A prose paragraph with a measured figure says when, or by what, it was measured: itself or a paragraph
    before it in its section (a table's caption, a "Measured" section's first lines)."""
    undated = []
    for section in re.split(r"^#+ .*$", prose(page.read_text()).replace("\n\n\n", "\n\n"), flags=re.M):
        paragraphs = [p for p in re.split(r"\n\s*\n", section) if p.strip()]
        for i, paragraph in enumerate(paragraphs):
            if MEASURED.search(paragraph) and not DATED.search(" ".join(paragraphs[:i + 1])):
                undated.append(" ".join(paragraph.split())[:160])
    assert not undated, undated


def toml_model_type(config: str) -> str:
    """The model type a shipped TOML trains: its hf_config's, else its train spec's name."""
    import json

    import tomli

    toml = tomli.loads((REPO / "train_configs" / config).read_text())
    hf_config = toml.get("titan_ext", {}).get("hf_config")
    return json.loads((REPO / hf_config).read_text())["model_type"] if hf_config else toml["model"]["name"]


@pytest.mark.parametrize("config", sorted(p.name for p in (REPO / "train_configs").glob("*.toml")))
def test_a_shipped_tomls_header_names_matrix_rows_that_train_its_model(config):
    """A header's "(spec/row)" claims: a row of CI's matrix trains that layout on the TOML's own model type."""
    sys.path.insert(0, str(REPO / "tests"))
    import integration_matrix as matrix

    header = "".join(line for line in (REPO / "train_configs" / config).read_text().splitlines(True)
                     if line.startswith("#"))
    claims = re.findall(r"\((\w+)/(\w+)\)", header)
    for spec, row in claims:
        assert spec in matrix.SPECS and row in matrix.ALL_ROWS and matrix.applies(spec, row), (config, spec, row)
        assert (spec, row) not in matrix.UNSUPPORTED_PAIRS, (config, spec, row)
        hf = matrix.SPECS[spec].hf_config
        assert (hf["model_type"] if hf else toml_model_type(matrix.SPECS[spec].config)) == toml_model_type(config)
    assert claims or not re.search(r"\b(TP|CP|PP)\b", header), f"{config}: its header names layouts without rows"


def test_torchtitan_resumes_from_the_latest_step(outputs):
    """What 'run the same command again' relies on: torchtitan 0.2.2 picks the highest finished step-N."""
    from types import SimpleNamespace

    from torchtitan.components.checkpoint import CheckpointManager

    manager = SimpleNamespace(folder=str(outputs / "outputs/debug_gla/checkpoint"))
    assert CheckpointManager._find_load_step(manager) == 10
