"""What a run ran on: the `metadata` block of report.json, so that two runs (two kernel versions, one kernel on two
GPUs) can be told apart and compared (`k3conf diff`).

    meta = collect(root=golden_root, config="tiny", seed=runner.seed, duration=seconds)

Collected once per run, after it. It stays cheap (well under a second: no CUDA context, no torch import, git and
nvidia-smi with a short time limit) and never raises: a field that cannot be read here is None. In particular:
- git: the checkout the package runs from, only when the package sits at the top of a git work tree (an installed
  wheel inside some other repository must not report that repository's commit); None without git.
- torch: its version is read from the installed distribution and its CUDA version from torch/version.py, without
  importing torch (seconds, and it may be absent); when a backend of the run imported torch and initialised CUDA,
  the GPU is the one torch used, else the GPUs nvidia-smi lists (the driver never initialised in this process).
- blas: threadpoolctl's view of the loaded BLAS (library, version, kernel architecture, threads), else the BLAS
  NumPy was built with (numpy.show_config) and the thread variables of the environment.
"""
from __future__ import annotations

import datetime
import hashlib
import importlib.metadata
import importlib.util
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from conformance import __version__
from k3ref.threads import blas_info, describe_blas

METADATA_VERSION = 1
PACKAGE_DIR = Path(__file__).resolve().parent
SUBPROCESS_TIMEOUT = 2.0   # seconds git or nvidia-smi may take before the field is left None
# variables that change what a run computes or how fast: the fresh seed, strict mode, threads, visible GPUs
ENV_NAMES = ("K3_STRICT", "K3CONF_FRESH_SEED", "K3CONF_CHECK_SEED", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
             "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_CORETYPE", "NUMBA_NUM_THREADS", "K3_THREADS")
ENV_PREFIXES = ("K3_CUDA_",)


def collect(*, root: Path | None = None, config: str | None = None, seed: int | None = None,
            duration: float | None = None, argv: list[str] | None = None) -> dict:
    """The metadata block of one run. root / config: its golden folder and shape set; seed: its fresh-input seed;
    duration: its wall seconds (the start is now minus it); argv: its command line (default sys.argv)."""
    now = datetime.datetime.now(datetime.UTC)
    started = None if duration is None else now - datetime.timedelta(seconds=duration)
    return {
        "metadata_version": METADATA_VERSION,
        "package": {"name": "k3-conformance", "version": __version__,
                    "installed_version": _safe(lambda: importlib.metadata.version("k3-conformance"))},
        "git": _safe(git_state),
        "golden": _safe(lambda: golden_state(root, config)),
        "host": {"name": _safe(socket.gethostname), "os": _safe(platform.platform), "cpu": _safe(cpu_model),
                 "cores": _safe(os.cpu_count), "cores_usable": _safe(_usable_cores)},
        "python": _safe(platform.python_version),
        "numpy": np.__version__,
        "torch": _safe(torch_state),
        "gpu": _safe(gpu_state),
        "blas": _safe(blas_state),
        "env": _safe(env_state),
        "command": _safe(lambda: shlex.join(sys.argv if argv is None else argv)),
        "started": None if started is None else started.isoformat(timespec="seconds"),
        "duration_s": duration,
        "seed": seed,
    }


def _safe(read: Callable[[], object]) -> object:
    """read(), or None when it raises: a field that cannot be read here is left empty, never a failed run."""
    try:
        return read()
    except Exception:  # noqa: BLE001 - metadata is informative: nothing it cannot read may stop a run
        return None


def _run(*cmd: str, cwd: Path | None = None) -> str | None:
    """stdout of a short command, or None when it is absent, fails or is slow."""
    try:
        done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def git_state(package_dir: Path = PACKAGE_DIR) -> dict | None:
    """{'sha', 'dirty', 'branch', 'diff_sha256'} of the checkout `package_dir` is the `conformance` folder of (the
    digest of `git diff HEAD`, the tracked files' uncommitted changes, when dirty); None otherwise (installed from a
    wheel, git absent, not a repository)."""
    top = _run("git", "rev-parse", "--show-toplevel", cwd=package_dir)
    if top is None or Path(top.strip()).resolve() / package_dir.name != package_dir.resolve():
        return None
    sha = _run("git", "rev-parse", "HEAD", cwd=package_dir)
    if sha is None:
        return None
    status = _run("git", "status", "--porcelain", cwd=package_dir)
    dirty = None if status is None else bool(status.strip())
    # two runs of one dirty checkout (a kernel edited between them) differ only in the uncommitted changes
    changes = _run("git", "diff", "HEAD", cwd=package_dir) if dirty else None
    branch = _run("git", "rev-parse", "--abbrev-ref", "HEAD", cwd=package_dir)
    return {"sha": sha.strip(), "dirty": dirty, "branch": None if branch is None else branch.strip(),
            "diff_sha256": None if changes is None else hashlib.sha256(changes.encode()).hexdigest()}


def golden_state(root: Path | None, config: str | None) -> dict | None:
    """The golden folder, shape set, and the sha256 of its MANIFEST.json (which lists every golden file's sha256,
    so equal digests mean the same inputs and expected outputs); None without a folder."""
    if root is None:
        return None
    manifest = Path(root) / "MANIFEST.json"
    digest = _safe(lambda: hashlib.sha256(manifest.read_bytes()).hexdigest())
    return {"dir": str(Path(root).resolve()), "shape_set": config, "manifest_sha256": digest}


def cpu_model() -> str | None:
    """The CPU's model name: /proc/cpuinfo on Linux, sysctl on macOS, else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith(("model name", "Model", "cpu model")):
                return line.partition(":")[2].strip()
    if sys.platform == "darwin":
        out = _run("sysctl", "-n", "machdep.cpu.brand_string")
        if out:
            return out.strip()
    return platform.processor() or None


def _usable_cores() -> int | None:
    """The cores this process may run on (affinity, a container's cpuset), where the OS says."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def torch_state() -> dict | None:
    """{'version', 'cuda', 'imported'} of the installed torch without importing it; None when it is absent."""
    if "torch" in sys.modules:   # a backend of the run imported it: ask it (no CUDA call)
        torch = sys.modules["torch"]
        return {"version": str(torch.__version__), "cuda": torch.version.cuda, "imported": True}
    spec = importlib.util.find_spec("torch")   # a top-level name: finds it without running it
    if spec is None:
        return None
    cuda = None
    for where in spec.submodule_search_locations or ():
        version_py = Path(where) / "version.py"
        if version_py.is_file():
            m = re.search(r"^cuda\b[^=]*=\s*['\"]([^'\"]+)['\"]", version_py.read_text(), re.MULTILINE)
            cuda = m.group(1) if m else None
    return {"version": _safe(lambda: importlib.metadata.version("torch")), "cuda": cuda, "imported": False}


def gpu_state() -> dict | None:
    """The GPU the run used when torch initialised CUDA in it, else the GPUs nvidia-smi lists; None without
    either. CUDA is never initialised here."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        i = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(i)
        return {"source": "torch", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_bytes": int(props.total_memory), "cuda": torch.version.cuda, "driver": _driver_version(),
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    rows = _nvidia_smi()
    if not rows:
        return None
    return {"source": "nvidia-smi", "name": rows[0]["name"], "count": len(rows), "names": [r["name"] for r in rows],
            "driver": rows[0]["driver"], "cuda": None, "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}


def _nvidia_smi() -> list[dict]:
    """One {'name', 'driver'} per GPU nvidia-smi lists; [] when it is absent or fails."""
    out = _run("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader")
    rows = []
    for line in (out or "").splitlines():
        name, _, driver = line.rpartition(",")
        if name.strip():
            rows.append({"name": name.strip(), "driver": driver.strip()})
    return rows


def _driver_version() -> str | None:
    rows = _nvidia_smi()
    return rows[0]["driver"] if rows else None


def blas_state() -> dict | None:
    """The BLAS NumPy uses: threadpoolctl's live view (library, version, kernel architecture, threads); the
    architecture is OpenBLAS's core type, which changes the rounding of its GEMMs (FMA or not). Without a loaded
    BLAS found, NumPy's build configuration and the thread variables set in the environment."""
    libs = blas_info()
    if libs:
        p = libs[0]
        return {"source": "threadpoolctl", "name": p.get("internal_api"), "version": p.get("version"),
                "architecture": p.get("architecture"), "threads": p.get("num_threads"),
                "library": p.get("filepath"), "description": describe_blas()}
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    threads = next((os.environ[n] for n in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
                    if os.environ.get(n)), None)
    return {"source": "numpy.show_config", "name": blas.get("name"), "version": blas.get("version"),
            "threads": threads, "library": blas.get("lib directory")}


def env_state() -> dict[str, str]:
    """The environment variables that change what a run computes or how fast (ENV_NAMES, K3_CUDA_*), when set."""
    return {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
