"""Divisibility checks for TP, run on the model config before anything is built or computed."""

from __future__ import annotations

DEGREE = "--parallelism.tensor_parallel_degree"


def _first(config, *names):
    """(name, value) of the first field present and not None; fla and HF spell head counts differently."""
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return name, value
    return None


def mlp_width(config) -> int | None:
    """The MLP's hidden width; fla derives it from ``hidden_ratio`` when ``intermediate_size`` is None."""
    if getattr(config, "intermediate_size", None) is not None:
        return config.intermediate_size
    ratio = getattr(config, "hidden_ratio", None)
    if ratio is None:
        return None
    width = int(config.hidden_size * ratio * 2 / 3)
    return 256 * ((width + 255) // 256)


def _sizes(config) -> list[tuple[str, int]]:
    """Every size TP splits across ranks, named as in the config."""
    sizes = []
    heads = _first(config, "num_heads", "num_attention_heads")
    if heads is not None:
        sizes.append(heads)
    kv_heads = _first(config, "num_kv_heads", "num_key_value_heads")
    if kv_heads is not None:
        sizes.append(kv_heads)
    for expand in ("expand_k", "expand_v"):
        if getattr(config, expand, None) is not None:
            sizes.append((f"hidden_size * {expand}", round(config.hidden_size * getattr(config, expand))))
    width = mlp_width(config)
    if width is not None:
        sizes.append(("intermediate_size", width))
    return sizes


def _unsupported(config) -> list[tuple[str, object, str]]:
    """(field, value, fix) for features no shipped plan shards."""
    checks = [
        ("use_short_conv", True, "set it to false (its channel-wise conv weights are not sharded)"),
        ("tie_word_embeddings", True, "set it to false (a tied embedding/head weight cannot take two TP layouts)"),
    ]
    found = [(f, v, fix) for f, v, fix in checks if getattr(config, f, None) == v]
    if getattr(config, "attnres_block_size", None) is not None:
        found.append(("attnres_block_size", config.attnres_block_size, "set it to null (attention residuals are not sharded)"))
    return found


def validate_tp(config, tp_degree: int, seq_len: int | None = None, sequence_parallel: bool = True) -> None:
    """Raise ``ValueError`` (one line naming the field, its value and the degree) if TP cannot split this model.

    ``config`` is the HF config (``model.config``) or anything with its fields.
    """
    if tp_degree <= 1:
        return
    for name, value, fix in _unsupported(config):
        raise ValueError(f"{name}={value} is not supported with {DEGREE}={tp_degree}; {fix}")
    for name, value in _sizes(config):
        if value % tp_degree:
            raise ValueError(
                f"{name}={value} is not divisible by {DEGREE}={tp_degree}; pick a degree that divides it"
            )
    if sequence_parallel and seq_len is not None and seq_len % tp_degree:
        raise ValueError(
            f"--training.seq_len={seq_len} is not divisible by {DEGREE}={tp_degree} with sequence parallel on; "
            "pick a divisible seq_len or set [titan_ext] disable_sequence_parallel = true"
        )
