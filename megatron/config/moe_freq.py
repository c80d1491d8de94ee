"""``--moe-layer-freq``'s value: an int, or a Python list expression of 0/1 per layer."""

from __future__ import annotations

import ast
import operator

_OPS = {ast.Add: operator.add, ast.Mult: operator.mul}


def _evaluate(node: ast.AST):
    """Lists, ints, ``+`` and ``*`` only: what Megatron-LM's examples write
    (``([1]*3+[0])*2``), without running arbitrary code as its ``eval`` would."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_evaluate(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"unsupported element {ast.dump(node)}")


def moe_freq_type(text: str) -> int | list[int]:
    """``"2"`` -> 2; ``"[1,0,1,1]"`` or ``"([1]*3+[0])*2"`` -> a list of 0/1.

    Raises:
        ValueError: neither an int nor a list expression of ints.
    """
    text = str(text).strip()
    if "[" not in text:
        return int(text)
    try:
        value = _evaluate(ast.parse(text, mode="eval"))
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"--moe-layer-freq {text!r} is not an int or a list expression "
                         f"such as '[1,1,0,1]' or '([1]*3+[0])*2': {err}") from None
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError(f"--moe-layer-freq {text!r} does not give a list of ints")
    return value
