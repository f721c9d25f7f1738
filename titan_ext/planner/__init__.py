"""Plan a titan_ext job without its ranks (``python -m titan_ext.plan``).

One process stands in for any rank of an N-rank job: a fake process group of
world size N (collectives return at once, nothing moves), the model built on the
meta device and parallelized by the train spec's own functions, then one
training step's forward and backward run under ``FakeTensorMode`` (shapes and
dtypes, no storage). What each rank holds is read from its sharded tensors and
what the step communicates is recorded as it is issued: nothing is a formula
except the activation, bubble and bandwidth figures, which say their
assumptions. Not imported by ``import titan_ext``.
"""


def prepare() -> None:
    """titan_ext registered, and torchtitan pointed at the CPU: the planner never touches an accelerator."""
    import titan_ext  # noqa: F401  (the train specs)
    from titan_ext.host import cpu_patches, job_patches

    job_patches.apply_job()
    cpu_patches.apply_cpu_mode()


def job_config_of(argv: list[str]):
    """torchtitan's own parsing of a TOML and its flags."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(argv)
