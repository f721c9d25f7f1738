"""The census table's columns: the layouts it plans (the flags and world size each stands for), and the steps a
worker runs for a type, in order."""

from __future__ import annotations

LAYOUTS: dict[str, tuple[dict[str, object], int]] = {
    "FSDP2": ({"parallelism.data_parallel_shard_degree": 2}, 2),
    "TP": ({"parallelism.tensor_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "CP": ({"parallelism.context_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "PP": ({"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 1}, 2),
    "EP": ({"parallelism.expert_parallel_degree": 2}, 2),
    "documents": ({"titan_ext.document_mask": True}, 1),
}
"""Each planned column: its settings (the ``--section.field value`` flags it stands for) and world size."""
ONE_PROCESS = "one process"
COLUMNS = ("model type", "layers' mixers", ONE_PROCESS, *LAYOUTS)
STEPS = ("mixers", *LAYOUTS, ONE_PROCESS)
"""A type's steps, in the order a worker runs them (the cheap plan checks first)."""
NOT_RUN = "not run"
PLANS = "plans"
