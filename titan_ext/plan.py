"""``python -m titan_ext.plan --job.config_file X.toml [flags] --world N``: a job's per-rank memory, collectives
and a step-time bound, planned in one process without its ranks (``titan_ext.planner``).

Not imported by ``import titan_ext``.
"""

from __future__ import annotations


def prepare() -> None:
    """titan_ext registered, and torchtitan pointed at the CPU: the planner never touches an accelerator."""
    import titan_ext  # noqa: F401  (the train specs)
    from titan_ext import host_patches

    host_patches.apply_job()
    host_patches.apply_cpu_mode()


def job_config_of(argv: list[str]):
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(argv)
