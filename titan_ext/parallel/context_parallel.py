"""Context parallelism: each rank holds a piece of every sequence, exactly.

torchtitan shards the inputs, labels and positions along the sequence
(``--parallelism.context_parallel_degree``); FSDP then spans the data-parallel
and CP ranks, so each piece's gradients are summed. What its own CP does for
softmax attention (ring SDPA), titan_ext does for linear recurrences: each
token mixer's kernel call runs through ``kernels.state_passing.across_ranks``,
one all-gather of the pieces' states per layer and step (and one of the last
inputs per short convolution), and the result equals one process over the
whole sequence.

With torchtitan's default ``headtail`` load balancer each rank holds two pieces
(``r`` and ``2N-1-r`` of ``2N``); with ``--parallelism.context_parallel_load_balancer
None`` one contiguous piece, which costs a recurrence the same. Both are exact.

Softmax attention (``hf_llama``, the fla transformer) runs as torchtitan runs
its own models': a module calling causal SDPA, made context parallel by
torchtitan's ``apply_cp_to_attention_module``, so torch's ring attention
passes the keys and values between ranks (``--parallelism.context_parallel_rotate_method``;
on a CPU through ``kernels.ring_attention``). Where a mask does more than
causality (document masking, a sliding window), each rank attends over keys
and values all-gathered from every rank instead (``kernels.cp_attention``, what runs in every forward).

With document masking the dataloader's ``document_positions`` cover the whole
rows (torchtitan shards only the tokens, labels and its own ``positions``);
read at each token's global position they restart the recurrent states, the
convolutions' halos, the rotary positions and the attention at every document
start, on whichever rank it falls (``models.packing.step_inputs``, ``state_passing.PieceLayout``).

MLA (``models.mixers.mla``) where masked all-gathers its compressed keys and values (``kv_lora_rank`` latent
dims and the shared rotary key per token) and each rank expands them to its own heads.

Each layer takes its token mixer's path (``titan_ext.models.mixers``): ``cp_kernels`` (a recurrence:
the global names it calls and each one's kind of recurrence), ``cp_halos`` (short convolutions alone: the
previous piece's last inputs) or ``cp_attention`` (fla's ``Attention``,
or the attention registry a transformers attention module reads). A hybrid model runs both on one CP
mesh and one ``PieceLayout``; a layer whose mixer has neither stops the job before the build
(``check_cp``), and a layer whose path did not run in the first forward stops it after step 1.
"""

from __future__ import annotations

import functools
import itertools
import logging

import torch.nn as nn
import torch.nn.functional as F

from titan_ext.data import documents
from titan_ext.errors import ConfigError, HostChanged
from titan_ext.job_plan import CPChoice
from titan_ext.kernels import cp_attention
from titan_ext.kernels.attention_block import score_options
from titan_ext.parallel.tensor_parallel import sequence_parallel_enabled

logger = logging.getLogger()

OPTION = "--parallelism.context_parallel_degree"
PIECES_PER_RANK = {None: 1, "headtail": 2}
"""torchtitan's load balancer -> pieces of each sequence per CP rank (``state_passing.piece_order``)."""


def cp_choice(model_args, job_config) -> CPChoice | None:
    p = job_config.parallelism
    if p.context_parallel_degree <= 1:
        return None
    masks = [documents.OPTION] if documents.enabled(job_config) else []
    masks += [reason] if (reason := model_args.ring_attention_blocker()) else []
    return CPChoice(p.context_parallel_degree, PIECES_PER_RANK[p.context_parallel_load_balancer],
                    masked_attention=", ".join(masks) or None, rotate_method=p.context_parallel_rotate_method)


def check_cp(model_args, job_config) -> None:
    """CP's preconditions, each a one-line error before the build."""
    p = job_config.parallelism
    degree = p.context_parallel_degree
    if degree <= 1:
        return
    reason = model_args.context_parallel_blocker()
    if reason:
        raise ConfigError(f"{OPTION}={degree}: {reason}")
    balancer = p.context_parallel_load_balancer
    if balancer not in PIECES_PER_RANK:
        raise ConfigError(
            f"--parallelism.context_parallel_load_balancer={balancer!r} reorders tokens in a way a recurrence "
            "cannot follow; use 'headtail' (the default) or None (contiguous pieces)"
        )
    from titan_ext.data import sections

    pieces = degree * PIECES_PER_RANK[balancer]
    halo = model_args.structure().halo()
    tp = p.tensor_parallel_degree if sequence_parallel_enabled(job_config) else 1
    for section in sections(job_config):
        option, seq_len = f"--{section}.seq_len", getattr(job_config, section).seq_len
        if seq_len % pieces:
            raise ConfigError(
                f"{option}={seq_len} does not split into {pieces} equal pieces ({OPTION}={degree}"
                f"{', head-tail: 2 per rank' if pieces > degree else ''}); use a multiple of {pieces}"
            )
        if seq_len // pieces < halo:
            raise ConfigError(
                f"{option}={seq_len} makes context-parallel pieces of {seq_len // pieces} tokens, shorter than "
                f"the {halo} earlier inputs each short convolution reads; use at least {halo * pieces} tokens"
            )
        if (seq_len // degree) % tp:
            raise ConfigError(
                f"{option}={seq_len}: each rank's {seq_len // degree} tokens ({OPTION}={degree}) do not split over "
                f"--parallelism.tensor_parallel_degree={tp} with sequence parallel on; use a multiple of {degree * tp}"
            )


def apply_cp(model: nn.Module, cp_mesh, choice: CPChoice, layout) -> None:
    """Make each block's mixer see the whole sequence across ``cp_mesh``, by its layer's path (only this
    model's modules change): state passing for a recurrence, ring or all-gathered attention for softmax
    attention, one CP mesh and one ``PieceLayout`` for all (the model's ``forward_plan.cp_layout``, where its
    forward records each step's positions: ``models.packing.step_inputs``). Each path counts its runs; the
    model checks them after its first forward (``PieceLayout.check_paths``)."""
    from titan_ext.kernels import binding

    blocks = {int(index): block for index, block in model.blocks().named_children()}  # a stage's keep theirs
    parts = [(index, part) for index in blocks for part in model.mixers[index].parts if part.mixes_tokens]
    attention = [mixer for _, mixer in parts if mixer.cp_attention]
    attend = attention_across_ranks(cp_mesh, layout, choice, gathered(attention)) if attention else None
    key = _binding_key()  # one for all blocks: blocks of one class share one bound class, so compiled code too
    for index, mixer in parts:
        module, path = blocks[index].get_submodule(mixer.path), _path_of(mixer)
        bound_key = f"{key}:{path}"  # a mixer's bound classes see its own replacements only
        if mixer.cp_kernels or mixer.cp_halos:
            _bind_state_passing(module, mixer, layout, bound_key)
        elif mixer.cp_attention == "transformers" and mixer.cp_latents and choice.masked_attention:
            _bind_gathered_latents(module, mixer.cp_latents, layout, bound_key)
        elif mixer.cp_attention == "transformers":
            _bind_transformers_attention(module, layout, attend, bound_key)
        elif mixer.cp_attention == "fla":
            _bind_fla_attention(module, layout, attend, bound_key)
        else:  # refused before the build (check_cp): never silently local
            raise ValueError(f"layer {index} ({mixer.name}) has no context-parallel path")
        layout.expected[path] = layout.expected.get(path, 0) + 1
    # The blocks keep their bound classes; the cache lets go of them, and with them of this job's group and
    # layout, which would otherwise outlive the job in a process that runs another (the test matrix's driver).
    binding.forget(f"{key}:")
    logger.info(
        f"Applied context parallelism ({layout.world} ranks, {layout.per_rank} piece(s) per rank), per layer: "
        + ", ".join(f"{count} x {path}" for path, count in layout.expected.items())
    )


def _path_of(mixer) -> str:
    """The name of a mixer's CP path, as the layout counts its runs."""
    if mixer.cp_kernels:
        return "state passing"
    return "convolution halo" if mixer.cp_halos else f"{mixer.cp_attention} attention"


def _bind_state_passing(mixer_module: nn.Module, mixer, layout, key: str) -> None:
    """The recurrence's kernels pass their states across ranks (``kernels.state_passing``; fla's own
    cp_context is not used), and its short convolutions read the previous piece's last inputs (a mixer of
    short convolutions alone, ``cp_halos``: those calls are its path, counted)."""
    from titan_ext.kernels import binding
    from titan_ext.kernels.state_passing import conv_across_ranks

    scope = _run_globals(type(mixer_module).forward)
    replacements = {scope[name]: _counted(_kernel_across_ranks(mixer, scope[name], recurrence, layout), layout,
                                          _path_of(mixer))
                    for name, recurrence in mixer.cp_kernels.items() if name in scope}
    replacements.update({scope[name]: _counted(conv_across_ranks(scope[name], layout), layout, _path_of(mixer))
                         for name in mixer.cp_halos if name in scope})
    if mixer.cp_contract == "transformers" and "causal_conv1d_fn" in scope:  # q, k and v in one convolution
        replacements[scope["causal_conv1d_fn"]] = _transformers_conv_across_ranks(layout)
    # each convolution needs the previous piece's last inputs: the ShortConvolution modules' kernel, and the
    # mixer's own call where it convolves q, k and v in one (fla's Gated DeltaNet without TP, transformers')
    convolutions = short_convolutions(mixer_module)
    for conv in [_run_globals(type(c).forward) for c in convolutions] + [scope]:
        kernel = conv.get("causal_conv1d")
        if kernel is not None and kernel not in replacements:
            replacements[kernel] = conv_across_ranks(kernel, layout)
    binding.bind(mixer_module, replacements, key=key)  # the mixer and its convolutions, in one binding


def _run_globals(method) -> dict:
    """The globals ``method``'s own code runs with, read through its decorators (transformers wraps a
    layer's ``forward``; a bound class's wrapper runs the rebound function: ``kernels.functions_run``)."""
    from titan_ext.kernels import functions_run

    *_, innermost = functions_run(method)
    return innermost.__globals__


def _kernel_across_ranks(mixer, kernel, recurrence, layout):
    """``state_passing.across_ranks`` of ``kernel``; a transformers mixer's on ``[B, T]`` rows, which with
    documents become the step's piece rows as one packed row with ``cu_seqlens`` (``models.packing``)."""
    from titan_ext.kernels.state_passing import across_ranks
    from titan_ext.kernels.transformers_kda import rows_as_packed
    from titan_ext.models.packing import packed_cu_seqlens

    across = across_ranks(kernel, recurrence, layout)
    if mixer.cp_contract != "transformers":
        return across

    @functools.wraps(kernel)
    def rows_across_ranks(q, k, v, g=None, beta=None, **kwargs):
        bounds = None if layout.local_document_positions is None else packed_cu_seqlens(layout)
        return rows_as_packed(across, q, k, v, g, beta, bounds, **kwargs)

    return rows_across_ranks


def _transformers_conv_across_ranks(layout):
    """transformers' ``causal_conv1d_fn`` (``[B, C, T]``) on this rank's pieces: titan_ext's convolution from
    the previous piece's last inputs (``state_passing.conv_across_ranks``), documents from the layout."""
    from titan_ext.kernels import conv
    from titan_ext.kernels.state_passing import conv_across_ranks
    from titan_ext.kernels.transformers_kda import causal_conv1d_fn
    from titan_ext.models.packing import packed_cu_seqlens

    halo = conv_across_ranks(conv.causal_conv1d, layout)

    def conv_across(hidden_states, weight, bias=None, activation=None, **kwargs):
        bounds = None if layout.local_document_positions is None else packed_cu_seqlens(layout)
        return causal_conv1d_fn(hidden_states, weight, bias, activation, kernel=halo, cu_seqlens=bounds)

    return conv_across


def _counted(fn, layout, path: str):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        layout.mark(path)
        return fn(*args, **kwargs)

    return counted


def gathered(attention_mixers) -> str:
    """What masked attention all-gathers, named for the mixers the model has (MLA's latents only with MLA)."""
    latents = any(mixer.cp_latents for mixer in attention_mixers)
    plain = any(not mixer.cp_latents for mixer in attention_mixers)
    return ", ".join(["attention over all-gathered keys and values"] * plain + ["MLA's over all-gathered latents"] * latents)


def attention_across_ranks(cp_mesh, layout, choice: CPChoice, gathers: str):
    """``attend(query, key, value, scale=None, window=None, dropout=0.0, sinks=None, softcap=None)`` of this
    rank's pieces (``[B, H, T_local, D]``) over the whole sequence: torch's ring attention, or where the
    attention is masked or rescored (``choice.masked_attention``) all-gathered keys and values (``gathers``: what
    the log names)."""
    if choice.masked_attention:
        logger.info(f"Applied context parallelism ({layout.world} ranks): {gathers} ({choice.masked_attention}: "
                    "masked beyond causality)")
        return functools.partial(cp_attention.gathered_sdpa, layout=layout)
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

    from titan_ext import compat
    from titan_ext.parallel import host_patches

    ring = cp_attention.RingSDPA(layout.per_rank)
    apply_cp_to_attention_module([ring], cp_mesh, "sdpa")
    host_patches.CP_ROTATE_METHOD.set(choice.rotate_method, compat.torch_cp_options().set_rotate_method)
    logger.info(f"Applied context parallelism ({layout.world} ranks): torch's ring attention "
                f"(rotate method {choice.rotate_method})")

    def attend(query, key, value, scale=None, window=None, dropout=0.0, **scores):
        if window or scores:  # masked or rescored attention: planned as all-gathered (ring_attention_blocker)
            raise ValueError(f"torch's ring attention runs causal attention only, not {window=} or {sorted(scores)}")
        groups = query.shape[1] // key.shape[1]
        if groups > 1:  # the ring's kernels take as many key/value heads as query heads (torchtitan repeats too)
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        query, key, value, scale, width = one_head_dim(query, key, value, scale)
        return ring(query, key, value, scale=scale)[..., :width]

    return attend


def one_head_dim(query, key, value, scale):
    """(query, key, value, scale, value head dim) with one head dim for all three, which the ring's kernels
    need (MLA's values are narrower than its queries and keys): the narrower side padded with zeros, which
    changes no score and no output within the value head dim; the scale is the unpadded one."""
    qk, v = query.shape[-1], value.shape[-1]
    scale = qk ** -0.5 if scale is None else scale
    if v < qk:
        value = F.pad(value, (0, qk - v))
    elif qk < v:
        query, key = F.pad(query, (0, v - qk)), F.pad(key, (0, v - qk))
    return query, key, value, scale, v


def _bind_transformers_attention(attention: nn.Module, layout, attend, key: str, replacements={}) -> None:
    """A transformers attention module reads ``attend`` from its modeling file's attention registry
    (and calls ``replacements`` for its own methods)."""
    from titan_ext.kernels import binding

    def across_ranks(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                     **kwargs):
        layout.mark("transformers attention")
        scores = {name: value for name, value in score_options(kwargs).items() if value is not None}
        window = {"window": sliding_window} if sliding_window else {}  # masked attention (ring_attention_blocker)
        return attend(query, key, value, scale=scaling, dropout=dropout, **window,
                      **scores).transpose(1, 2).contiguous(), None

    cls = type(attention)
    registry = (cls.__module__, "ALL_ATTENTION_FUNCTIONS")  # the modeling file's attention registry
    names = {registry[0]: {registry[1]: cp_attention.OneAttention(across_ranks)}}
    used = binding.bind(attention, replacements, key=key, names=names)
    if registry not in used:  # the attention would stay local to each rank: wrong, and silent
        raise HostChanged(
            "transformers", f"{cls.__qualname__}.forward no longer reads {registry[1]} from {registry[0]}, "
            "where context parallelism puts its attention"
        )


def _bind_gathered_latents(attention: nn.Module, method: str, layout, key: str) -> None:
    """MLA where masked: its ``method`` (``expand_kv(latent, rotary_key)``) expands every rank's latents,
    all-gathered (``cp_attention.gathered_latents``), into this rank's heads' keys and values over the whole
    sequence, which its attention reads (``cp_attention.per_document_sdpa``); nothing else is sent."""
    expand = getattr(type(attention), method, None)
    if expand is None:  # the keys and values would be this rank's alone: wrong, and silent
        raise HostChanged("transformers", f"{type(attention).__qualname__} no longer has {method}(latent, rotary_key), "
                          "whose latents context parallelism all-gathers")

    def expand_gathered(self, latent, rotary_key):
        return expand(self, *cp_attention.gathered_latents(latent, rotary_key, layout))

    def attend(query, key, value, scale=None, dropout=0.0, window=None, **scores):  # the whole sequence's keys, values
        return cp_attention.per_document_sdpa(query, key, value, layout, scale, window, dropout, **scores)

    _bind_transformers_attention(attention, layout, attend, key, {expand: expand_gathered})


_bindings = itertools.count()


def _binding_key() -> str:
    """A key of its own for each binding: the bound classes hold this job's group and layout (a process may
    run several jobs, and group names repeat once a process group is destroyed)."""
    return f"{_BINDING_PREFIX}{next(_bindings)}"


_BINDING_PREFIX = "context_parallel:"


def _bind_fla_attention(attention: nn.Module, layout, attend, key: str) -> None:
    """fla's softmax ``Attention``: its forward under CP is titan_ext's ``fla_attention_forward``."""
    from titan_ext.kernels import binding

    def forward(self, *args, **kwargs):
        layout.mark("fla attention")
        return cp_attention.fla_attention_forward(self, *args, layout=layout, attend=attend, **kwargs)

    binding.bind(attention, {type(attention).forward: forward}, key=key)


def short_convolutions(mixer: nn.Module) -> list[nn.Module]:
    """fla's ``ShortConvolution`` modules inside ``mixer`` (none when fla is not its library)."""
    if not type(mixer).__module__.startswith("fla."):
        return []
    from fla.modules import ShortConvolution

    return [m for m in mixer.modules() if isinstance(m, ShortConvolution)]
