"""The wheel ships what an installed `k3conf run` needs: every committed golden and its manifest, every package on
disk, and a build requirement that can read the project's metadata.

The file list is setuptools' own (its build_py command, configured from pyproject.toml, lists the data files a
wheel gets) without building anything; tools/wheel_check.sh builds the wheel, installs it into a fresh
environment and runs the main job from outside the checkout.
"""
from __future__ import annotations

import json
import tomllib
import warnings
from pathlib import Path

import pytest

from conformance.golden.store import COMMITTED_ROOT, INSTALLED_GOLDEN_PACKAGE, MANIFEST, REPO_ROOT, committed_root

setuptools_config = pytest.importorskip("setuptools.config.pyprojecttoml", reason="needs setuptools (the build "
                                        "backend) to read how pyproject.toml packages the project")
setuptools_dist = pytest.importorskip("setuptools.dist")
requirements = pytest.importorskip("packaging.requirements", reason="needs packaging (comes with pip and pytest)")

PYPROJECT = REPO_ROOT / "pyproject.toml"
CODE_PACKAGES = ("conformance", "k3ref", "k3torch", "k3cuda")
# the first setuptools that reads `project.license` as an SPDX expression string (PEP 639)
SPDX_LICENSE_SETUPTOOLS = "77"


@pytest.fixture(scope="module")
def build_py():
    """The distribution as pyproject.toml configures it, and package -> the data files (relative to the package)
    its wheel holds, as setuptools' build_py command lists them. Read from the repository root, where the
    package-dir paths are rooted; nothing is built or written."""
    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        mp.chdir(REPO_ROOT)
        warnings.simplefilter("ignore")   # setuptools' notes on its own deprecations are not about this project
        dist = setuptools_config.apply_configuration(setuptools_dist.Distribution(), PYPROJECT)
        cmd = dist.get_command_obj("build_py")
        cmd.ensure_finalized()
        data = {pkg: {Path(f).as_posix() for f in files} for pkg, _src, _build, files in cmd.data_files}
    return dist, data


def test_the_wheel_holds_every_committed_golden_and_the_manifest(build_py):
    _, data = build_py
    shipped = data.get(INSTALLED_GOLDEN_PACKAGE, set())
    listed = set(json.loads((REPO_ROOT / "golden" / MANIFEST).read_text())["files"])
    assert listed, "golden/MANIFEST.json lists no file"
    missing = sorted(({MANIFEST} | listed) - shipped)
    assert not missing, (f"the wheel's {INSTALLED_GOLDEN_PACKAGE} lacks {len(missing)} of the {len(listed) + 1} "
                         f"committed golden files, e.g. {missing[:3]}: see [tool.setuptools.package-data]")
    stray = sorted(shipped - listed - {MANIFEST})
    assert not stray, f"the wheel ships golden files the manifest does not list: {stray[:3]}"


def test_the_golden_package_is_the_folder_the_checkout_reads(build_py):
    dist, _ = build_py
    assert Path(dist.package_dir[INSTALLED_GOLDEN_PACKAGE]) == COMMITTED_ROOT.relative_to(REPO_ROOT)


def _packages_on_disk() -> set[str]:
    """Every folder of the code packages that holds Python source."""
    return {".".join(p.parent.relative_to(REPO_ROOT).parts)
            for top in CODE_PACKAGES for p in (REPO_ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}


def test_every_package_on_disk_is_declared(build_py):
    dist, _ = build_py
    undeclared = sorted(_packages_on_disk() - set(dist.packages))
    assert not undeclared, (f"package(s) {undeclared} are not in pyproject.toml's [tool.setuptools] packages: "
                            "the wheel would lack them")
    gone = sorted(p for p in dist.packages
                  if not (REPO_ROOT / dist.package_dir.get(p, p.replace(".", "/"))).is_dir())
    assert not gone, f"pyproject.toml declares package(s) {gone} that have no folder"


def test_the_kernel_sources_ship_with_k3cuda(build_py):
    _, data = build_py
    kernels = REPO_ROOT / "k3cuda" / "kernels"
    on_disk = {f"kernels/{p.name}" for p in kernels.iterdir() if p.suffix in (".cu", ".cuh")}
    assert on_disk, f"no kernel source in {kernels}"
    missing = sorted(on_disk - data.get("k3cuda", set()))
    assert not missing, f"the wheel's k3cuda lacks {missing}: see [tool.setuptools.package-data]"


def test_the_build_requirement_reads_the_license_metadata():
    """An SPDX expression string as `project.license` needs setuptools >= 77; an older one rejects the metadata."""
    pyproject = tomllib.loads(PYPROJECT.read_text())
    license_field = pyproject["project"]["license"]
    assert isinstance(license_field, str), "expected `license` as an SPDX expression string (PEP 639)"
    (setuptools_req,) = [r for r in map(requirements.Requirement, pyproject["build-system"]["requires"])
                         if r.name == "setuptools"]
    assert not setuptools_req.specifier.contains("76.3"), (
        f"build-system requires {setuptools_req}: admits a setuptools older than {SPDX_LICENSE_SETUPTOOLS}, which "
        f"cannot read license = {license_field!r}")
    assert setuptools_req.specifier.contains(f"{SPDX_LICENSE_SETUPTOOLS}.0")


@pytest.mark.parametrize("layout, expected", [
    pytest.param({"pyproject.toml": "", "golden/MANIFEST.json": "{}"}, "golden", id="checkout"),
    pytest.param({f"{INSTALLED_GOLDEN_PACKAGE}/MANIFEST.json": "{}", "conformance/__init__.py": ""},
                 INSTALLED_GOLDEN_PACKAGE, id="installed-wheel"),
])
def test_the_committed_root_of_a_checkout_and_of_an_installed_wheel(tmp_path, layout, expected):
    for name, text in layout.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert committed_root(tmp_path) == tmp_path / expected
    assert (committed_root(tmp_path) / MANIFEST).is_file()


def test_this_checkout_reads_golden():
    assert COMMITTED_ROOT == REPO_ROOT / "golden" and (COMMITTED_ROOT / MANIFEST).is_file()
