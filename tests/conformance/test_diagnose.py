"""The shape of the error (conformance.judge.diagnose): planted bugs on committed goldens are named with their
evidence (a scale, a head swap, a split, a sign flip, a row range, a NaN's origin), low-precision noise is not, and
a failing run's first-failure line carries the diagnosis."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conformance.backends.mutants import MUTANTS
from conformance.backends.registry import NumpyBackend, get_backend
from conformance.cases.catalog import all_cases, kind_of, select
from conformance.golden.store import COMMITTED_ROOT, load_manifest, read_golden
from conformance.judge import diagnose as diag
from conformance.judge.compare import check_outputs
from conformance.runner import run
from k3ref.cores import reference_cores

KDA_O = ("B", "T", "H", "V")
# K3's q scale sqrt(128/192) = 0.816 or a hard-coded 1/sqrt(8) = 0.354: a wrong constant the output carries
HARD_CODED_SCALE = 8 ** -0.5


def _golden(name: str):
    return read_golden(COMMITTED_ROOT, name, load_manifest(COMMITTED_ROOT), "tiny")


def _core_args(golden) -> dict:
    return {**golden.group("inputs"), **golden.kwargs}


# ---- axis names from the cores' docstrings


@pytest.mark.parametrize("core, tensor, ndim, names", [
    pytest.param("kda_decode", "o", 3, ("B", "H", "V"), id="kda_decode-o"),
    pytest.param("kda_prefill", "o", 4, KDA_O, id="kda_prefill-o"),
    pytest.param("kda_decode", "state", 4, ("B", "H", "K", "V"), id="kda_decode-state-not-new_state"),
    pytest.param("kda_decode_pool", "state_pool", 4, ("S", "H", None, None), id="pool-kv-or-vk"),
    pytest.param("kda_prefill_varlen", "o", 4, (None, "T", "H", "V"), id="varlen-leading-1"),
    pytest.param("add_rmsnorm", "y", 3, (None, None, "D"), id="ellipsis"),
    pytest.param("mla_prefill", "lse", 2, ("Tq", "H"), id="mla_prefill-lse"),
    pytest.param("mla_decode", "o_lat", 4, None, id="other-rank"),
    pytest.param("rmsnorm", "y", 2, None, id="unnamed-output"),
    pytest.param("trace", "o", 3, None, id="not-a-core"),
])
def test_axis_names_come_from_the_core_docstring(core, tensor, ndim, names):
    assert diag.axis_names(core, tensor, ndim) == names


def test_bad_input_says_what_was_expected():
    with pytest.raises(ValueError, match=r"one shape, found \[2, 3\] and \[3, 2\]"):
        diag.diagnose(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"expected 2 axis names for shape \[2, 3\], found 1"):
        diag.diagnose(np.zeros((2, 3)), np.zeros((2, 3)), ["B"])
    assert diag.diagnose_tensor(np.zeros((2, 3)), np.zeros((3, 2)), "kda_decode", "o") is None


# ---- planted bugs


def test_a_direct_output_scale_is_a_constant_ratio():
    ref = _golden("mla_decode/B2-H3-R32-P16-L65-1").group("outputs")["o_lat"]
    line = diag.diagnose_tensor(ref * HARD_CODED_SCALE, ref, "mla_decode", "o_lat")
    assert line is not None and line.startswith("constant ratio out/ref = 0.3536 (+-0.0%) over 100% of elements")
    assert line.endswith("a scale")


def test_the_softmax_scale_mutant_is_not_called_an_output_scale():
    """mla-scale-128 changes the scores' scale: the output is a re-weighted mean, not a multiple of the reference,
    so claiming a constant output ratio would send its author to the wrong place."""
    golden = _golden("mla_decode/B2-H3-R32-P16-L65-1")
    ref = golden.group("outputs")["o_lat"]
    out = MUTANTS["mla-scale-128"].make(reference_cores()).mla_decode(**_core_args(golden))
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) > 1e-3      # the bug shows
    line = diag.diagnose_tensor(out, ref, "mla_decode", "o_lat")
    assert "constant ratio" not in (line or "")


def test_swapped_heads_are_named_with_the_permutation():
    golden = _golden("kda_decode/B2-H3-K16")
    ref = golden.group("outputs")["o"]
    out = ref[:, [2, 1, 0]]
    line = diag.diagnose_tensor(out, ref, "kda_decode", "o")
    assert line == ("errors only on heads 0, 2 of 3 (axis 1: H); "
                    "heads permuted: out 0 = ref 2, out 2 = ref 0: a layout / index mix-up")


def test_a_split_that_drops_the_carried_state_shows_from_its_position_on():
    """kda_prefill run as two halves, the second from the initial state instead of the first half's final one."""
    golden = _golden("kda_prefill/B2-T63-H2-K16")
    args, ref = _core_args(golden), golden.group("outputs")["o"]
    split = 40
    per_token = ("q", "k", "v", "g_raw", "beta_raw")
    head = reference_cores().kda_prefill(**{**args, **{n: args[n][:, :split] for n in per_token}})[0]
    tail = reference_cores().kda_prefill(**{**args, **{n: args[n][:, split:] for n in per_token}})[0]
    out = np.concatenate([head, tail], axis=1)
    line = diag.diagnose_tensor(out, ref, "kda_prefill", "o")
    assert line == "errors only from position 40 on, of 63 (axis 1: T): a split / chunk boundary / masking"


def test_a_sign_flip_on_some_elements():
    ref = _golden("kda_prefill/B1-T65-H3-K32").group("outputs")["o"]
    flip = np.random.default_rng(3).random(ref.shape) < 0.49
    line = diag.diagnose(np.where(flip, -ref, ref), ref, KDA_O)
    share = 100 * np.mean(flip[np.abs(ref) > diag.SMALL_REF * np.sqrt(np.mean(ref ** 2))])
    assert line == f"sign flipped on {share:.3g}% of elements (out = -ref there)"


def test_errors_on_a_range_of_rows():
    ref = np.random.default_rng(4).standard_normal((16, 64))
    out = ref.copy()
    out[:4] += np.random.default_rng(5).standard_normal((4, 64))
    assert diag.diagnose(out, ref) == "errors only on indices 0-3 of 16 (axis 0)"
    assert diag.diagnose(out, ref, ("B", "D")) == "errors only on rows 0-3 of 16 (axis 0: B)"


def test_a_scale_on_some_rows_says_where_and_what():
    ref = _golden("kda_decode/B3-H2-K32-V16").group("outputs")["o"]
    out = ref.copy()
    out[1] *= 1.5
    assert diag.diagnose_tensor(out, ref, "kda_decode", "o") == (
        "errors only on row 1 of 3 (axis 0: B); "
        "there constant ratio out/ref = 1.5 (+-0.0%) over 100% of elements: a scale")


def test_a_nan_is_traced_to_its_origin():
    """A NaN born in one head's state at token 20 reaches that head's o at every later token (the references refuse
    NaN inputs, so the spread a kernel's NaN makes is planted): the first one in index order is where it was born."""
    ref = _golden("kda_prefill/B2-T63-H2-K16").group("outputs")["o"]
    out = ref.copy()
    out[1, 20:, 1, :] = np.nan
    out[1, 40, 1, 3] = np.inf
    line = diag.diagnose_tensor(out, ref, "kda_prefill", "o")
    n_bad = 43 * ref.shape[-1]
    assert line == (f"non-finite mismatch at {n_bad} of {ref.size} elements; first NaN at [1, 20, 1, 0] "
                    "(B, T, H, V) (the origin: first in index order)")


def test_one_wrong_element():
    ref = _golden("mla_prefill/5of5-3of11-1of1-H2-D32-V16").group("outputs")["o"]
    out = ref.copy()
    out[4, 1, 7] += 1.0
    assert diag.diagnose_tensor(out, ref, "mla_prefill", "o") == "errors at one element only, [4, 1, 7]"


# ---- noise is no pattern


def _bf16(a: np.ndarray) -> np.ndarray:
    """a rounded to bfloat16 (8 significant bits), back in float64."""
    bits = np.asarray(a, np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("name, tensor", [
    pytest.param("kda_prefill/B1-T65-H3-K32", "o", id="kda_prefill"),
    pytest.param("kda_decode_pool/B4-S6-H2-K16-kv-pad2", "o", id="pool-padded-rows"),
    pytest.param("mla_decode/B2-H17-R64-P16-L33-20-bf16", "o_lat", id="mla_decode"),
    pytest.param("add_rmsnorm/T5-D203", "y", id="add_rmsnorm"),
])
def test_bf16_rounding_and_noise_get_no_diagnosis(name, tensor):
    """Rounding to bf16 and a relative noise of 2^-8 on every element: no axis, ratio or sign pattern. The padded
    rows of a pool are zero on both sides and must not make the other rows look 'confined'."""
    ref = _golden(name).group("outputs")[tensor]
    core = name.split("/")[0]
    assert diag.diagnose_tensor(_bf16(ref), ref, core, tensor) is None
    noise = 2.0 ** -8 * np.random.default_rng(6).standard_normal(ref.shape)
    assert diag.diagnose_tensor(ref * (1 + noise), ref, core, tensor) is None


def test_rounding_beside_untouched_slots_is_no_pattern():
    """A decode step rewrites only its rows' slots: bf16 rounding there beside exact untouched slots is no 'slot'
    pattern, while a 10% error on the same slots is one."""
    golden = _golden("kda_decode_pool/B3-S5-H2-K16-vk-pad1")
    ref = golden.group("outputs")["state_pool"]
    slots = golden.group("inputs")["slots"]
    written = np.sort(slots[slots >= 0])
    out = ref.copy()
    out[written] = _bf16(ref[written])
    assert diag.diagnose_tensor(out, ref, "kda_decode_pool", "state_pool") is None
    out[written] = ref[written] * (1 + 0.1 * np.random.default_rng(9).standard_normal(ref[written].shape))
    listed = ", ".join(str(int(s)) for s in written)
    assert diag.diagnose_tensor(out, ref, "kda_decode_pool", "state_pool") == (
        f"errors only on slots {listed} of {ref.shape[0]} (axis 0: S)")


def test_the_bf16_baseline_gets_no_diagnosis():
    """torch-bf16's real error on a prefill (it grows along the recurrence) and on an MLA decode: no pattern."""
    backend = get_backend("torch-bf16")
    if not backend.available()[0]:
        pytest.skip(f"torch-bf16 cannot run here: {backend.available()[1]}")
    for case in select(all_cases("tiny"), ["kda_prefill/B1-T65-H3-K32", "mla_decode/B2-H3-R32-P16-L65-1"]):
        golden = _golden(case.name)
        outs = kind_of(case).evaluate(case, golden, backend).outputs
        for tensor, ref in golden.group("outputs").items():
            assert np.linalg.norm(outs[tensor] - ref) > 0, "bf16 noise expected"
            assert diag.diagnose_tensor(outs[tensor], ref, case.block, tensor) is None, (case.name, tensor)


# ---- K3 size: sampled, deterministic


def test_a_k3_size_state_pool_is_sampled_and_still_named():
    """A [S, H, K, V] fp32 state pool of 8M elements (over MAX_SAMPLES): one head halved is found on the sample."""
    ref = np.random.default_rng(7).standard_normal((16, 32, 128, 128)).astype(np.float32)
    assert ref.size > diag.MAX_SAMPLES
    out = ref.copy()
    out[:, 5] *= 0.5
    first = diag.diagnose_tensor(out, ref, "kda_decode_pool", "state_pool")
    assert first == ("errors only on head 5 of 32 (axis 1: H); "
                     "there constant ratio out/ref = 0.5 (+-0.0%) over 100% of elements: a scale")
    assert diag.diagnose_tensor(out, ref, "kda_decode_pool", "state_pool") == first


# ---- where it is shown


def test_check_outputs_lines_carry_the_shape_of_the_error():
    ref = np.random.default_rng(8).standard_normal((4, 8))
    fails = check_outputs("kernel", -ref, ref, 1e-3)
    assert len(fails) == 1 and fails[0].endswith("; shape of the error: sign flipped on 100% of elements "
                                                 "(out = -ref there)")


def _head_swap(base):
    def decode(*args, **kwargs):
        o, state = base.kda_decode(*args, **kwargs)
        return o[:, ::-1].copy(), state

    return base.replace(kda_decode=decode)


@dataclasses.dataclass
class HeadSwap(NumpyBackend):
    """numpy64 whose kda_decode returns the heads of o in reverse order (a layout bug)."""

    def kernel_cores(self):
        return frozenset({"kda_decode"})


def test_a_run_names_the_swapped_heads_in_its_first_failure_line(extra_backend):
    extra_backend("headswap64", lambda: HeadSwap("headswap64", "fp64", lambda: _head_swap(reference_cores())))
    cases = select(all_cases("tiny"), ["kda_decode/B2-H3-K16"])
    report = run(cases, ["headswap64"], COMMITTED_ROOT, timing=False, in_process=frozenset({"headswap64"}))
    line = report.first_failure_line()
    assert report.exit_code == 1
    assert line.startswith("FIRST FAILURE: kda_decode/B2-H3-K16 on headswap64: outputs.o (block kda_decode): ")
    assert ("; shape of the error: errors only on heads 0, 2 of 3 (axis 1: H); "
            "heads permuted: out 0 = ref 2, out 2 = ref 0: a layout / index mix-up [") in line
    tensors = report.to_dict()["results"][0]["tensors"]
    assert {t["tensor"]: t["diagnosis"] for t in tensors}["state"] is None     # the state is right: no diagnosis
