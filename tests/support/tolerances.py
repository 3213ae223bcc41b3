"""Tolerances for the reference tests, one row each, with the reason for the number.

Two independent float64 forms of one formula agree to rounding (~1e-15 relative per op); the rows
below leave headroom for the length of the computation. float32 rows are measured error budgets.
"""
from __future__ import annotations

import numpy as np

# name: (relative-RMS tolerance, reason)
TOL: dict[str, tuple[float, str]] = {
    "fp64_same_math": (1e-12, "two float64 forms of one formula; rounding differs by op order only"),
    "fp64_long_recurrence": (1e-10, "float64 forms through T<=200 recurrent steps / chunked WY solves"),
    "fp32_vs_fp64": (1e-5, "float32 path against float64 golden: ~1e-7 per op over <=100s of ops"),
    "bf16_mix_stand_in": (1e-2, "an AttnRes mix whose inputs and output are rounded to bf16 (2^-9 relative per "
                          "element) against the float64 mix of the same bf16 inputs: measured 5e-3 at K3's width"),
    "fp32_mix_mapping": (1e-6, "the AttnRes mix through an engine's argument mapping, computed in float32 end to "
                         "end, against k3ref's float64 mix: float32 rounding over a few thousand terms"),
    "bf16_kda_stand_in": (1.5e-2, "a KDA prefill on bf16 activations with the fp32 state against the float64 "
                          "recurrence of the same inputs: torch-bf16 errs 3e-3 to 4e-3 on such cases, chunked forms "
                          "that keep bf16 intermediates up to 2x that"),
    "fp32_model": (1e-4, "float32 tiny model vs float64 through 7 layers and the lm_head: measured 2.8e-6 "
                   "(prompt of 7) and 2.0e-6 (prompt of 12) relative RMS on the logits; ~35x headroom for "
                   "another BLAS's summation order"),
}


# name: (rtol, atol, reason) for element-wise checks (np.testing.assert_allclose, np.allclose, pytest.approx):
# |out - want| <= atol + rtol |want| at every element.
ELEMENT: dict[str, tuple[float, float, str]] = {
    "fp64_one_division": (1e-15, 0.0, "float64 weights that differ from the hand formula by one division or "
                          "product each: a few ulp"),
    "fp64_few_ops": (1e-14, 0.0, "float64 results of a handful of ops (an exp, a sqrt, a sigmoid, a sum of <= 8 "
                     "terms) against the same math with the math module: tens of ulp at most"),
    "fp64_hand_loops": (1e-13, 0.0, "a float64 recurrence step against the same formula as Python loops over "
                        "K, V <= 16: different summation order over a few dozen terms"),
    "fp64_conv_loops": (1e-13, 1e-15, "a short convolution against Python loops over W <= 4 taps; atol for outputs "
                        "that cancel to ~0"),
    "fp64_split_sequence": (1e-14, 1e-15, "the same convolution taps applied in two or more pieces of the sequence: "
                            "identical products, only the carried state's copy differs; atol for outputs near 0"),
    "fp64_scale_invariance": (1e-12, 1e-15, "l2norm(c x) against l2norm(x) for c in [1e-3, 1e3]: the scaled sum of "
                              "squares rounds differently by up to ~1e-13 relative; atol for components near 0"),
    "fp64_hand_token": (1e-12, 1e-14, "a whole KDA token written out by hand (convs, two norms, a gated head, "
                        "o_proj over H*K terms): hundreds of float64 ops in another order"),
    "fp32_partials": (1e-5, 0.0, "the CUDA kernel's fp32 split-KV partials (max, sum) in the CPU emulation "
                      "against NumPy's fp32 emulation of the same split: fp32 sums in another order"),
    "fp64_norm_factor": (1e-12, 1e-300, "|l2norm(x)| against sqrt(s) / sqrt(s + eps) for |x| up to 1e3 * sqrt(8): "
                         "a sum of squares and two square roots in another order; atol only keeps x = 0 exact"),
    "scaling_recovered": (1e-6, 0.0, "compare()'s relative RMS and max abs of ref * (1 + eps) against ref, for "
                          "eps >= 1e-6: float64 rounding of the product is ~1e-16 / eps <= 1e-10 relative"),
    "situ_cap_far_out": (0.0, 1e-6, "SiTU at g = 20 against its cap beta tanh(g / beta): the sigmoid factor is "
                         "1 - 2e-9 there, far below this bound, while SiLU (~20) misses it by ~16"),
}

# Effect sizes a test requires (not error tolerances): a change that must show in the output.
# name: (smallest relative-RMS change, reason)
EFFECT: dict[str, tuple[float, str]] = {
    "k_pe_moves_y": (1e-3, "k_pe of O(1) gives O(1) score terms; y moves by O(0.1) relative when they are "
                           "zeroed; a dropped k_pe leaves y bitwise unchanged (effect 0)"),
    "changed_tokens_move_y": (1e-3, "fresh N(0, 1) inputs at the changed positions give O(1) relative changes "
                                    "of their outputs; an expanded form that ignored its own token shows ~0"),
    "attnres_moved_projection": (1e-3, "moving one AttnRes projection weight by 3 / norm_w changes the source "
                                 "weights by O(1); an ignored projection leaves the mix unchanged (effect 0)"),
    "attnres_ablation": (1e-3, "the tiny model without the AttnRes mix (mix = 0) against the product: O(1) "
                         "changes of the logits; an ablation that did nothing shows 0"),
}


def tol(name: str) -> float:
    return TOL[name][0]


def elem(name: str) -> dict[str, float]:
    """The row's rtol and atol, as keyword arguments of np.testing.assert_allclose / np.allclose."""
    rtol, atol, _ = ELEMENT[name]
    return {"rtol": rtol, "atol": atol}


def effect(name: str) -> float:
    return EFFECT[name][0]


def rel_rms(out, ref) -> float:
    """||out - ref|| / ||ref|| (with ||ref|| floored at the smallest normal so zero refs still compare)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = max(float(np.linalg.norm(ref)), np.finfo(np.float64).tiny)
    return float(np.linalg.norm(out - ref) / den)
