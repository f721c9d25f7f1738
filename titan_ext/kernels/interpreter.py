"""Triton's interpreter, bridged to run fla's kernels on the CPU (``host_patches.INTERPRETER``)."""

from __future__ import annotations

import ast

from triton.runtime.interpreter import ASTTransformer


class LoopVariablesAsTensors(ASTTransformer):
    """The interpreter's rewrite of a kernel's source, plus: each ``for`` loop's variable becomes an
    interpreter tensor at the top of the body (compiled Triton gives loop variables tensor methods such
    as ``.to()``; the interpreter leaves them Python ints)."""

    def visit_For(self, node: ast.For) -> ast.For:
        node = self.generic_visit(node)
        if isinstance(node.target, ast.Name):
            name = node.target.id
            as_tensor = ast.Call(
                func=ast.Attribute(value=ast.Name(id="interpreter_semantic", ctx=ast.Load()), attr="to_tensor",
                                   ctx=ast.Load()),
                args=[ast.Name(id=name, ctx=ast.Load()), ast.Constant(value=False)], keywords=[],
            )
            node.body.insert(0, ast.copy_location(ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                                             value=as_tensor), node))
        return node
