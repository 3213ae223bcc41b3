"""The baselines' measured worst errors, from which the gate table derives the measured rows.

Each entry: the worst relative RMS error of numpy32 (fp32) and of torch-bf16 (bf16) and where it was measured.
Re-measure with `k3conf run --no-timing` (add `--cases 'trace/*'` for the traces) after a change that moves
a baseline's error, and write the new worst here with the tensor or case that set it.
"""
from __future__ import annotations

# (block, tensor) -> worst relative RMS error of numpy32 (fp32) and torch-bf16 (bf16) over the tiny cases,
# measured with `k3conf run --no-timing` (torch 2.13 CPU, NumPy/OpenBLAS) and the case that set it.
BLOCK_CASES = {
    ("rmsnorm", "y"): ((6.4e-8, "rmsnorm/T3-D239-eps1e-6"), (3.3e-3, "rmsnorm/T7-D203")),
    ("situ_glu", "h"): ((9.6e-8, "situ_glu/I239"), (2.4e-3, "situ_glu/I239")),
    ("kda_decode", "o"): ((1.6e-7, "kda_decode/B1-H1-K128"), (2.3e-3, "kda_decode/B1-H1-K128")),
    ("kda_decode", "state"): ((8.2e-8, "kda_decode/B2-H2-K16-nolb"), (1.5e-3, "kda_decode/B2-H3-K16")),
    ("kda_prefill", "o"): ((4.6e-7, "kda_prefill/B1-T65-H3-K32"), (3.3e-3, "kda_prefill/B1-T65-H3-K32")),
    ("kda_prefill", "state"): ((2.9e-6, "kda_prefill/B2-T63-H2-K16"), (2.3e-3, "kda_prefill/B1-T65-H3-K32")),
    ("mla_decode", "o_lat"): ((4.2e-7, "mla_decode/B1-H2-R512-P64-L70"),
                              (6.4e-3, "mla_decode/B3-H1-R64-P16-L64-113-203")),
    ("mxfp4_gemv", "y"): ((1.9e-7, "mxfp4_gemv/N1-K32"), (2.0e-3, "mxfp4_gemv/N1-K32")),
    ("moe_route", "weights"): ((6.7e-8, "moe_route/T1-E8-k2"), (6.7e-8, "moe_route/T1-E8-k2; the router is fp32")),
    ("attnres_mix", "out"): ((1.8e-7, "attnres_mix/S3-T5-D113"), (2.8e-3, "attnres_mix/S3-T5-D113")),
    ("latent_moe", "y"): ((1.9e-7, "latent_moe/T5-D67-E8-k2-L32-I32-S1"),
                          (5.7e-3, "latent_moe/T3-D48-E8-k2-G2-g1-norenorm")),
}

# The model traces, measured with `k3conf run --cases 'trace/*' --no-timing` on the tiny traces (torch 2.13 CPU,
# NumPy/OpenBLAS): block -> worst relative RMS error of numpy32 and of torch-bf16 (router and argmax near-ties
# teacher-forced) over the gated tensors of both traces, and the tensor that set it. The lm_head row is the free
# run's logits: bf16 error accumulates through 7 layers x 6 steps to 8e-2 there (the layerwise logits err 5x
# less). These are the shared rows ('*/step*') every model config starts from; a config with its own
# measurements adds an entry to TRACES_BY_MODEL in the gate table.
TINY_TRACES = {
    "attnres_mix": ((3.5e-7, "layerwise step5.layer03.4_m"), (9.8e-3, "layerwise step2.layer00.4_m")),
    "rmsnorm": ((3.4e-7, "layerwise step5.layer03.5_x_mlp"), (7.5e-3, "layerwise step2.layer00.5_x_mlp")),
    "kda_prefill": ((3.8e-7, "layerwise step0.layer01.7_cache"), (1.25e-2, "layerwise step0.layer04.3_a")),
    "kda_decode": ((3.8e-7, "layerwise step3.layer01.3_a"), (1.13e-2, "layerwise step2.layer00.3_a")),
    "mla_prefill": ((2.4e-7, "layerwise step0.layer02.3_a"), (9.5e-3, "layerwise step0.layer02.3_a")),
    "mla_decode": ((2.9e-7, "layerwise step4.layer02.3_a"), (9.0e-3, "layerwise step4.layer06.3_a")),
    "situ_glu": ((4.3e-7, "layerwise step4.layer00.6_f"), (1.6e-2, "layerwise step2.layer00.6_f")),
    "latent_moe": ((6.5e-7, "layerwise step5.layer03.6_f"), (1.8e-2, "layerwise step1.layer04.6_f")),
    "lm_head": ((8.7e-6, "free step0.logits"), (8.2e-2, "free step1.logits")),
}
TINY_TRACES_WHERE = "tiny trace/*-P7-D5"
