"""External backends: kernels written outside this package, judged by the same cases, gates and first failure.

A kernel author wraps their callables in the reference cores and hands the result to the runner:

    from conformance import Backend

    def make():
        return Backend.from_cores("my-kda", "bf16", lambda base: base.replace(kda_decode=my_kda_decode))

`k3conf run --backend my_module:make` (or `./path/to/file.py:make`) loads it; an installed package lists
it under the entry-point group `k3conf.backends` and it appears by name in `k3conf list backends`; the
pytest plugin (conformance.pytest_plugin) runs the cases as test items. Before a run, `check_cores` calls
every core the author supplies on a tiny valid input and names the core whose outputs do not keep the
interface (docs/interfaces.md), so a wrong signature fails in a second with its name, not as 26 red cells.
Cores the author did not swap are the reference's: the runner reports those cases "n/a (reference core)".
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
import zlib
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

from conformance.judge.speed import median_seconds, numpy_copy_bandwidth
from k3ref.cores import CORE_NAMES, Cores, UnsupportedShape, reference_cores

PRECISIONS = ("fp64", "fp32", "bf16")
ENTRY_POINT_GROUP = "k3conf.backends"
PROTOCOL = ("name", "precision", "available", "cores", "time_core")   # what the runner calls on a backend


class BackendError(ValueError):
    """A backend that cannot be loaded, or whose cores do not keep the interface; the message names what."""


@dataclasses.dataclass(eq=False)
class Backend:
    """A backend made of the reference cores with some swapped for the author's (numpy in, numpy out).

    Build it with `Backend.from_cores`. `kernel_cores()` names the swapped cores: cases that exercise none
    of them are not judged ("n/a (reference core)"). `time_core` times only those, on the host clock: the
    callables take and return numpy arrays, so a GPU core's time includes its copies to and from the device.
    """

    name: str
    precision: str
    make_cores: Callable[[Cores], Cores]
    is_available: Callable[[], tuple[bool, str]] | None = None
    device: str = "cpu"
    repeats: int = 3
    _cores: Cores | None = dataclasses.field(default=None, repr=False)
    _kernels: frozenset = dataclasses.field(default=frozenset(), repr=False)

    @classmethod
    def from_cores(cls, name: str, precision: str, make_cores: Callable[[Cores], Cores], *,
                   available: Callable[[], tuple[bool, str]] | None = None, device: str = "cpu") -> Backend:
        """`make_cores(base) -> Cores` swaps the author's callables into `base` (k3ref's reference cores),
        e.g. `base.replace(kda_decode=fn)`; it runs on first use, so it may import GPU libraries.
        precision: "fp64" | "fp32" | "bf16" (the inputs the cores receive and the gate rows that judge them);
        available() -> (bool, reason) says whether the backend can run here (default: always)."""
        if not isinstance(name, str) or not name or any(c.isspace() for c in name) or ":" in name:
            raise BackendError(f"backend name: expected a non-empty string without spaces or ':', found {name!r}")
        if precision not in PRECISIONS:
            raise BackendError(f"backend {name}: precision expected one of {PRECISIONS}, found {precision!r}")
        if not callable(make_cores):
            raise BackendError(f"backend {name}: make_cores expected a callable(base: Cores) -> Cores, "
                               f"found {type(make_cores).__name__}")
        if available is not None and not callable(available):
            raise BackendError(f"backend {name}: available expected a callable() -> (bool, reason) or None, "
                               f"found {type(available).__name__}")
        return cls(name, precision, make_cores, available, device)

    def available(self) -> tuple[bool, str]:
        if self.is_available is None:
            return True, f"external backend ({self.device})"
        try:
            result = self.is_available()
        except Exception as e:  # noqa: BLE001 - a probe that crashes means "cannot run here", with the reason
            return False, f"available() raised {type(e).__name__}: {e}"
        if not (isinstance(result, tuple) and len(result) == 2):
            return False, f"available() must return (bool, reason), returned {result!r}"
        return bool(result[0]), str(result[1])

    def cores(self) -> Cores:
        if self._cores is None:
            base = reference_cores()
            try:
                cores = self.make_cores(base)
            except Exception as e:
                raise BackendError(f"backend {self.name}: make_cores(base) raised {type(e).__name__}: {e}") from e
            if not isinstance(cores, Cores):
                raise BackendError(f"backend {self.name}: make_cores(base) returned {type(cores).__name__}, expected "
                                   "k3ref.cores.Cores (return base.replace(<core>=<your callable>))")
            self._kernels = frozenset(n for n in CORE_NAMES if getattr(cores, n) is not getattr(base, n))
            self._cores = cores
        return self._cores

    def kernel_cores(self) -> frozenset[str]:
        """The cores this backend supplies itself (every other one is the reference core)."""
        self.cores()
        return self._kernels

    def check(self) -> None:
        """BackendError naming the first swapped core that breaks the interface on a tiny input."""
        check_cores(self)

    def time_core(self, core: str, inputs: dict) -> float | None:
        """Median host seconds of one of the author's cores over `repeats` calls after a warm-up call;
        None for a reference core (its time says nothing about the author's kernel)."""
        if core not in self.kernel_cores():
            return None
        fn = getattr(self.cores(), core)
        return median_seconds(lambda: fn(**inputs), self.repeats)

    def copy_bandwidth(self) -> float | None:
        """The host's copy bandwidth for a CPU backend; None elsewhere (no bandwidth ratio is claimed)."""
        if self.device != "cpu":
            return None
        return numpy_copy_bandwidth()

    def speed_target(self, block: str) -> float | None:
        return None


# --------------------------------------------------------------------------------------------------
# checking the swapped cores on tiny inputs before a run


def check_cores(backend) -> None:
    """Call every core the backend supplies on the inputs of its block's tiny cases (made afresh, no golden
    read; K != V and odd sizes among them), next to the reference core on the same inputs; BackendError
    naming the core, the case, what was expected and what was found when the call fails, or an output
    differs in count, type, shape or kind of dtype, or is non-finite where the reference's is finite.
    Values are not judged here (the run does that); a case the core raises UnsupportedShape on is skipped."""
    from conformance.cases.core import CORE_SPECS, CORE_TABLE, cast

    cores, base = backend.cores(), reference_cores()
    kernels = getattr(backend, "kernel_cores", lambda: frozenset(CORE_NAMES))()
    for name in sorted(kernels):
        spec = CORE_SPECS.get(name)
        if spec is None:          # attnres_hub: a factory, exercised by the traces only
            continue
        fn, ref = getattr(cores, name), getattr(base, name)
        for case, params in CORE_TABLE["tiny"]:
            if case.split("/", 1)[0] != name:
                continue
            shape_params = {k: v for k, v in params.items() if k != "entry"}   # a CUDA entry override only
            inputs, kwargs = spec.make(np.random.default_rng(0), **shape_params)
            keep = spec.fp32_inputs if backend.precision == "bf16" else ()
            inputs = {k: cast(v, "fp32" if k in keep else backend.precision) for k, v in inputs.items()}
            where = f"backend {backend.name}: core {name} on a tiny input like {case} ({_shapes(inputs)})"
            try:
                got = fn(**inputs, **kwargs)
            except UnsupportedShape:
                continue
            except TypeError as e:
                raise BackendError(f"{where}: the call raised TypeError: {e}; expected the signature "
                                   f"{name}{_plain_signature(ref)} (docs/interfaces.md)") from e
            except Exception as e:
                raise BackendError(f"{where}: the call raised {type(e).__name__}: {e}") from e
            _compare_outputs(where, got, ref(**inputs, **kwargs), spec.outputs)


def _plain_signature(fn) -> inspect.Signature:
    """fn's signature without annotations: `(x, w, eps)` reads better in an error than the type hints."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
                       return_annotation=sig.empty)


def _shapes(arrays: dict) -> str:
    return ", ".join(f"{k} {list(np.shape(v))}" for k, v in arrays.items())


def _compare_outputs(where: str, got, want, names: tuple[str, ...]) -> None:
    got_t = got if isinstance(got, tuple) else (got,)
    want_t = want if isinstance(want, tuple) else (want,)
    if len(got_t) != len(want_t):
        raise BackendError(f"{where}: returned {len(got_t)} value(s), expected {len(want_t)} ({', '.join(names)})")
    for out, g, w in zip(names, got_t, want_t):
        w = np.asarray(w)
        if not isinstance(g, np.ndarray):
            raise BackendError(f"{where}: output {out} is a {type(g).__module__}.{type(g).__name__}, expected a "
                               "numpy.ndarray (cores take and return numpy arrays; copy device tensors to the host)")
        if g.shape != w.shape:
            raise BackendError(f"{where}: output {out} has shape {list(g.shape)}, expected {list(w.shape)}")
        if (g.dtype.kind == "f") != (w.dtype.kind == "f") or (w.dtype.kind in "iu" and g.dtype.kind not in "iu"):
            raise BackendError(f"{where}: output {out} has dtype {g.dtype}, expected {w.dtype} (or another "
                               f"{'floating' if w.dtype.kind == 'f' else 'integer'} dtype)")
        if g.dtype.kind == "f":
            bad = ~np.isfinite(g) & np.isfinite(w)
            if bad.any():
                idx = tuple(int(i) for i in np.argwhere(bad)[0])
                raise BackendError(f"{where}: output {out} holds {int(bad.sum())} non-finite value(s) where the "
                                   f"reference's are finite (first at {list(idx)}: {g[idx]}, expected {w[idx]})")


# --------------------------------------------------------------------------------------------------
# loading: MODULE:ATTR on the command line, entry points of installed packages


def is_backend(obj) -> bool:
    """A Backend, or any object with the backend protocol (docs/interfaces.md, "Backends")."""
    return isinstance(obj, Backend) or (not isinstance(obj, type) and all(hasattr(obj, a) for a in PROTOCOL))


def as_backend(obj, origin: str, reserved: Collection[str] = ()):
    """`obj` itself when it is a backend, else the backend `obj()` returns; BackendError naming `origin`.

    `reserved`: names an external backend may not take (the caller's registry of built-in backends)."""
    if not is_backend(obj):
        if not callable(obj):
            raise BackendError(f"{origin} is a {type(obj).__name__}, expected a conformance.Backend or a callable "
                               "returning one")
        try:
            made = obj()
        except Exception as e:
            raise BackendError(f"{origin}: calling it raised {type(e).__name__}: {e}") from e
        if not is_backend(made):
            raise BackendError(f"{origin}() returned a {type(made).__name__}, expected a conformance.Backend "
                               f"(or an object with {', '.join(PROTOCOL)})")
        obj = made
    if obj.name in reserved or str(obj.name).startswith("mutant:"):
        raise BackendError(f"{origin}: the name {obj.name!r} is a built-in backend's; give yours another name")
    if obj.precision not in PRECISIONS:
        raise BackendError(f"{origin}: precision expected one of {PRECISIONS}, found {obj.precision!r}")
    return obj


def is_spec(name: str) -> bool:
    """True for 'MODULE:ATTR' (and 'path/to/file.py:ATTR'); registered names and 'mutant:...' are not specs."""
    return ":" in name and not name.startswith("mutant:")


def load(spec: str, reserved: Collection[str] = ()):
    """The backend named by 'MODULE:ATTR', where MODULE is an importable module (the current directory
    included) or a path to a .py file, and ATTR (dotted allowed) a Backend or a callable returning one.
    `reserved`: names it may not take (see as_backend)."""
    module_part, _, attr = spec.rpartition(":")
    if not module_part or not attr:
        raise BackendError(f"backend {spec!r}: expected MODULE:ATTR, e.g. my_kernels.k3:make or ./my_backend.py:make")
    module = _import(module_part)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
            raise BackendError(f"backend {spec!r}: {module.__name__} ({getattr(module, '__file__', '?')}) has no "
                               f"attribute {attr!r}; its callables: {defined}")
        obj = getattr(obj, part)
    return as_backend(obj, spec, reserved)


def _import(module_part: str):
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        path = Path(module_part).expanduser().resolve()
        if not path.is_file():
            raise BackendError(f"backend module file {module_part!r} not found (looked at {path})")
        name = f"k3conf_external_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        if name in sys.modules:
            return sys.modules[name]
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))   # as for `python file.py`: the file's neighbours import
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # dataclasses and pickling look their module up here
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[name]
            raise BackendError(f"importing {path} raised {type(e).__name__}: {e}") from e
        return module
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)                # the console script's sys.path lacks the working directory
    try:
        return importlib.import_module(module_part)
    except ModuleNotFoundError as e:
        if e.name == module_part or module_part.startswith(f"{e.name}."):
            raise BackendError(f"cannot import backend module {module_part!r} ({e}); looked on sys.path and in "
                               f"{cwd}; pass a file path (./file.py:ATTR) or install the package") from e
        raise BackendError(f"importing {module_part} raised ModuleNotFoundError: {e}") from e
    except Exception as e:
        raise BackendError(f"importing {module_part} raised {type(e).__name__}: {e}") from e


@dataclasses.dataclass
class Unloadable:
    """An entry-point backend that failed to load: listed as unavailable with the reason, never run."""

    name: str
    reason: str
    precision: str = "?"

    def available(self) -> tuple[bool, str]:
        return False, self.reason

    def cores(self) -> Cores:
        raise BackendError(f"backend {self.name} is unavailable: {self.reason}")

    def time_core(self, core: str, inputs: dict) -> float | None:
        return None


@functools.cache
def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """name -> entry point of the group `k3conf.backends` over the installed distributions (first one wins)."""
    found = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def from_entry_point(name: str, reserved: Collection[str] = ()):
    """The backend of entry point `name`, or an Unloadable carrying why it could not be built.
    `reserved`: names it may not take (see as_backend)."""
    ep = entry_points()[name]
    origin = f"entry point {name} = {ep.value}"
    try:
        backend = as_backend(ep.load(), origin, reserved)
    except Exception as e:  # noqa: BLE001 - a broken installed package must not break listing or running others
        return Unloadable(name, f"{type(e).__name__}: {e}" if not isinstance(e, BackendError) else str(e))
    if backend.name != name:
        return Unloadable(name, f"{origin} built a backend named {backend.name!r}; name the entry point and the "
                                "backend alike")
    return backend
