"""External backends: kernels written outside this package, judged by the same cases, gates and first failure.

A kernel author wraps their callables in the reference cores and hands the result to the runner:

    from conformance import Backend

    def make():
        return Backend.from_cores("my-kda", "bf16", lambda base: base.replace(kda_decode=my_kda_decode))

`k3conf run --backend my_module:make` (or `./path/to/file.py:make`) loads it; an installed package lists
it under the entry-point group `k3conf.backends` and it appears by name in `k3conf list backends`; the
pytest plugin (conformance.pytest_plugin) runs the cases as test items. Before a run, `check_cores`
(conformance.backends.checks) calls every core the author supplies on a tiny valid input and names the core whose
outputs do not keep the interface (docs/interfaces.md), so a wrong signature fails in a second with its name,
not as 26 red cells.
Cores the author did not swap are the reference's: the runner reports those cases "n/a (reference core)".
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import zlib
from collections.abc import Callable, Collection
from pathlib import Path

from conformance.backends.protocol import REQUIRED_MEMBERS, BackendBase, BackendError, checked_tensors, is_backend
from conformance.backends.tensors import adapt
from conformance.judge.speed import median_seconds, numpy_copy_bandwidth
from k3ref.cores import CORE_NAMES, Cores, reference_cores

__all__ = ["ENTRY_POINT_GROUP", "PRECISIONS", "Backend", "BackendError", "Unloadable", "as_backend",
           "entry_points", "from_entry_point", "is_spec", "load"]

PRECISIONS = ("fp64", "fp32", "bf16")
ENTRY_POINT_GROUP = "k3conf.backends"


@dataclasses.dataclass(eq=False)
class Backend(BackendBase):
    """A backend made of the reference cores with some swapped for the author's (numpy in, numpy out).

    Build it with `Backend.from_cores`. `kernel_cores()` names the swapped cores: cases that exercise none
    of them are not judged ("n/a (reference core)"). `time_core` times only those, on the host clock: the
    callables take and return numpy arrays, so a GPU core's time includes its copies to and from the device.
    With `tensors="torch"` the callables take and return torch tensors on `device` instead, and the judge
    (conformance.backends.tensors.TorchTensorBackend) times them on device-resident inputs.
    """

    name: str
    precision: str
    make_cores: Callable[[Cores], Cores]
    is_available: Callable[[], tuple[bool, str]] | None = None
    device: str = "cpu"
    tensors: str = "numpy"
    repeats: int = 3
    _cores: Cores | None = dataclasses.field(default=None, repr=False)
    _kernels: frozenset = dataclasses.field(default=frozenset(), repr=False)

    @classmethod
    def from_cores(cls, name: str, precision: str, make_cores: Callable[[Cores], Cores], *,
                   available: Callable[[], tuple[bool, str]] | None = None, device: str = "cpu",
                   tensors: str = "numpy") -> Backend:
        """`make_cores(base) -> Cores` swaps the author's callables into `base` (k3ref's reference cores),
        e.g. `base.replace(kda_decode=fn)`; it runs on first use, so it may import GPU libraries.
        precision: "fp64" | "fp32" | "bf16" (the inputs the cores receive and the gate rows that judge them);
        available() -> (bool, reason) says whether the backend can run here (default: always);
        tensors: "numpy" (the callables take and return arrays) or "torch" (torch tensors on `device`, a torch
        device string: the judge moves the inputs there and times the cores on device-resident inputs)."""
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
        checked_tensors(tensors, f"backend {name}")
        return cls(name, precision, make_cores, available, device, tensors)

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



# --------------------------------------------------------------------------------------------------
# loading: MODULE:ATTR on the command line, entry points of installed packages


def as_backend(obj: object, origin: str, reserved: Collection[str] = ()) -> BackendBase:
    """`obj` itself when it is a backend, else the backend `obj()` returns; BackendError naming `origin`.
    An object with the bare protocol (conformance.backends.protocol.MinimalBackend) comes back wrapped once,
    with the defaults of the optional members; one whose cores take torch tensors behind the NumPy bridge
    (conformance.backends.tensors).

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
                               f"(or an object with {', '.join(REQUIRED_MEMBERS)})")
        obj = made
    backend = adapt(obj)
    if not isinstance(backend.name, str) or not backend.name:
        raise BackendError(f"{origin}: name: expected a non-empty backend name, found {backend.name!r:.200}")
    if backend.name in reserved or backend.name.startswith(OWN_PREFIXES):
        raise BackendError(f"{origin}: the name {backend.name!r} is a built-in backend's; give yours another name")
    if backend.precision not in PRECISIONS:
        raise BackendError(f"{origin}: precision expected one of {PRECISIONS}, found {backend.precision!r}")
    return backend


# prefixes of the package's own backend families (conformance.backends.registry): never a MODULE:ATTR
OWN_PREFIXES = ("mutant:", "recipe:")


def is_spec(name: str) -> bool:
    """True for 'MODULE:ATTR' (and 'path/to/file.py:ATTR'); registered names, 'mutant:...' and 'recipe:...' are
    not specs."""
    return ":" in name and not name.startswith(OWN_PREFIXES)


def load(spec: str, reserved: Collection[str] = ()) -> BackendBase:
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
            raise BackendError(f"backend {spec!r}: {module.__name__} ({vars(module).get('__file__', '?')}) has no "
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
        if spec is None or spec.loader is None:
            raise BackendError(f"backend module file {module_part!r}: Python cannot load {path} as a module")
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
class Unloadable(BackendBase):
    """An entry-point backend that failed to load: listed as unavailable with the reason, never run."""

    name: str
    reason: str
    precision: str = "?"

    def available(self) -> tuple[bool, str]:
        return False, self.reason

    def cores(self) -> Cores:
        raise BackendError(f"backend {self.name} is unavailable: {self.reason}")


@functools.cache
def entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    """name -> entry point of the group `k3conf.backends` over the installed distributions (first one wins)."""
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep)
    return found


def from_entry_point(name: str, reserved: Collection[str] = ()) -> BackendBase:
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
