"""A ``TPPlan`` translated from a transformers causal LM's own tensor-parallel plan.

transformers 5.x configs carry ``base_model_tp_plan``: a strategy string per module of a
decoder layer (``"layers.*.self_attn.q_proj": "colwise"``), written for HF's own TP, which
keeps the residual stream replicated. The translation keeps HF's choice of modules and lays
them out the titan_ext way (sequence parallel, loss parallel, Float8), so that one block costs
the Megatron minimum:

- ``colwise`` -> ``self.colwise()``: the output stays local, sharded by head or feature, as in HF.
- ``rowwise`` -> ``self.out_proj()``: it writes to the residual stream, so it reduce-scatters to
  the sequence-sharded residual under SP (all-reduces without), where HF always all-reduces.
- the module parenting colwise projections (``self_attn``, ``mlp``) -> ``self.gather(...)``: one
  all-gather of its input from the residual, passed by keyword or positionally as its block does.
- ``replicated_with_grad_allreduce`` on a norm inside attention (Qwen3's ``q_norm``) ->
  ``NormParallel(Shard(-2), use_local_output=True)``: HF keeps the weight whole on every rank
  and all-reduces its gradient with a hook, because each rank's norm sees only its own heads.
  Here the weight is a replicated DTensor and the norm's input is declared sharded on the head
  dimension (-2), so the forward needs no collective and DTensor sums the weight's gradient
  (partial per rank) over the TP ranks: the same all-reduce, derived rather than hooked.
- ``moe_tp_experts`` on a MoE block's stacked experts (with ``packed_colwise``/``rowwise`` on their weights) ->
  the experts placed by ``titan_ext.parallel.expert_parallel`` (``experts_placed``): without EP each expert's
  intermediate dim split over the TP ranks as HF splits it (the gate rows and the up rows of the packed
  ``gate_up_proj`` each split alike), under EP by expert parallelism (over the TP ranks' token shares with
  torchtitan's ETP=1, split over TP too with ETP=TP); the block around them ``self.moe_block()`` (input gathered,
  output reduced from the ranks' partial sums) and its router ``self.router()`` (replicated).
  A shared expert in the block (Qwen3-Next's ``shared_expert``, its linears in the HF plan; Qwen2-MoE's, whose
  linears take the plan's dense-FFN entries ``mlp.gate_proj``...) is a dense FFN on the block's gathered input: ``colwise`` as above, its ``rowwise`` output ``self.shared_out_proj()`` (this
  rank's partial share, summed with the routed experts' by the block); a one-output linear beside it that the
  HF plan leaves out (``shared_expert_gate``) ``self.shared_gate()`` (replicated).
- ``mla_kv_a_proj`` on an MLA attention's key-latent projection (DeepSeek-V2's ``kv_a_proj_with_mqa``) ->
  what titan_ext's MLA mixer does (``titan_ext.models.mixers.mla``): the projection replicated, its output this
  rank's plain tensor whose shared rotary key (the config's last ``qk_rope_head_dim`` columns) sums its gradient
  over the ranks (``SharedKeyLatent``, HF's ``MlaKvAProjParallel``); the attention's down-projections and their
  norms that the HF plan leaves out (``q_a_proj``, ``q_a_layernorm``, ``kv_a_layernorm``: HF's TP keeps them whole)
  replicated, on the attention's input gathered in high precision (no Float8 colwise linears).
- parameter-holding norms directly in a block that the HF plan leaves out (``input_layernorm``,
  ``post_attention_layernorm``, Gemma's ``pre_``/``post_feedforward_layernorm``) -> ``self.norm()``.

The model-level plan is the base class's, not translated: the embedding is vocab-sharded
rowwise (what HF's ``embedding_rowwise``, which transformers 5.x adds for ``embed_tokens``,
does), the final norm runs on the residual layout, and ``lm_head`` is colwise: with loss
parallel off it gathers the logits (HF's ``colwise_gather_output``), with it on they stay
vocab-sharded (``Shard(-1)``) for ``loss_parallel()``.

Any other strategy (expert parallel, ``packed_colwise``, ``colwise_gather_output`` inside a block,
``local_params``, ...) is a one-line ``ValueError``: such a model needs a registered plan.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from model_plans.base import IfPresent, Plan, TPPlan, experts_placed
from model_plans.styles import NormParallel, PlaceParameters, SharedKeyLatent

_TRANSLATED = ("colwise", "rowwise", "replicated_with_grad_allreduce", "moe_tp_experts", "mla_kv_a_proj")
"""The block strategies with a titan_ext counterpart (see the module docstring)."""

_PLACING_ROLES = ("colwise", "rowwise", "head_norm", "residual_norm", "router", "experts", "shared_rowwise",
                  "shared_gate", "replicated", "mla_kv_a_proj", "latent_linear", "latent_norm")
"""Roles whose style places a module's parameters (``gather`` only lays out an input)."""


@dataclass(frozen=True)
class BlockEntry:
    """What a module of a decoder layer does under TP.

    ``role``: ``gather``, ``colwise``, ``rowwise``, ``head_norm``, ``residual_norm``, ... (``HFTPPlan._style``);
    ``keyword``: for ``gather``, the keyword the block passes the input by (None: positionally);
    ``high_precision``: for ``gather``, an input replicated projections read (MLA's), never Float8's.
    """

    role: str
    keyword: str | None = None
    high_precision: bool = False


class HFTPPlan(TPPlan):
    """Base of the plans ``hf_plan_class`` generates; the block plan is data (``entries``)."""

    translated_from_hf = True
    """For ``plan_source``: the job's log says the plan came from the model's own HF plan."""
    model_type = ""
    entries: tuple[tuple[str, BlockEntry], ...] = ()
    optional: frozenset[str] = frozenset()
    """Modules only some blocks have (their entries are ``IfPresent``)."""
    per_block: tuple[tuple[tuple[str, BlockEntry], ...], ...] = ()
    """Each block's own entries, by index, where blocks differ in what one module is (a hybrid's dense and MoE
    FFNs under one name); else empty, and every block takes ``entries``."""

    rope_width: int = 0
    """The config's ``qk_rope_head_dim``: the rotary key's width in an MLA key-latent projection's output."""

    kept_whole: tuple[str, ...] = ()
    """Model-level modules beside the embedding, the layers, the final norm and the head, kept whole on every
    rank (GPT-2's position embedding)."""

    def model_plan(self) -> Plan:
        return {**super().model_plan(), **{name: self.replicated() for name in self.kept_whole}}

    def block_plan(self, index: int | None = None) -> Plan:
        plan = {}
        entries = self.per_block[index] if self.per_block and index is not None else self.entries
        for module, entry in entries:
            if entry.role == "experts":
                plan[module] = experts_placed(self.options)
                continue
            style = self._style(module, entry)
            plan[module] = IfPresent(style) if module in self.optional else style
        other = dict(self.layer_mixers).get(index)  # a hybrid's layer of another token mixer: its entries too
        return plan if other is None else {**plan, **other(self)}

    def _style(self, module: str, entry: BlockEntry) -> ParallelStyle:
        if entry.role == "gather":
            if entry.high_precision:
                return self._gather_high_precision(entry.keyword)
            return self.gather(module, entry.keyword)[module]
        styles = {"colwise": self.colwise, "rowwise": self.out_proj, "head_norm": self.head_norm,
                  "replicated": self.replicated, "mla_kv_a_proj": lambda: SharedKeyLatent(self.rope_width),
                  "latent_linear": lambda: PlaceParameters(Replicate()),
                  "latent_norm": lambda: NormParallel(Replicate()),
                  "residual_norm": self.norm, "moe_block": self.moe_block, "router": self.router,
                  "shared_rowwise": self.shared_out_proj, "shared_gate": self.shared_gate}
        return styles[entry.role]()

    def _gather_high_precision(self, keyword: str | None) -> PrepareModuleInput:
        """An input all-gathered from the residual, never as Float8 (replicated projections read it)."""
        if keyword is None:
            return PrepareModuleInput(input_layouts=(self.activation,), desired_input_layouts=(Replicate(),))
        return PrepareModuleInput(input_kwarg_layouts={keyword: self.activation},
                                  desired_input_kwarg_layouts={keyword: Replicate()})

    def head_norm(self) -> NormParallel:
        """A norm on this rank's heads: a replicated weight whose gradient DTensor sums over the TP ranks."""
        return NormParallel(Shard(-2), use_local_output=True)


def hf_plan_class(model: nn.Module, other_mixers: Mapping[int, tuple[str, ...]] = {},
                  layers: str | None = None) -> type[TPPlan] | None:
    """The ``TPPlan`` subclass translated from ``model.config.base_model_tp_plan``.

    ``model`` is a transformers causal LM, possibly on the meta device. A block's module whose entries do not
    translate, or that the HF plan leaves out, is kept whole on every rank; a layout the translation does not
    cover otherwise is a one-line ``ValueError`` naming the model type and the module.
    ``other_mixers``: block index -> the paths of token mixers whose entries come from elsewhere
    (``TPPlan.layer_mixers``: a hybrid's layers); the HF plan's entries under it are not translated.
    ``layers``: the layer stack's path in the base model, for a model without an HF plan (None: no plan then).
    """
    config = model.config
    hf_plan = getattr(config, "base_model_tp_plan", None) or {}
    if not hf_plan and layers is None:
        return None
    model_type = config.model_type
    base = model.base_model
    prefix = "" if base is model else model.base_model_prefix
    embeddings = _name_in(base, base.get_input_embeddings(), model_type, "input embeddings")
    if any(".*." in key for key in hf_plan):
        layers, block_plan = _split_plan(hf_plan, embeddings, model_type, prefix)
    else:  # a plan of model-level entries only, or none: every block module kept whole but its norms
        _check_model_level(hf_plan, embeddings, model_type, prefix)
        block_plan = {}
    final_norm, kept_whole = _model_level(base, embeddings, layers, model_type, prefix)
    stack = f"{_join(prefix, layers)}.*"
    blocks = list(base.get_submodule(layers))
    rope_width = getattr(config, "qk_rope_head_dim", None) or 0
    per_block = [_block_entries(block, block_plan, model_type, stack, other_mixers.get(index, ()), rope_width)
                 for index, block in enumerate(blocks)]
    merged = _merge(per_block)
    entries, optional = merged if merged is not None else (per_block[0], set())
    name = _class_name(model_type)
    attributes = dict(
        __module__=__name__,
        __qualname__=name,
        __doc__=f"TP plan translated from {model_type}'s base_model_tp_plan (model_plans.hf_plan).",
        model_type=model_type,
        embeddings=_join(prefix, embeddings),
        final_norm=_join(prefix, final_norm),
        kept_whole=tuple(_join(prefix, name) for name in kept_whole),
        lm_head=_name_in(model, model.get_output_embeddings(), model_type, "output embeddings (lm_head)"),
        layers=_join(prefix, layers),
        entries=tuple(entries.items()),
        optional=frozenset(optional),
        per_block=() if merged is not None else tuple(tuple(block.items()) for block in per_block),
        rope_width=rope_width,
    )
    return type(name, (HFTPPlan,), attributes)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    """Whether ``path`` is one of ``roots`` or lies beneath one."""
    return any(path == root or path.startswith(f"{root}.") for root in roots)


def _join(*parts: str) -> str:
    return ".".join(part for part in parts if part)


def _class_name(model_type: str) -> str:
    """``qwen3`` -> ``Qwen3HFTPPlan``, ``gemma3_text`` -> ``Gemma3TextHFTPPlan``."""
    return "".join(part[:1].upper() + part[1:] for part in model_type.replace("-", "_").split("_")) + "HFTPPlan"


def _register_hint(model_type: str) -> str:
    return f"register a plan with @model_plans.register_tp_plan({model_type!r})"


def _untranslated(model_type: str, where: str, strategy: str, why: str = "") -> ValueError:
    why = f" ({why})" if why else ""
    return ValueError(
        f"{model_type}: HF TP strategy {strategy!r} on {where} has no titan_ext translation{why}; "
        f"{_register_hint(model_type)}"
    )


def _name_in(root: nn.Module, module: nn.Module | None, model_type: str, what: str) -> str:
    names = [name for name, candidate in root.named_modules() if module is not None and candidate is module]
    if names:
        return names[0]
    raise ValueError(f"{model_type}: {type(root).__name__} has no {what}, so it is not a causal LM TP can split")


def _split_plan(hf_plan: dict[str, str], embeddings: str, model_type: str, prefix: str) -> tuple[str, dict[str, str]]:
    """(the layer stack's name, its per-block entries) from ``layers.*.<path>`` keys."""
    _check_model_level(hf_plan, embeddings, model_type, prefix)
    stacks, block_plan = set(), {}
    for key, strategy in hf_plan.items():
        if ".*." in key:
            stack, _, path = key.partition(".*.")
            stacks.add(stack)
            block_plan[path] = strategy
    if len(stacks) != 1:
        raise ValueError(
            f"{model_type}: base_model_tp_plan names {len(stacks)} layer stacks {sorted(stacks)}, the translation "
            f"handles one; {_register_hint(model_type)}"
        )
    return stacks.pop(), block_plan


def _check_model_level(hf_plan: dict[str, str], embeddings: str, model_type: str, prefix: str) -> None:
    """A model-level entry translates only if it is what the base class does anyway: a vocab-sharded embedding."""
    for key, strategy in hf_plan.items():
        if ".*." not in key and not (key == embeddings and strategy == "embedding_rowwise"):
            raise _untranslated(model_type, _join(prefix, key), strategy, "the model-level plan is titan_ext's own")


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _is_norm(module: nn.Module) -> bool:
    return "norm" in type(module).__name__.lower()


def _model_level(base: nn.Module, embeddings: str, layers: str, model_type: str, prefix: str) -> tuple[str, list[str]]:
    """(the final norm, the other modules holding parameters) beside the embedding and the layers, in the module
    holding the layers: the final norm is the last module of vector parameters (or, without one, of none: Olmo's);
    the others (GPT-2's position embedding, BLOOM's embedding norm) are kept whole on every rank."""
    owner = _parent(layers)
    others = [(_join(owner, name), child)
              for name, child in (base.get_submodule(owner) if owner else base).named_children()
              if _join(owner, name) not in (embeddings, layers) and (_is_norm(child) or _holds_parameters(child))]
    norms = [name for name, child in others
             if _holds_parameters(child) and all(p.dim() == 1 for p in child.parameters())]
    norms = norms or [name for name, child in others if _is_norm(child)]
    if not norms:
        raise ValueError(f"{model_type}: found no final norm beside the embedding and the layers; "
                         f"{_register_hint(model_type)}")
    return norms[-1], [name for name, child in others if name != norms[-1] and _holds_parameters(child)]


def _block_entries(block: nn.Module, block_plan: dict[str, str], model_type: str, stack: str,
                   other_mixers: tuple[str, ...] = (), rope_width: int = 0) -> dict[str, BlockEntry]:
    """One block's entries, in module order (none under ``other_mixers``, planned elsewhere).

    Each of the block's modules is translated from its own HF entries; one whose entries do not translate,
    or that the HF plan leaves out, is kept whole on every rank (``replicated``, as HF's own TP leaves it),
    except a MoE block, which expert placement needs translated.
    """
    block_plan = {path: s for path, s in block_plan.items() if not _under(path, other_mixers)}
    by_child: dict[str, dict[str, str]] = {}
    for path, strategy in block_plan.items():
        by_child.setdefault(path.partition(".")[0], {})[path] = strategy
    named, groups, whole = {}, set(), []
    for child, child_plan in by_child.items():
        try:
            child_named = _translated(block, child_plan, model_type, stack, rope_width)
            child_groups = _groups(child_named, model_type, stack)
            _check_coverage(block, child_named, child_groups, child, model_type, stack)
        except ValueError:
            if _holds_experts(block, child):
                raise
            whole.append(child)
            continue
        named.update(child_named)
        groups |= child_groups
    residual_norms = {
        name
        for name, child in block.named_children()
        if name not in named and name not in groups and _is_norm(child) and _holds_parameters(child)
    }
    placed = [*named, *groups, *residual_norms, *whole, *other_mixers]
    whole += [name for name, child in block.named_children()
              if _holds_parameters(child) and not any(_under(p, (name,)) for p in placed)]
    entries = {}
    latent_groups = {_parent(p) for p, e in named.items() if e.role == "mla_kv_a_proj"}
    for name, _ in block.named_modules():
        if name in groups:
            entries[name] = BlockEntry("gather", _input_keyword(block, name, model_type, stack), name in latent_groups)
        elif name in named:
            entries[name] = named[name]
        elif name in residual_norms:
            entries[name] = BlockEntry("residual_norm")
        elif name in whole:
            entries[name] = BlockEntry("replicated")
    return entries


def _holds_experts(block: nn.Module, child: str) -> bool:
    """Whether the block's module ``child`` is (or holds) a MoE block, whose experts expert placement needs."""
    try:
        module = block.get_submodule(child)
    except AttributeError:
        return False
    return any(name.rpartition(".")[2] == "experts" for name, _ in module.named_modules())


def _translated(block: nn.Module, block_plan: dict[str, str], model_type: str, stack: str,
                rope_width: int = 0) -> dict[str, BlockEntry]:
    """The HF entries this block has, as roles. An entry naming nothing here is skipped, as HF does."""
    named = {}
    experts = [path for path, strategy in block_plan.items() if strategy == "moe_tp_experts"]
    for path in experts:
        named.update(_moe_entries(block, path, block_plan, model_type, f"{stack}.{path}"))
    for path, strategy in block_plan.items():
        where = f"{stack}.{path}"
        if path in named or any(path.startswith(f"{e}.") for e in experts):
            continue  # the MoE block's own entries; the stacked experts' weights: placed with them
        try:
            module = block.get_submodule(path)
        except AttributeError:
            try:
                block.get_parameter(path)
            except AttributeError:
                continue
            raise _untranslated(model_type, where, strategy, "it names a parameter, not a module") from None
        if strategy not in _TRANSLATED:
            raise _untranslated(model_type, where, strategy)
        if strategy == "replicated_with_grad_allreduce":
            if not _is_norm(module):
                raise _untranslated(model_type, where, strategy, "only per-head norms inside attention translate")
            named[path] = BlockEntry("head_norm")
        elif strategy == "mla_kv_a_proj" and not rope_width:
            raise _untranslated(model_type, where, strategy, "the config has no qk_rope_head_dim, the width of the "
                                "rotary key every head shares")
        else:
            if not isinstance(module, nn.Linear):
                raise _untranslated(model_type, where, strategy, f"{type(module).__name__} is not a linear")
            named[path] = BlockEntry(strategy)
    for path in [p for p, entry in named.items() if entry.role == "mla_kv_a_proj"]:
        named.update(_latent_projections(block, _parent(path), named))
    return named


def _latent_projections(block: nn.Module, attention: str, named: dict[str, BlockEntry]) -> dict[str, BlockEntry]:
    """An MLA attention's modules the HF plan leaves out (its down-projections and their norms, kept whole by HF's
    TP): replicated linears and norms. Anything else stays unplaced (the coverage check keeps the attention whole)."""
    found = {}
    for name, module in block.get_submodule(attention).named_modules():
        path = _join(attention, name)
        if path in named or next(module.parameters(recurse=False), None) is None:
            continue
        if isinstance(module, nn.Linear):
            found[path] = BlockEntry("latent_linear")
        elif all(p.dim() == 1 for p in module.parameters()) and not list(module.children()):
            found[path] = BlockEntry("latent_norm")
    return found


def _moe_entries(block: nn.Module, path: str, block_plan: dict[str, str], model_type: str,
                 where: str) -> dict[str, BlockEntry]:
    """A MoE block holding a router and the stacked experts at ``path``, and maybe a shared expert (its
    colwise/rowwise linears in the HF plan) with a one-output gate; nothing else with parameters."""
    try:
        block.get_submodule(path)
    except AttributeError:
        return {}
    owner_path = _parent(path)
    owner = block.get_submodule(owner_path)
    entries = {owner_path: BlockEntry("moe_block"), path: BlockEntry("experts")}
    others = []
    for name, child in owner.named_children():
        child_path = _join(owner_path, name)
        if child_path == path or not _holds_parameters(child):
            continue
        if hasattr(child, "top_k"):
            entries[child_path] = BlockEntry("router")
        elif isinstance(child, nn.Linear) and child.out_features == 1 and child_path not in block_plan:
            entries[child_path] = BlockEntry("shared_gate")
        elif shared := _shared_expert_entries(child, child_path, block_plan):
            entries.update(shared)
        else:
            others.append(name)
    if others or sum(e.role == "router" for e in entries.values()) != 1:
        raise _untranslated(model_type, where, "moe_tp_experts",
                            f"its block holds {others} beside the experts and one router, which the HF plan does not "
                            "place as a shared expert (colwise linears and one rowwise output)")
    return entries


def _shared_expert_entries(child: nn.Module, child_path: str, block_plan: dict[str, str]) -> dict[str, BlockEntry]:
    """A dense FFN whose every linear the HF plan places: colwise ones, then one rowwise output. Its linears'
    entries are its own (Qwen3-Next's ``mlp.shared_expert.gate_proj``) or, where the HF plan has none of them
    (Qwen2-MoE's), those of the model's dense FFN at the MoE block's path (``mlp.gate_proj``)."""
    relative = [n for n, m in child.named_modules() if isinstance(m, nn.Linear)]
    owners = {_parent(n) for n, _ in child.named_parameters()}
    if not relative or owners != set(relative):
        return {}
    own = {_join(child_path, n): block_plan.get(_join(child_path, n)) for n in relative}
    if not any(own.values()):
        own = {_join(child_path, n): block_plan.get(_join(_parent(child_path), n)) for n in relative}
    strategies = list(own.values())
    if set(strategies) != {"colwise", "rowwise"} or strategies.count("rowwise") != 1:
        return {}
    return {p: BlockEntry("colwise" if r == "colwise" else "shared_rowwise") for p, r in own.items()}


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _groups(named: dict[str, BlockEntry], model_type: str, stack: str) -> set[str]:
    """The modules that parent colwise projections; each needs one rowwise output and gets one input gather."""
    shared = {_parent(p) for p, e in named.items() if e.role == "shared_rowwise"}  # inside a gathered MoE block
    colwise = {_parent(p) for p, e in named.items() if e.role == "colwise"} - shared
    rowwise = {_parent(p) for p, e in named.items() if e.role == "rowwise"}
    for path, entry in named.items():
        if entry.role == "head_norm" and _parent(path) not in colwise:
            raise _untranslated(model_type, f"{stack}.{path}", "replicated_with_grad_allreduce",
                                "only per-head norms inside attention translate")
    unpaired = sorted(colwise ^ rowwise)
    if "" in colwise | rowwise or unpaired:
        where = unpaired[0] if unpaired else ""
        raise ValueError(
            f"{model_type}: {_join(stack, where)} does not pair colwise projections with a rowwise output inside one "
            f"module, which the translation needs for one input gather and one output reduction; "
            f"{_register_hint(model_type)}"
        )
    return colwise


def _check_coverage(block: nn.Module, named: dict[str, BlockEntry], groups: set[str], child: str, model_type: str,
                    stack: str) -> None:
    """Every parameter under the block's module ``child`` must be placed by its translated entries."""
    placed = {name for name, entry in named.items() if entry.role in _PLACING_ROLES}
    try:
        module = block.get_submodule(child)
    except AttributeError:
        return
    for param_name, _ in module.named_parameters():
        owner = _parent(_join(child, param_name))
        if owner not in placed and not any(_under(owner, (e,)) for e, entry in named.items() if entry.role == "experts"):
            raise ValueError(
                f"{model_type}: {_join(stack, owner)} holds parameters that the HF plan does not place and that are "
                f"not a residual norm; {_register_hint(model_type)}"
            )


def _input_keyword(block: nn.Module, path: str, model_type: str, stack: str) -> str | None:
    """How the owner of ``path`` passes it the residual: the keyword (HF attention: ``hidden_states=``),
    or None when positionally (HF MLPs). Read from the owner's source, since a gather laid out for the
    other convention would silently compute on a sequence shard."""
    owner = block.get_submodule(_parent(path))
    attribute = path.rpartition(".")[2]
    first_parameter = next(iter(inspect.signature(block.get_submodule(path).forward).parameters), None)
    conventions = {_convention(call, first_parameter) for call in _calls(type(owner), attribute)}
    if len(conventions) != 1 or None in conventions:
        raise ValueError(
            f"{model_type}: cannot tell from {type(owner).__name__}'s source how it passes its input to "
            f"{stack}.{path} (needed: calls passing it alone positionally, or by keyword {first_parameter!r}); "
            f"{_register_hint(model_type)}"
        )
    return conventions.pop() or None


@functools.cache
def _calls(cls: type, attribute: str) -> tuple[ast.Call, ...]:
    """The ``self.<attribute>(...)`` calls of the most derived class (of ``cls`` and its module bases)
    whose source makes any: a subclass that calls the module itself overrides how its bases do."""
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            break
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        calls = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == attribute
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "self"
        ]
        if calls:
            return tuple(calls)
    return ()


def _convention(call: ast.Call, first_parameter: str | None) -> str | None:
    """``""`` for a sole positional input, its keyword if passed by name, else None (``*args``, ``**kw``,
    several positional inputs: ``self.gather`` lays out one)."""
    if call.args:
        return "" if len(call.args) == 1 and not isinstance(call.args[0], ast.Starred) else None
    if first_parameter in {keyword.arg for keyword in call.keywords}:
        return first_parameter
    return None


def _merge(per_block: list[dict[str, BlockEntry]]) -> tuple[dict[str, BlockEntry], set[str]] | None:
    """One plan for every block: entries some blocks lack become optional; None where blocks disagree (a
    hybrid's dense and MoE FFNs under one name: each block then keeps its own entries)."""
    merged, counts = {}, {}
    for entries in per_block:
        for path, entry in entries.items():
            if merged.setdefault(path, entry) != entry:
                return None
            counts[path] = counts.get(path, 0) + 1
    return merged, {path for path, count in counts.items() if count < len(per_block)}
