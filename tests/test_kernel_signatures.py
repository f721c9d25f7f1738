"""Each portable kernel takes fla's signature whole, and refuses in one line what it does not honour.

For every portable row of the kernel modules' ``KERNELS`` whose target is an fla kernel function
(``fla.ops``/``fla.modules``; not a method, class or layer helper): the replacement's parameters equal fla's
(names, kinds, defaults, order), where fla's function is an autograd ``Function.apply`` its ``forward``'s;
where fla has ``**kwargs`` the replacement instead lists, keyword-only, the keys fla's body reads from it,
read here from fla's source (``kwargs.pop/get('key', default)``, ``'key' in kwargs``, ``kwargs['key']``, and
``**kwargs`` handed on to another fla function), with fla's default (``ABSENT`` for a presence test).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from titan_ext.compat import resolve
from titan_ext.kernels import conv, gla, signature
from titan_ext.kernels import kernel_rows as all_kernel_rows
from titan_ext.kernels.gated_delta import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from titan_ext.kernels.kda import chunk_kda, fused_recurrent_kda
from titan_ext.kernels.signature import ABSENT

_EXCEPTIONS = {
    # fla 0.6 deprecated fused_chunk_gla to ``(**kwargs)`` raising NotImplementedError; its GLA layers still call
    # it with chunk_gla's arguments (attn_mode="fused_chunk"), which the portable one takes and runs as chunk_gla
    "fla.ops.gla.fused_chunk:fused_chunk_gla": "fla.ops.gla.chunk:chunk_gla",
}


def kernel_rows():
    rows = []
    for row in all_kernel_rows():
        module, _, name = row.fla.partition(":")
        if "portable" not in row.paths or "." in name or not module.startswith(("fla.ops.", "fla.modules.")):
            continue
        if isinstance(resolve(row.fla), type):
            continue
        rows.append(pytest.param(row.fla, row.replacement, id=row.fla.split(":")[1]))
    return rows


def _signature(fn) -> list[inspect.Parameter]:
    """fla's parameters; for ``Function.apply`` (``*args, **kwargs``), its ``forward``'s after ``ctx``."""
    if inspect.ismethod(fn) and isinstance(fn.__self__, type) and issubclass(fn.__self__, torch.autograd.Function):
        return list(inspect.signature(fn.__self__.forward).parameters.values())[1:]
    return list(inspect.signature(fn).parameters.values())


def _literal(node):
    return ast.literal_eval(node) if node is not None else None


def kwargs_read(fn, seen=frozenset()) -> dict[str, object]:
    """The keys ``fn``'s body reads from its ``**kwargs`` -> fla's default for each (``ABSENT``: read only when
    present), following ``**kwargs`` handed on to functions the body names (imports inside it included)."""
    var = next((p.name for p in _signature(fn) if p.kind is p.VAR_KEYWORD), None)
    if var is None:
        return {}
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    local_imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                local_imports[alias.asname or alias.name] = (node.module, alias.name)
    keys: dict[str, object] = {}

    def read(key, default):
        if key not in keys or keys[key] is ABSENT:
            keys[key] = default

    is_var = lambda node: isinstance(node, ast.Name) and node.id == var  # noqa: E731
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_var(node.func.value):
            if node.func.attr in ("pop", "get") and isinstance(node.args[0], ast.Constant):
                has_default = len(node.args) > 1
                default = _literal(node.args[1]) if has_default else (None if node.func.attr == "get" else ABSENT)
                read(node.args[0].value, default)
        elif isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) and any(
                isinstance(op, ast.In) for op in node.ops) and any(is_var(c) for c in node.comparators):
            read(node.left.value, ABSENT)
        elif isinstance(node, ast.Subscript) and is_var(node.value) and isinstance(node.slice, ast.Constant):
            read(node.slice.value, ABSENT)
        elif isinstance(node, ast.Call) and any(k.arg is None and is_var(k.value) for k in node.keywords):
            callee = node.func.id if isinstance(node.func, ast.Name) else None
            if callee in local_imports:
                target = getattr(importlib.import_module(local_imports[callee][0]), local_imports[callee][1])
            else:
                target = inspect.unwrap(fn).__globals__.get(callee)
            if callable(target) and target not in seen:
                for key, default in kwargs_read(target, seen | {fn}).items():
                    read(key, default)
    return keys


def expected_parameters(fla_fn):
    named = [p for p in _signature(fla_fn) if p.kind is not p.VAR_KEYWORD]
    return ([(p.name, p.kind, p.default) for p in named], kwargs_read(fla_fn))


def _same_default(a, b) -> bool:
    return a is b or (type(a) is type(b) and a == b)


@pytest.mark.parametrize(("fla_target", "replacement"), kernel_rows())
def test_each_portable_kernel_takes_fla_s_parameters(fla_target, replacement):
    fla_fn = resolve(_EXCEPTIONS.get(fla_target, fla_target))
    named, from_kwargs = expected_parameters(fla_fn)
    ours = list(inspect.signature(replacement).parameters.values())
    assert not any(p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL) for p in ours), f"{replacement} swallows arguments"
    positional = [(p.name, p.kind, p.default) for p in ours if p.kind is not p.KEYWORD_ONLY]
    assert [(n, k) for n, k, _ in positional] == [(n, k) for n, k, _ in named], replacement
    for (name, _, default), (_, _, fla_default) in zip(positional, named):
        assert _same_default(default, fla_default), f"{replacement}: {name}={default!r}, fla's {fla_default!r}"
    keyword_only = {p.name: p.default for p in ours if p.kind is p.KEYWORD_ONLY}
    fla_keyword_only = {p.name: p.default for p in _signature(fla_fn) if p.kind is p.KEYWORD_ONLY}
    assert keyword_only.keys() == (from_kwargs.keys() | fla_keyword_only.keys()), replacement
    for name, default in {**from_kwargs, **fla_keyword_only}.items():
        assert _same_default(keyword_only[name], default), f"{replacement}: {name}={keyword_only[name]!r}, fla's {default!r}"


def test_the_keys_read_from_kwargs_are_read_from_fla_s_source():
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule as fla_gdn
    from fla.ops.kda.chunk import chunk_kda as fla_kda
    from fla.modules.causal_conv1d.ops import causal_conv1d as fla_conv

    assert kwargs_read(fla_gdn) == {"transpose_state_layout": ABSENT, "head_first": ABSENT, "chunk_size": 64,
                                    "use_gate_in_kernel": False, "A_log": None, "dt_bias": None}
    assert kwargs_read(fla_kda) == {"transpose_state_layout": ABSENT, "A_log": None, "dt_bias": None, "chunk_size": 64}
    assert kwargs_read(fla_conv) == {"seq_idx": None}  # read by the mix backend, and the cuda one it hands **kwargs


# --- fla's deprecated alias and its checks, read exactly as fla reads them ---------------------------------

def gdn_inputs(B=1, T=20, H=2, HV=2, K=8, V=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, v = torch.randn(B, T, H, K, generator=g), torch.randn(B, T, HV, V, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    return q, k, v, F.logsigmoid(torch.randn(B, T, HV, generator=g)), torch.rand(B, T, HV, generator=g), \
        torch.randn(B, HV, V, K, generator=g)


def kda_inputs(B=1, T=20, H=2, K=8, V=4, seed=0):
    q, k, v, _, beta, h0 = gdn_inputs(B, T, H, H, K, V, seed)
    return q, k, v, F.logsigmoid(torch.randn(B, T, H, K, generator=torch.Generator().manual_seed(seed + 1))), beta, h0


STATEFUL = {
    "chunk_gated_delta_rule": (chunk_gated_delta_rule, gdn_inputs),
    "fused_recurrent_gated_delta_rule": (lambda q, k, v, g, b, **kw: fused_recurrent_gated_delta_rule(q, k, v, g, beta=b, **kw),
                                         gdn_inputs),
    "chunk_kda": (chunk_kda, kda_inputs),
    "fused_recurrent_kda": (fused_recurrent_kda, kda_inputs),
    "fused_recurrent_gla": (lambda q, k, v, g, b, **kw: gla.fused_recurrent_gla(q, k, torch.cat([v, v], -1), g, **kw),
                            lambda: (lambda q, k, v, g, b, h0: (q, k, v, F.logsigmoid(torch.randn_like(q)), b,
                                                                torch.cat([h0, h0], 2)))(*gdn_inputs())),
}


@pytest.mark.parametrize("name", STATEFUL)
def test_transpose_state_layout_is_fla_s_alias_of_state_v_first(name):
    """fla 0.6 renamed ``transpose_state_layout`` to ``state_v_first``: passing it means the [V, K] state
    (with fla's DeprecationWarning), and passing both is an error. It used to be swallowed, and the state
    read as [K, V]."""
    kernel, inputs = STATEFUL[name]
    q, k, v, g, beta, h0 = inputs()
    v_first = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        alias = kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, transpose_state_layout=True)
    torch.testing.assert_close(alias, v_first)
    with pytest.raises(ValueError, match="Cannot pass both `state_v_first` and the deprecated"):
        kernel(q, k, v, g, beta, state_v_first=True, transpose_state_layout=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        k_first = kernel(q, k, v, g, beta, initial_state=h0.transpose(-1, -2).contiguous(), output_final_state=True,
                         transpose_state_layout=False)
    torch.testing.assert_close(k_first[0], v_first[0])
    torch.testing.assert_close(k_first[1].transpose(-1, -2), v_first[1])


@pytest.mark.parametrize(("kernel", "inputs", "sizes", "refused"), [
    (chunk_gated_delta_rule, gdn_inputs, (16, 32, 64), (8, 128, 48)),
    (chunk_kda, kda_inputs, (32, 64), (16, 128)),
], ids=["chunk_gated_delta_rule", "chunk_kda"])
def test_chunk_size_is_checked_as_fla_checks_it_and_changes_nothing_else(kernel, inputs, sizes, refused):
    q, k, v, g, beta, h0 = inputs(T=70)
    results = [kernel(q, k, v, g, beta, initial_state=h0, output_final_state=True, state_v_first=True, chunk_size=c)
               for c in sizes]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-5)
    for size in refused:
        with pytest.raises(ValueError, match=f"`chunk_size` must be .* got {size}"):
            kernel(q, k, v, g, beta, chunk_size=size)


def test_refusals_are_one_line_value_errors_naming_the_argument_and_the_kernel():
    q, k, v, g, beta, h0 = gdn_inputs()
    cases = [
        (lambda: chunk_gated_delta_rule(q, k, v, g, beta, cp_context=object()), "chunk_gated_delta_rule", "cp_context"),
        (lambda: chunk_kda(*kda_inputs()[:5], cp_context=object()), "chunk_kda", "cp_context"),
        (lambda: chunk_kda(*kda_inputs()[:5], return_intermediate_states=True), "chunk_kda",
         "return_intermediate_states"),
        (lambda: fused_recurrent_kda(*kda_inputs()[:5], use_gate_in_kernel=True), "fused_recurrent_kda",
         "use_gate_in_kernel"),
        (lambda: conv.causal_conv1d(torch.randn(1, 5, 4), None), "causal_conv1d", "weight=None"),
        (lambda: conv.causal_conv1d(torch.randn(1, 5, 4), torch.randn(4, 3), cp_context=object()), "causal_conv1d",
         "cp_context"),
    ]
    for call, kernel, argument in cases:
        with pytest.raises(ValueError) as error:
            call()
        message = str(error.value)
        assert "\n" not in message and message.startswith(kernel) and argument in message and "off CUDA" in message


def test_fla_s_own_argument_errors_are_kept():
    q, k, v, g, beta, h0 = gdn_inputs()
    with pytest.raises(DeprecationWarning, match="head_first has been removed"):
        chunk_gated_delta_rule(q, k, v, g, beta, head_first=False)
    with pytest.raises(ValueError, match="requires `use_beta_sigmoid_in_kernel=True`"):
        chunk_gated_delta_rule(q, k, v, g, beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="A_log must be provided"):
        chunk_gated_delta_rule(q, k, v, g, beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="number of initial states"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.cat([h0, h0]), cu_seqlens=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="lower_bound` must be in the safe range"):
        chunk_kda(*kda_inputs()[:5], use_gate_in_kernel=True, safe_gate=True, lower_bound=-6.0, A_log=torch.zeros(2))
    with pytest.raises(ValueError, match="Unsupported backend"):
        conv.causal_conv1d(torch.randn(1, 5, 4), torch.randn(4, 3), backend="cudnn")
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_cache'"):  # fla never reads it: not swallowed
        chunk_gated_delta_rule(q, k, v, g, beta, use_cache=False)


def test_absent_is_one_object_with_a_plain_repr():
    import copy
    import pickle

    assert repr(ABSENT) == "ABSENT" and pickle.loads(pickle.dumps(ABSENT)) is ABSENT and copy.deepcopy(ABSENT) is ABSENT
    assert signature.state_v_first(True, ABSENT) is True
