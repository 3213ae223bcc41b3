"""Bridges for the Triton kernels the serving engines vendor (SGLang's fla fork), beyond fla's
(conformance.backends.triton_interpreter, whose rules they follow: only under TRITON_INTERPRET=1, once each, and
applied by the engine adapters only, so that fla's verdicts stay those its bridges were measured with).

| bridge                  | without it, under the interpreter                                                  |
|-------------------------|------------------------------------------------------------------------------------|
| bridge_bound_builtins   | bridge_gather's gap for every builtin a module binds to its own name (`exp =       |
|                         | tl.exp` in the fork's op.py): "Did you forget to add @triton.jit ?"                |
| bridge_libdevice        | libdevice's functions (extern calls) return None: `1.0 + libdevice.exp(x)` raises  |
|                         | "unsupported operand type(s) for +: 'float' and 'NoneType'"                        |
| bridge_bf16_constants   | a Python float meeting a bf16 tensor asks the builder for `get_bf16`, which the    |
|                         | interpreter lacks: "'InterpreterBuilder' object has no attribute 'get_bf16'"       |
| bridge_bf16_arithmetic  | elementwise arithmetic on bf16 operands works on their 16-bit patterns as integers |
|                         | (`b_q * scale` on a bf16 b_q): garbage values, as bridge_bf16_dot's                |

Measured with sglang 0.5.23's fla fork on triton 3.8.0 (its chunk_kda needs tl.make_block_ptr, which 3.9's
interpreter no longer runs).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from types import ModuleType

import numpy as np

from conformance.backends.triton_interpreter import (
    MARK,
    bf16_bits_to_fp32,
    fp32_to_bf16_bits,
    install,
    require_interpreter,
)


def _late_builtin(owner: ModuleType, attr: str) -> Callable:
    """A function that calls owner.attr as it is when called (the interpreter's version while a kernel runs)."""
    def call(*args, **kwargs):
        return getattr(owner, attr)(*args, **kwargs)
    setattr(call, MARK, True)
    call.__name__ = attr
    return call


def bridge_bound_builtins(modules: Iterable[ModuleType]) -> list[str]:
    """bridge_gather for every Triton builtin a module binds to a global name of its own (`exp = tl.exp`,
    `exp2 = tl.math.exp2`, `gather = tl.gather`, as the fla forks vendored by engines do): each becomes a function
    that looks the builtin up at call time. Returns "module.name" for each global changed now."""
    require_interpreter("bridge_bound_builtins")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use

    owners = (tl, tl.math)
    changed = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if getattr(value, MARK, False) or not tl.core.is_builtin(value):
                continue
            owner = next(((o, a) for o in owners for a, v in vars(o).items() if v is value), None)
            if owner is not None:
                setattr(module, name, _late_builtin(*owner))
                changed.append(f"{module.__name__}.{name}")
    return changed


class _LibdeviceOnInterpreter:
    """triton.language.extra.libdevice for a kernel under the interpreter, which runs its extern calls as no-ops
    (they return None): each function is tl.math's of the same name, looked up when called (NumPy's, as every
    math function there is). A function tl.math lacks raises, naming it."""

    def __getattr__(self, name: str):
        import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use

        if not callable(getattr(tl.math, name, None)):     # inside a kernel tl.math holds the interpreter's
            raise AttributeError(f"libdevice.{name}: no tl.math function of that name to run it under the "
                                 "interpreter")
        return _late_builtin(tl.math, name)


def bridge_libdevice(modules: Iterable[ModuleType]) -> list[str]:
    """Every module global bound to Triton's libdevice module gets _LibdeviceOnInterpreter; the names changed."""
    require_interpreter("bridge_libdevice")
    import triton.language.extra.libdevice as libdevice  # noqa: PLC0415 -- optional dependency, imported on use

    changed = []
    for module in modules:
        for name, value in list(vars(module).items()):
            if value is libdevice:
                setattr(module, name, _LibdeviceOnInterpreter())
                changed.append(f"{module.__name__}.{name}")
    return changed


def bridge_bf16_constants() -> bool:
    """A Python float meeting a bf16 tensor (`b_q * scale`) becomes a bf16 constant, rounded to nearest even, as
    compiled Triton makes it; the interpreter's builder has no `get_bf16`."""
    require_interpreter("bridge_bf16_constants")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use
    from triton.runtime import interpreter  # noqa: PLC0415 -- optional dependency, imported on use

    if getattr(getattr(interpreter.InterpreterBuilder, "get_bf16", None), MARK, False):
        return False

    def get_bf16(self, value):
        return interpreter.TensorHandle(fp32_to_bf16_bits(np.array([value], dtype=np.float32)), tl.bfloat16)
    setattr(get_bf16, MARK, True)
    interpreter.InterpreterBuilder.get_bf16 = get_bf16
    return True


def bridge_bf16_arithmetic() -> bool:
    """Elementwise float arithmetic on bf16 operands (a binary or unary op, fma, clamp) on their values: widened
    exactly to fp32, computed, rounded back to bf16 to nearest even, as compiled Triton's bf16 arithmetic rounds
    once; a comparison keeps its boolean result, a select (where) its operands' bits."""
    require_interpreter("bridge_bf16_arithmetic")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use
    from triton.runtime import interpreter  # noqa: PLC0415 -- optional dependency, imported on use

    def is_bf16(h) -> bool:
        return h.dtype.scalar == tl.bfloat16

    def value(h) -> np.ndarray:
        return bf16_bits_to_fp32(h.data) if is_bf16(h) else h.data

    def result(out) -> object:
        out = np.asarray(out)
        if out.dtype == np.bool_:
            return interpreter.TensorHandle(out, tl.int1)
        return interpreter.TensorHandle(fp32_to_bf16_bits(out.astype(np.float32)), tl.bfloat16)

    def make_binary(binary_op):
        @functools.wraps(binary_op)
        def binary(self, lhs, rhs, op):
            if not (is_bf16(lhs) or is_bf16(rhs)):
                return binary_op(self, lhs, rhs, op)
            return result(op(value(lhs), value(rhs)))
        return binary

    def make_unary(unary_op):
        @functools.wraps(unary_op)
        def unary(self, arg, op):
            return result(op(value(arg))) if is_bf16(arg) else unary_op(self, arg, op)
        return unary

    def make_ternary(ternary_op):
        @functools.wraps(ternary_op)
        def ternary(self, lhs, rhs, other, op):
            if op is np.where or not is_bf16(other):
                return ternary_op(self, lhs, rhs, other, op)
            return result(op(value(lhs), value(rhs), value(other)))
        return ternary

    def make_fma(create_fma):
        @functools.wraps(create_fma)
        def fma(self, x, y, z):
            if not is_bf16(z):
                return create_fma(self, x, y, z)
            return result(value(x).astype(np.float32) * value(y) + value(z))
        return fma

    installed = [install(interpreter.InterpreterBuilder, name, make) for name, make in
                 (("binary_op", make_binary), ("unary_op", make_unary), ("ternary_op", make_ternary),
                  ("create_fma", make_fma))]
    return any(installed)


def engine_bridges(modules: Iterable[ModuleType]) -> None:
    """Every bridge of this module: the two on the builder, and the two on `modules` (the fork's loaded modules)."""
    modules = list(modules)
    bridge_bf16_constants()
    bridge_bf16_arithmetic()
    bridge_bound_builtins(modules)
    bridge_libdevice(modules)
