"""Five bridges that let fla's real Triton kernels run on a CPU under Triton's interpreter (TRITON_INTERPRET=1).

The interpreter runs a `@triton.jit` kernel as Python over NumPy, one program at a time. fla-core's KDA kernels
(`fused_recurrent_kda`, `chunk_kda`) were written for compiled Triton on a GPU; five places where the interpreter
differs from the compiler stop them or change their numbers, and each function below closes one:

| bridge                  | without it, under the interpreter                                                  |
|-------------------------|------------------------------------------------------------------------------------|
| bridge_autotuner        | the autotuner benchmarks its configs through a GPU driver: "0 active drivers"      |
| bridge_gather           | fla binds `gather = tl.gather` when its module loads; the interpreter patches      |
|                         | `tl.gather` only for the call, so fla's name calls the compiler's builtin:         |
|                         | "Did you forget to add @triton.jit ? (`_semantic` argument must be provided ...)"  |
| bridge_loop_variables   | a `tl.range` loop variable is a Python int (compiled: an int32 tensor), so         |
|                         | `i_t.to(tl.int64)` raises "'int' object has no attribute 'to'"                     |
| bridge_bf16_dot         | `tl.dot` on bf16 multiplies the raw 16-bit patterns as integers (triton issue      |
|                         | 11584): garbage products                                                           |
| bridge_bf16_rounding    | an fp32 -> bf16 cast truncates the mantissa; compiled Triton (and torch) round to  |
|                         | nearest even                                                                       |

What stays different from a GPU run, and so limits a verdict reached under the interpreter (INTERPRETER_LIMITS):
fp32 dots are IEEE products with fp32 sums (a GPU may use TF32), the autotuner runs the first config of each
kernel (a GPU picks the fastest, which may block the sums otherwise), and exp, log and the reductions are NumPy's.

Every bridge applies only under TRITON_INTERPRET=1, patches once (a second call is a no-op that returns False)
and only for the versions measured here (MEASURED_FLA, MEASURED_TRITON): `refusal()` names any other version, and
the fla backend is then unavailable with that reason. Triton is imported late (inside the functions): it is an
optional dependency, and TRITON_INTERPRET must be set before fla's kernels are decorated.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType

import numpy as np

ENV = "TRITON_INTERPRET"
MEASURED_FLA = ("0.6.0",)
MEASURED_TRITON = ((3, 7, 1), (3, 9, 0))     # inclusive; 3.5.1 fails on fused_recurrent_kda itself
INTERPRETER_LIMITS = ("Triton's interpreter (CPU): fp32 dots in IEEE fp32, not TF32 as a GPU may; the first "
                      "autotune config of each kernel, not the fastest; exp, log and reductions in NumPy")
MARK = "_k3conf_bridge"     # set on every function a bridge installs: its presence means "already bridged"


def interpreter_on() -> bool:
    """True when Triton's interpreter is requested for kernels decorated from now on (TRITON_INTERPRET=1)."""
    return os.environ.get(ENV, "") == "1"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, ...]:
    """'3.9.0' -> (3, 9, 0); a local or pre-release suffix is dropped ('3.7.1+git' -> (3, 7, 1))."""
    parts = []
    for p in version.split("+")[0].split("."):
        digits = "".join(c for c in p if c.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def refusal() -> str | None:
    """None when the installed fla-core and triton are versions these bridges were measured on; else why not,
    with the command that installs measured ones."""
    fix = "pip install --no-deps -r requirements-fla.txt"
    fla, triton = _version("fla-core"), _version("triton")
    if fla is None or triton is None:
        missing = [d for d, v in (("fla-core", fla), ("triton", triton)) if v is None]
        return f"{' and '.join(missing)} not installed: {fix}"
    if fla not in MEASURED_FLA:
        return (f"fla-core {fla} is not a version the interpreter bridges were measured on "
                f"({', '.join(MEASURED_FLA)}): {fix}")
    return triton_refusal()


def triton_refusal() -> str | None:
    """None when the installed triton is within the versions the bridges were measured on; else why not."""
    fix = "pip install --no-deps -r requirements-fla.txt"
    triton = _version("triton")
    if triton is None:
        return f"triton not installed: {fix}"
    lo, hi = MEASURED_TRITON
    if not lo <= release(triton)[:3] <= hi:
        return (f"triton {triton} is outside the versions the interpreter bridges were measured on "
                f"({'.'.join(map(str, lo))} to {'.'.join(map(str, hi))}): {fix}")
    return None


def require_interpreter(bridge: str) -> None:
    if not interpreter_on():
        raise RuntimeError(f"{bridge}: expected {ENV}=1 (the bridges change Triton's interpreter only), found "
                           f"{ENV}={os.environ.get(ENV, '')!r}")


def install(owner: object, name: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace owner.name by make(original) unless a bridge already did; True when it replaced it now."""
    original = getattr(owner, name)
    if getattr(original, MARK, False):
        return False
    new = make(original)
    setattr(new, MARK, True)
    setattr(owner, name, new)
    return True


# --------------------------------------------------------------------------------------------- the bridges


def bridge_autotuner() -> bool:
    """The autotuner keeps the first of its (pruned) configs: with one config left it benchmarks nothing, so it
    never asks for the GPU driver the interpreter lacks."""
    require_interpreter("bridge_autotuner")
    from triton.runtime.autotuner import Autotuner  # noqa: PLC0415 -- optional dependency, imported on use

    def make(prune_configs):
        @functools.wraps(prune_configs)
        def first_config(self, kwargs):
            return prune_configs(self, kwargs)[:1]
        return first_config
    return install(Autotuner, "prune_configs", make)


def _gather(src, index, axis):
    """tl.gather looked up when called, i.e. the interpreter's version while a kernel runs."""
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use

    return tl.gather(src, index, axis)


setattr(_gather, MARK, True)


def bridge_gather(modules: Iterable[ModuleType] | None = None) -> list[str]:
    """Every module (default: every loaded `fla.*` module) whose global `gather` is the compiler's `tl.gather`
    gets one that looks tl.gather up at call time; the names of the modules changed now."""
    require_interpreter("bridge_gather")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use

    if modules is None:
        modules = [m for n, m in list(sys.modules.items()) if (n == "fla" or n.startswith("fla.")) and m is not None]
    changed = []
    for module in modules:
        if vars(module).get("gather") is tl.core.gather:
            module.gather = _gather  # type: ignore[attr-defined]
            changed.append(module.__name__)
    return changed


class _TensorRangeLoops(ast.NodeTransformer):
    """`for i in range(...)` and `for i in tl.range(...)` -> `for i in <TENSOR_RANGE>(...)`; static_range stays."""

    def visit_For(self, node: ast.For) -> ast.For:
        self.generic_visit(node)
        call = node.iter
        if not isinstance(call, ast.Call):
            return node
        f = call.func
        if (isinstance(f, ast.Name) and f.id == "range") or (isinstance(f, ast.Attribute) and f.attr == "range"):
            call.func = ast.copy_location(ast.Name(id=TENSOR_RANGE, ctx=ast.Load()), f)
        return node


TENSOR_RANGE = "_k3conf_tensor_range"    # the name the rewritten kernels call; no kernel source uses it


def _scalar(x) -> int:
    """A loop bound: a Python int, or an interpreter scalar tensor (a bound computed from a loop variable)."""
    handle = getattr(x, "handle", None)
    return int(x) if handle is None else int(np.asarray(handle.data).reshape(-1)[0])


def bridge_loop_variables() -> bool:
    """The variable of a `range` / `tl.range` loop in a kernel is an int32 tensor, as compiled Triton's is
    (`tl.static_range` keeps Python ints: its variable is a compile-time constant there too). The interpreter
    rewrites each kernel's AST before running it; this bridge adds one step to that rewrite."""
    require_interpreter("bridge_loop_variables")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use
    from triton.runtime import interpreter  # noqa: PLC0415 -- optional dependency, imported on use

    def tensor_range(arg1, arg2=None, step=None, **_hints):
        start, end = (0, arg1) if arg2 is None else (arg1, arg2)
        for i in range(_scalar(start), _scalar(end), _scalar(1 if step is None else step)):
            yield tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)

    # the interpreter copies its module's globals into a kernel's globals when it runs the rewritten kernel
    setattr(interpreter, TENSOR_RANGE, tensor_range)

    def make(transform_ast):
        @functools.wraps(transform_ast)
        def transform_with_tensor_loops(self, src):
            return ast.fix_missing_locations(_TensorRangeLoops().visit(transform_ast(self, src)))
        return transform_with_tensor_loops
    installed = install(interpreter.FunctionRewriter, "_transform_ast", make)
    if installed:   # a kernel that already ran keeps its rewrite in this cache: rewrite it again, with the bridge
        interpreter.InterpretedFunction.rewritten_fn.clear()
    return installed


def bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    """bf16 values stored as their uint16 patterns (as the interpreter stores them) -> float32, exactly."""
    return (np.asarray(bits).astype(np.uint32) << np.uint32(16)).view(np.float32)


def fp32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 uint16 patterns, rounded to nearest even (a NaN stays a quiet NaN of its sign)."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = ((bits >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7FC0)
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


def bridge_bf16_dot() -> bool:
    """`tl.dot` on bf16 operands multiplies their values (widened exactly to fp32) instead of their bit patterns."""
    require_interpreter("bridge_bf16_dot")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use
    from triton.runtime import interpreter  # noqa: PLC0415 -- optional dependency, imported on use

    def widened(h):
        return interpreter.TensorHandle(bf16_bits_to_fp32(h.data), tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def make(create_dot):
        @functools.wraps(create_dot)
        def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
            return create_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)
        return dot
    return install(interpreter.InterpreterBuilder, "create_dot", make)


def bridge_bf16_rounding() -> bool:
    """An fp32 -> bf16 cast rounds to nearest even, as compiled Triton's truncf does on a GPU."""
    require_interpreter("bridge_bf16_rounding")
    import triton.language as tl  # noqa: PLC0415 -- optional dependency, imported on use
    from triton.runtime import interpreter  # noqa: PLC0415 -- optional dependency, imported on use

    def make(cast_impl):
        @functools.wraps(cast_impl)
        def cast(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return interpreter.TensorHandle(fp32_to_bf16_bits(src.data), tl.bfloat16)
            return cast_impl(self, src, dst_type)
        return cast
    return install(interpreter.InterpreterBuilder, "cast_impl", make)


TRITON_BRIDGES = (bridge_autotuner, bridge_loop_variables, bridge_bf16_dot, bridge_bf16_rounding)


def interpreted(kernel: object) -> bool:
    """True when `kernel` (a @triton.jit function, possibly under autotune / heuristics wrappers) was decorated
    under the interpreter."""
    from triton.runtime.interpreter import InterpretedFunction  # noqa: PLC0415 -- optional, imported on use

    seen = 0
    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn") and seen < 16:
        kernel, seen = kernel.fn, seen + 1
    return isinstance(kernel, InterpretedFunction)


def fla_kda_under_interpreter() -> ModuleType:
    """fla.ops.kda with its kernels under the interpreter and all five bridges applied. Sets TRITON_INTERPRET=1
    first: the kernels are decorated when fla imports, so the variable must be set before that. RuntimeError
    when the versions are not measured ones, or fla's kernels were already imported compiled in this process."""
    why = refusal()
    if why:
        raise RuntimeError(why)
    os.environ[ENV] = "1"
    for bridge in TRITON_BRIDGES:
        bridge()
    fla_kda = importlib.import_module("fla.ops.kda")
    recurrent = importlib.import_module("fla.ops.kda.fused_recurrent")
    if not interpreted(recurrent.fused_recurrent_kda_fwd_kernel):
        raise RuntimeError("fla's kernels were imported in this process before TRITON_INTERPRET=1 was set (they are "
                           "compiled-Triton kernels now, which need a GPU); run fla in a fresh process")
    bridge_gather()
    return fla_kda
