"""The K3_CUDA_* contract: K3_CUDA_<KERNEL>=0 (and the short K3_CUDA_KDA / K3_CUDA_MLA) keep the reference core,
and any other K3_CUDA_* name or an unreadable value is refused with the list of known names. No GPU needed."""
from __future__ import annotations

import os

import pytest

import k3cuda
from conformance.backends.builtin import CudaBackend, CudaEmuBackend
from conformance.cli import main as cli_main
from k3ref.cores import CORE_NAMES, Cores


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in [n for n in os.environ if n.startswith(k3cuda.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def _base() -> Cores:
    return Cores(**{name: (lambda *a, _n=name, **k: _n) for name in CORE_NAMES})


@pytest.mark.parametrize("name", ["K3_CUDA_MLA", "K3_CUDA_MLA_DECODE"])
def test_the_mla_escape_keeps_the_reference_mla_decode(monkeypatch, name):
    base = _base()
    assert k3cuda.cuda_cores(base).mla_decode is k3cuda.kernel_module("mla_decode").mla_decode
    monkeypatch.setenv(name, "0")
    cores = k3cuda.cuda_cores(base)
    assert cores.mla_decode is base.mla_decode
    assert cores.kda_decode is k3cuda.kernel_module("kda_decode").kda_decode, "only the MLA kernel is turned off"
    assert not k3cuda.enabled("mla_decode") and k3cuda.enabled("kda_decode")
    assert "mla_decode" not in CudaBackend().kernel_cores() and "kda_decode" in CudaBackend().kernel_cores()


def test_both_mixer_escapes_together(monkeypatch):
    monkeypatch.setenv("K3_CUDA_KDA", "off")
    monkeypatch.setenv("K3_CUDA_MLA", "0")
    base = _base()
    cores = k3cuda.cuda_cores(base)
    assert cores.kda_decode is base.kda_decode and cores.mla_decode is base.mla_decode
    assert cores.rmsnorm is k3cuda.kernel_module("rmsnorm").rmsnorm


def test_known_names_are_every_kernel_and_the_two_aliases():
    names = k3cuda.env_names()
    assert {f"K3_CUDA_{b.upper()}" for b in k3cuda.KERNEL_MODULES} | {"K3_CUDA_KDA", "K3_CUDA_MLA"} == set(names)


@pytest.mark.parametrize("name", ["K3_CUDA_MLAA", "K3_CUDA_ATTN", "K3_CUDA_KDA_PREFILL"])
def test_an_unknown_name_is_refused_with_the_known_ones(monkeypatch, name):
    monkeypatch.setenv(name, "0")
    with pytest.raises(ValueError, match=rf"unknown K3_CUDA_\* environment name\(s\) \['{name}'\]: expected some of "
                                         r"\['K3_CUDA_KDA_DECODE', .*'K3_CUDA_KDA', 'K3_CUDA_MLA'\]"):
        k3cuda.cuda_cores(_base())
    with pytest.raises(ValueError, match=name):
        k3cuda.enabled("rmsnorm")
    for backend in (CudaBackend(), CudaEmuBackend()):
        ok, why = backend.available()
        assert not ok and name in why and "K3_CUDA_MLA" in why


def test_an_unreadable_value_is_refused(monkeypatch):
    monkeypatch.setenv("K3_CUDA_MLA", "O")   # the letter, not zero: the kernel would silently keep running
    with pytest.raises(ValueError, match=r"K3_CUDA_\* value\(s\) \{'K3_CUDA_MLA': 'O'\}: expected one of"):
        k3cuda.cuda_cores(_base())


def test_other_prefixes_are_not_this_contract(monkeypatch):
    """K3CUDA_DEVICE / K3CUDA_CACHE (no underscore) configure the build and runtime: not refused here."""
    monkeypatch.setenv("K3CUDA_DEVICE", "0")
    monkeypatch.setenv("K3_CUDAX", "1")
    k3cuda.check_env()
    assert CudaEmuBackend().available()[0] or "g++" in CudaEmuBackend().available()[1]


@pytest.mark.parametrize("argv", [["run", "--backend", "cuda-emu", "--cases", "rmsnorm"],
                                  ["run", "--tp", "2", "--backend", "numpy64"]])
def test_the_command_line_refuses_an_unknown_name_as_a_usage_error(monkeypatch, capsys, tmp_path, argv):
    pytest.importorskip("torch.distributed")
    monkeypatch.setenv("K3_CUDA_MLA_DECOD", "0")
    assert cli_main([*argv, "--report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown K3_CUDA_* environment name(s) ['K3_CUDA_MLA_DECOD']" in err and "'K3_CUDA_MLA'" in err
    assert not (tmp_path / "report.json").exists()


@pytest.mark.parametrize("argv", [["list", "backends"], ["run", "--cases", "rmsnorm/T1-D113", "--no-timing"]])
def test_the_cli_refuses_an_unknown_k3_cuda_name_as_usage(argv, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("K3_CUDA_MLAA", "0")
    assert cli_main([*argv, "--report", str(tmp_path)] if argv[0] == "run" else argv) == 2
    assert "K3_CUDA_MLAA" in capsys.readouterr().err
