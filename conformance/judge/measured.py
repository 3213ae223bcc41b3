"""The baselines' measured worst errors, per shape set, from which the gate table derives the measured rows.

Each entry: the worst relative RMS error of numpy32 (fp32) and of torch-bf16 (bf16) and where it was measured.
A cap holds on the shapes it was measured on, and only there: the tiny cases' caps do not hold at small's shapes
(attnres_mix at D=1024 over 9 sources: logits up to |47|, so rounding the inputs to bf16 moves the softmax by 1.5%,
5x tiny's worst). So every measurement is keyed by its shape set (the case's `config`: tiny, small, k3, ...), and a
case is gated by the caps measured on its own set; a set with no measurement of its own borrows none
(conformance.judge.gates: no cap there, k x baseline + floor alone). Re-measure a set with
`k3conf run --config SET --no-timing` (add `--cases 'trace/*'` for the traces) after a change that moves a
baseline's error, and write the new worst here with the case that set it.
"""
from __future__ import annotations

# shape set -> how its measurements were taken
MEASURED_WITH = {
    "tiny": "`k3conf run --no-timing` on the committed tiny goldens (torch 2.13 CPU, NumPy 2.4/OpenBLAS)",
    "small": "`k3conf run --config small --no-timing` on the small goldens `k3conf regen --config small` writes "
             "(torch 2.13 CPU, NumPy 2.4/OpenBLAS)",
    "k3": "`k3conf run --shapes k3 --no-timing` on the goldens `k3conf regen --shapes k3` writes (torch 2.13 CPU, "
          "NumPy 2.4/OpenBLAS; 19 cases, 6 min on 2 shared cores; the 7 engine-shaped cases: 79 s with their regen)",
    "k3-tp8": "`k3conf run --shapes k3-tp8 --no-timing` on the goldens `k3conf regen --shapes k3-tp8` writes "
              "(torch 2.13 CPU, NumPy 2.4/OpenBLAS; 10 cases, 2 min; the 8 engine-shaped cases: 76 s with their regen)",
}

# shape set -> (block, tensor) -> worst relative RMS error of numpy32 (fp32) and torch-bf16 (bf16) over that set's
# cases, and the case that set it.
BLOCK_CASES = {
    "tiny": {
        ("rmsnorm", "y"): ((6.4e-8, "rmsnorm/T3-D239-eps1e-6"), (3.3e-3, "rmsnorm/T7-D203")),
        ("situ_glu", "h"): ((9.6e-8, "situ_glu/I239"), (2.4e-3, "situ_glu/I239")),
        ("kda_decode", "o"): ((1.6e-7, "kda_decode/B1-H1-K128"), (2.3e-3, "kda_decode/B1-H1-K128")),
        ("kda_decode", "state"): ((8.2e-8, "kda_decode/B2-H2-K16-nolb"), (1.5e-3, "kda_decode/B2-H3-K16")),
        ("kda_prefill", "o"): ((4.6e-7, "kda_prefill/B1-T65-H3-K32"), (3.3e-3, "kda_prefill/B1-T65-H3-K32")),
        ("kda_prefill", "state"): ((2.9e-6, "kda_prefill/B2-T63-H2-K16"), (2.3e-3, "kda_prefill/B1-T65-H3-K32")),
        ("mla_decode", "o_lat"): ((4.2e-7, "mla_decode/B1-H2-R512-P64-L70"),
                                  (6.4e-3, "mla_decode/B3-H1-R64-P16-L64-113-203")),
        ("mxfp4_gemv", "y"): ((1.9e-7, "mxfp4_gemv/N1-K32"), (2.0e-3, "mxfp4_gemv/N1-K32")),
        ("moe_route", "weights"): ((6.7e-8, "moe_route/T1-E8-k2"),
                                   (6.7e-8, "moe_route/T1-E8-k2; the router is fp32")),
        ("attnres_mix", "out"): ((1.8e-7, "attnres_mix/S3-T5-D113"), (2.8e-3, "attnres_mix/S3-T5-D113")),
        ("latent_moe", "y"): ((1.9e-7, "latent_moe/T5-D67-E8-k2-L32-I32-S1"),
                              (5.7e-3, "latent_moe/T3-D48-E8-k2-G2-g1-norenorm")),
        # the engine-shaped cores (k3ref.engine)
        ("kda_decode_pool", "o"): ((1.8e-7, "kda_decode_pool/B2-S1-H1-K128-vk-pad1"),
                                   (2.9e-3, "kda_decode_pool/B3-S5-H2-K16-vk-pad1")),
        ("kda_decode_pool", "state_pool"): ((5.3e-8, "kda_decode_pool/B2-S1-H1-K128-vk-pad1"),
                                            (6.0e-4, "kda_decode_pool/B2-S4-H2-K16-vk-nolb")),
        ("kda_conv_pool", "conv_pool"): ((2.7e-8, "kda_conv_pool/B1-S2-C17-cw"),
                                         (1.7e-3, "kda_conv_pool/B4-S7-C40-wc-pad2")),
        ("kda_conv_pool", "y"): ((1.3e-7, "kda_conv_pool/B1-S2-C17-cw"), (3.0e-3, "kda_conv_pool/B3-S5-C24-cw-pad1")),
        ("kda_prefill_varlen", "o"): ((1.8e-7, "kda_prefill_varlen/N1-T3-S1-H1-K128-vk"),
                                      (3.9e-3, "kda_prefill_varlen/N1-T17-S2-H2-K16-vk-nolb")),
        ("kda_prefill_varlen", "state_pool"): ((1.5e-7, "kda_prefill_varlen/N1-T3-S1-H1-K128-vk"),
                                               (8.6e-4, "kda_prefill_varlen/N3-T6-S4-H2-K16-V8-vk")),
        ("mla_decode_fp8", "o_lat"): ((4.3e-7, "mla_decode_fp8/B3-H1-R128-P16-page64-L65-0-0"),
                                      (5.5e-3, "mla_decode_fp8/B2-H2-R512-P64-page64-L33-0")),
        ("mla_prefill", "lse"): ((7.2e-8, "mla_prefill/1of7-4of4-H1-D24-V40"),
                                 (1.5e-3, "mla_prefill/5of5-3of11-1of1-H2-D32-V16")),
        ("mla_prefill", "o"): ((1.7e-7, "mla_prefill/5of13-3of3-H2-D192-V128"),
                               (3.3e-3, "mla_prefill/1of7-4of4-H1-D24-V40")),
        ("moe_experts", "y"): ((5.0e-7, "moe_experts/T2-E2-k2-Dl224-I192"),
                               (4.3e-3, "moe_experts/T2-E2-k2-Dl224-I192")),
        ("add_rmsnorm", "residual_out"): ((3.8e-8, "add_rmsnorm/T5-D203"), (2.4e-3, "add_rmsnorm/T5-D203")),
        ("add_rmsnorm", "y"): ((7.0e-8, "add_rmsnorm/T5-D203"), (3.8e-3, "add_rmsnorm/T1-D7168")),
    },
    # one case per block; the bf16 attnres_mix error is the bf16 rounding of its inputs (the same inputs rounded
    # to bf16 and mixed in float64 err 1.50e-2), not torch's arithmetic
    "small": {
        ("rmsnorm", "y"): ((7.7e-8, "rmsnorm/T16-D1024"), (3.4e-3, "rmsnorm/T16-D1024")),
        ("situ_glu", "h"): ((8.4e-8, "situ_glu/T16-I1536"), (2.3e-3, "situ_glu/T16-I1536")),
        ("kda_decode", "o"): ((2.2e-7, "kda_decode/B4-H8-K128"), (2.4e-3, "kda_decode/B4-H8-K128")),
        ("kda_decode", "state"): ((6.4e-8, "kda_decode/B4-H8-K128"), (8.4e-4, "kda_decode/B4-H8-K128")),
        ("kda_prefill", "o"): ((7.8e-7, "kda_prefill/B1-T257-H4-K128"), (3.3e-3, "kda_prefill/B1-T257-H4-K128")),
        ("kda_prefill", "state"): ((1.3e-6, "kda_prefill/B1-T257-H4-K128"),
                                   (2.4e-3, "kda_prefill/B1-T257-H4-K128")),
        ("mla_decode", "o_lat"): ((6.1e-7, "mla_decode/B4-H8-R512-P64-L1-64-65-700"),
                                  (4.6e-3, "mla_decode/B4-H8-R512-P64-L1-64-65-700")),
        ("mxfp4_gemv", "y"): ((2.2e-7, "mxfp4_gemv/M4-N1024-K1536"), (1.6e-3, "mxfp4_gemv/M4-N1024-K1536")),
        ("moe_route", "weights"): ((5.6e-8, "moe_route/T32-E128-k8"),
                                   (5.8e-8, "moe_route/T32-E128-k8; the router is fp32")),
        ("attnres_mix", "out"): ((6.4e-7, "attnres_mix/S9-T16-D1024"), (1.51e-2, "attnres_mix/S9-T16-D1024")),
        ("latent_moe", "y"): ((4.9e-7, "latent_moe/T8-D512-E32-k4-L256-I256-S2"),
                              (6.0e-3, "latent_moe/T8-D512-E32-k4-L256-I256-S2")),
        # the engine-shaped cores (k3ref.engine)
        ("moe_experts", "y"): ((4.6e-7, "moe_experts/T16-E32-k8-Dl512-I384"),
                               (3.6e-3, "moe_experts/T16-E32-k8-Dl512-I384")),
        ("add_rmsnorm", "residual_out"): ((3.7e-8, "add_rmsnorm/T16-D1024"), (2.4e-3, "add_rmsnorm/T16-D1024")),
        ("add_rmsnorm", "y"): ((8.0e-8, "add_rmsnorm/T16-D1024"), (3.8e-3, "add_rmsnorm/T16-D1024")),
    },
    # K3's block sizes at K3's magnitudes (the goldens `k3conf regen --shapes k3` writes); no latent_moe case
    "k3": {
        ("rmsnorm", "y"): ((7.5e-8, "rmsnorm/T192-D128"), (3.7e-3, "rmsnorm/T192-D128")),
        ("situ_glu", "h"): ((9.5e-8, "situ_glu/T32-I3072"), (3.0e-3, "situ_glu/T32-I6144")),
        ("kda_decode", "o"): ((1.7e-7, "kda_decode/B2-H96-K128-hist1024"), (2.5e-3, "kda_decode/B4-H96-K128-hist32")),
        ("kda_decode", "state"): ((9.4e-8, "kda_decode/B2-H96-K128-hist1024"),
                                  (2.0e-3, "kda_decode/B4-H96-K128-hist32")),
        ("kda_prefill", "o"): ((5.5e-7, "kda_prefill/B2-T64-H96-K128"), (3.0e-3, "kda_prefill/B2-T64-H96-K128")),
        ("kda_prefill", "state"): ((2.8e-6, "kda_prefill/B2-T64-H96-K128"), (2.4e-3, "kda_prefill/B2-T64-H96-K128")),
        ("mla_decode", "o_lat"): ((6.0e-7, "mla_decode/B2-H96-R512-P64-L32768-1000-bf16"),
                                  (3.5e-3, "mla_decode/B64-H96-R512-P64-mixed")),
        ("mxfp4_gemv", "y"): ((3.6e-7, "mxfp4_gemv/M1-N3072-K3584"), (1.7e-3, "mxfp4_gemv/M1-N3072-K3584")),
        ("moe_route", "weights"): ((5.4e-8, "moe_route/T64-E896-k16"),
                                   (6.5e-8, "moe_route/T64-E896-k16; the router is fp32")),
        ("attnres_mix", "out"): ((7.3e-7, "attnres_mix/S9-T16-D7168"), (1.2e-2, "attnres_mix/S9-T16-D7168")),
        # the engine-shaped cores (k3ref.engine)
        ("kda_decode_pool", "o"): ((2.2e-7, "kda_decode_pool/B4-S5-H96-K128-vk-pad1-hist64"),
                                   (2.3e-3, "kda_decode_pool/B4-S5-H96-K128-vk-pad1-hist64")),
        ("kda_decode_pool", "state_pool"): ((7.5e-8, "kda_decode_pool/B4-S5-H96-K128-vk-pad1-hist64"),
                                            (1.5e-3, "kda_decode_pool/B4-S5-H96-K128-vk-pad1-hist64")),
        ("kda_conv_pool", "conv_pool"): ((2.5e-8, "kda_conv_pool/B8-S16-C36864-cw-pad2"),
                                         (1.7e-3, "kda_conv_pool/B8-S16-C36864-cw-pad2")),
        ("kda_conv_pool", "y"): ((8.1e-8, "kda_conv_pool/B8-S16-C36864-cw-pad2"),
                                 (2.5e-3, "kda_conv_pool/B8-S16-C36864-cw-pad2")),
        ("kda_prefill_varlen", "o"): ((2.3e-7, "kda_prefill_varlen/N3-T128-S3-H96-K128-kv"),
                                      (3.0e-3, "kda_prefill_varlen/N3-T128-S3-H96-K128-kv")),
        ("kda_prefill_varlen", "state_pool"): ((8.1e-8, "kda_prefill_varlen/N3-T128-S3-H96-K128-kv"),
                                               (1.8e-3, "kda_prefill_varlen/N3-T128-S3-H96-K128-kv")),
        ("mla_decode_fp8", "o_lat"): ((2.6e-7, "mla_decode_fp8/B16-H96-R512-P64-page64-mixed"),
                                      (2.9e-3, "mla_decode_fp8/B16-H96-R512-P64-page64-mixed")),
        ("mla_prefill", "lse"): ((7.5e-8, "mla_prefill/512of1536-509of1533-H8-D192-V128"),
                                 (3.7e-5, "mla_prefill/512of1536-509of1533-H8-D192-V128")),
        ("mla_prefill", "o"): ((8.4e-7, "mla_prefill/512of1536-509of1533-H8-D192-V128"),
                               (3.7e-3, "mla_prefill/512of1536-509of1533-H8-D192-V128")),
        ("moe_experts", "y"): ((5.5e-7, "moe_experts/T4-E8-k6-Dl3584-I3072"),
                               (3.4e-3, "moe_experts/T4-E8-k6-Dl3584-I3072")),
        ("add_rmsnorm", "residual_out"): ((3.6e-8, "add_rmsnorm/T32-D7168"), (2.4e-3, "add_rmsnorm/T32-D7168")),
        ("add_rmsnorm", "y"): ((7.7e-8, "add_rmsnorm/T32-D7168"), (3.8e-3, "add_rmsnorm/T32-D7168")),
    },
    # one rank's share of K3 at tensor parallelism 8 (12 heads), K3's magnitudes; the blocks TP splits by heads
    "k3-tp8": {
        ("rmsnorm", "y"): ((7.2e-8, "rmsnorm/T32-D7168"), (4.1e-3, "rmsnorm/T24-D128")),
        ("situ_glu", "h"): ((9.0e-8, "situ_glu/T32-I768"), (3.1e-3, "situ_glu/T32-I768")),
        ("kda_decode", "o"): ((1.9e-7, "kda_decode/B2-H12-K128-hist8192"), (3.8e-3, "kda_decode/B4-H12-K128-hist1024")),
        ("kda_decode", "state"): ((9.4e-8, "kda_decode/B4-H12-K128-hist1024"),
                                  (2.5e-3, "kda_decode/B2-H12-K128-hist8192")),
        ("kda_prefill", "o"): ((7.4e-7, "kda_prefill/B2-T512-H12-K128"), (3.3e-3, "kda_prefill/B1-T8192-H2-K128")),
        ("kda_prefill", "state"): ((3.8e-6, "kda_prefill/B2-T512-H12-K128"), (2.9e-3, "kda_prefill/B1-T8192-H2-K128")),
        ("mla_decode", "o_lat"): ((4.1e-7, "mla_decode/B64-H12-R512-P64-mixed"),
                                  (3.5e-3, "mla_decode/B64-H12-R512-P64-mixed")),
        # the engine-shaped cores (k3ref.engine)
        ("kda_decode_pool", "o"): ((2.6e-7, "kda_decode_pool/B8-S16-H12-K128-kv-pad2-hist64"),
                                   (5.9e-3, "kda_decode_pool/B8-S16-H12-K128-kv-pad2-hist64")),
        ("kda_decode_pool", "state_pool"): ((5.7e-8, "kda_decode_pool/B8-S16-H12-K128-vk-pad2-hist64"),
                                            (1.1e-3, "kda_decode_pool/B8-S16-H12-K128-vk-pad2-hist64")),
        ("kda_conv_pool", "conv_pool"): ((2.5e-8, "kda_conv_pool/B8-S16-C4608-cw-pad2"),
                                         (1.7e-3, "kda_conv_pool/B8-S16-C4608-cw-pad2")),
        ("kda_conv_pool", "y"): ((8.1e-8, "kda_conv_pool/B8-S16-C4608-cw-pad2"),
                                 (2.5e-3, "kda_conv_pool/B8-S16-C4608-cw-pad2")),
        ("kda_prefill_varlen", "o"): ((2.6e-7, "kda_prefill_varlen/N3-T256-S5-H12-K128-vk"),
                                      (3.1e-3, "kda_prefill_varlen/N3-T256-S5-H12-K128-vk")),
        ("kda_prefill_varlen", "state_pool"): ((3.5e-8, "kda_prefill_varlen/N3-T256-S5-H12-K128-vk"),
                                               (4.9e-4, "kda_prefill_varlen/N3-T256-S5-H12-K128-vk")),
        ("mla_decode_fp8", "o_lat"): ((2.6e-7, "mla_decode_fp8/B16-H12-R512-P64-page64-mixed"),
                                      (2.9e-3, "mla_decode_fp8/B16-H12-R512-P64-page64-mixed")),
        ("mla_prefill", "lse"): ((7.5e-8, "mla_prefill/512of1536-64of64-H12-D192-V128"),
                                 (5.2e-5, "mla_prefill/512of1536-64of64-H12-D192-V128")),
        ("mla_prefill", "o"): ((3.2e-7, "mla_prefill/512of1536-64of64-H12-D192-V128"),
                               (3.2e-3, "mla_prefill/512of1536-64of64-H12-D192-V128")),
        ("moe_experts", "y"): ((5.5e-7, "moe_experts/T4-E8-k6-Dl3584-I3072"),
                               (3.4e-3, "moe_experts/T4-E8-k6-Dl3584-I3072")),
        ("add_rmsnorm", "residual_out"): ((3.6e-8, "add_rmsnorm/T32-D7168"), (2.4e-3, "add_rmsnorm/T32-D7168")),
        ("add_rmsnorm", "y"): ((7.7e-8, "add_rmsnorm/T32-D7168"), (3.8e-3, "add_rmsnorm/T32-D7168")),
    },
}

# The model traces, measured with `k3conf run --cases 'trace/*' --no-timing` on the tiny traces (torch 2.13 CPU,
# NumPy/OpenBLAS; numpy32, and torch-bf16's free logits, re-measured 2026-12-04 once the float32 projections and
# lm_head ran the compiled GEMV): block -> worst relative RMS error of numpy32 and of torch-bf16 (router and
# argmax near-ties teacher-forced) over the gated tensors of the trace mode each row gates, and the tensor that set
# it. The layer blocks are measured on the layerwise trace (the free run gates only logits and tokens: its
# intermediates are reported against these rows). The logits are measured per mode (TRACE_LOGITS): bf16 error
# accumulates through 7 layers x 6 steps of the free run to 8e-2, while the layerwise logits err 22x less, and a
# cap set by the free run would leave the layerwise logits over 50x headroom. These are the tiny set's shared rows
# ('*/<mode>/step*') every model config of that set starts from (tiny and k3geom); a model with its own
# measurements adds an entry under its name in TRACES below.
TINY_TRACES = {
    "attnres_mix": ((3.7e-7, "layerwise step5.layer03.4_m"), (9.8e-3, "layerwise step2.layer00.4_m")),
    "rmsnorm": ((3.7e-7, "layerwise step5.layer03.5_x_mlp"), (7.5e-3, "layerwise step2.layer00.5_x_mlp")),
    "kda_prefill": ((5.3e-7, "layerwise step0.layer01.7_cache"), (1.25e-2, "layerwise step0.layer04.3_a")),
    "kda_decode": ((4.9e-7, "layerwise step1.layer01.3_a"), (1.13e-2, "layerwise step2.layer00.3_a")),
    "mla_prefill": ((2.4e-7, "layerwise step0.layer02.3_a"), (9.5e-3, "layerwise step0.layer02.3_a")),
    "mla_decode": ((3.1e-7, "layerwise step2.layer02.3_a"), (9.0e-3, "layerwise step4.layer06.3_a")),
    "situ_glu": ((3.9e-7, "layerwise step2.layer00.6_f"), (1.6e-2, "layerwise step2.layer00.6_f")),
    "latent_moe": ((7.3e-7, "layerwise step3.layer03.6_f"), (1.8e-2, "layerwise step1.layer04.6_f")),
}
TINY_TRACES_WHERE = "tiny trace/*-P7-D5"
# mode -> the lm_head row's ((numpy32 worst, where), (torch-bf16 worst, where)) over the logits of that mode's
# traces (tiny and k3geom: the shared rows gate both)
TRACE_LOGITS = {
    "layerwise": ((1.96e-7, "trace/layerwise-P7-D5 step1.logits"),
                  (3.64e-3, "trace/layerwise-P7-D5 step2.logits")),
    "free": ((4.63e-6, "trace/free-P7-D5 step2.logits"), (8.19e-2, "trace/free-P7-D5 step1.logits")),
}
TRACE_MODES = tuple(TRACE_LOGITS)
# model ('*': the set's shared rows, measured on the tiny model) -> precision -> trace mode -> (the largest error of
# a correct implementation over its precision's baseline on any gated tensor of the trace, the same of the worst
# element, where; None where the blocks' multiple held on every model), or None where both held. Measured on the
# trace built with many synthetic models (tools/trace_spread.py; a seed whose golden sits on a near-tie is
# skipped). The committed model is one draw of this spread: the old k = 2.5 over torch-bf16 passed it and failed a
# correct bf16 recipe on 15 of 58 tiny models layer by layer (a KDA decode output 5.5x torch-bf16's on one
# 36-element tensor: the baseline's error on one small tensor is a noisy draw) and on 9 in the free run. k3geom's
# bigger tensors spread less. One multiple per model and mode for every block: a block given a looser k than the
# blocks after it would let its own bug be blamed on them.
# First set from weight seeds 0..59 (tiny, 58 models) and 0..19 (k3geom), then checked on held-out models: bf16
# seeds 60..199 (128 tiny models) and 20..49 (k3geom), fp32 60..159 (91 tiny models) and 20..39 (k3geom). Every row
# held on every held-out model but two, which are now set from all the models measured: tiny's fp32 layerwise
# per-element rule (3 tensors of 3 models at 9.0x-10.8x numpy32's worst element against 8x) and k3geom's bf16
# layerwise rows (2 models: 2.92x in rel RMS, 4.02x on the worst element, against 2.5 and 3.6).
TRACE_SPREAD_HOW = ("python tools/trace_spread.py --backends BACKENDS --seeds 0:60 --trace TRACE, held out: --seeds "
                    "60:200 (bf16) / 60:160 (fp32), k3geom 0:20 and 20:50 / 20:40; fp32: torch, cuda-emu and the "
                    "two fp32 recipes against numpy32, bf16: the two bf16 recipes against torch-bf16")
Spread = tuple[float | None, float | None, str]
TRACE_SPREAD: dict[str, dict[str, dict[str, Spread | None]]] = {
    "*": {
        # layerwise, the blocks' rel RMS rule (k = 4 + 1e-6) passed every tensor of the 149 models on all four fp32
        # backends; their per-element rule (8x + 1e-6) failed 3 held-out tensors
        "fp32": {"layerwise": (None, 10.8, "element: step0.layer04.3_a of weight seed 129, torch"),
                 "free": (4.99, 4.80, "step0.logits of weight seed 45, recipe:fp32-wide; element: torch, seed 41")},
        "bf16": {"layerwise": (5.47, 11.56, "step2.layer03.3_a of weight seed 29; element: step4.layer03.7_cache, "
                                            "seed 43; recipe:bf16-f32-math"),
                 "free": (4.07, 4.42, "step1.logits of weight seed 50, recipe:bf16-f32-math")},
    },
    "k3geom": {
        # the blocks' rule passed every tensor of both k3geom traces over 40 models on all four fp32 backends
        "fp32": {"layerwise": None, "free": None},
        "bf16": {"layerwise": (2.92, 4.02, "step0.layer02.4_m of weight seed 45; element: step1.layer04.4_m, "
                                           "seed 43; recipe:bf16-f32-math"),
                 "free": (3.17, 3.10, "step0.logits of weight seed 6, recipe:bf16-f32-math")},
    },
}


def trace_blocks(mode: str) -> dict:
    """block -> the measurements behind the shared trace rows of `mode` ('layerwise' or 'free')."""
    if mode not in TRACE_LOGITS:
        raise ValueError(f"trace mode: expected one of {list(TRACE_LOGITS)}, found {mode!r}")
    return {**TINY_TRACES, "lm_head": TRACE_LOGITS[mode]}


# shape set -> model config ('*': every model of that set without rows of its own) -> trace mode -> (block ->
# measurements, which traces were measured). Only tiny has trace cases (conformance.cases.traces.TraceKind.TABLE);
# a trace added to another set is judged by the rule for a set with no measurement until measured and written here.
TRACES = {"tiny": {model: {mode: (trace_blocks(mode), TINY_TRACES_WHERE) for mode in TRACE_MODES}
                   for model in TRACE_SPREAD}}

# The per-element rule (gates.judge): the largest ratio of a built-in backend's worst element error (max |out - ref|
# over RMS(ref)) to the same-precision baseline's on the same gated tensor, over every tiny case and trace with
# `k3conf run --no-timing`, and where it was seen (each other set's in ELEMENT_RATIO_BY_SET). bf16 has no built-in
# backend besides its baseline: its number is the smallest ratio of a one-element slip that must fail (torch-bf16's
# rmsnorm with the last element using its neighbour's weight; the rel RMS rule passes it at D=512).
WORST_ELEMENT_RATIO = {
    "fp32": (5.53, "torch on kda_prefill/B1-T65-H3-K32 o (worst element 3.93e-5 vs numpy32's 7.11e-6)"),
    "bf16": (4.1, "the last-element weight slip on rmsnorm/T3-D512-eps1e-6 y (8.8e-2 vs torch-bf16's 2.1e-2)"),
}
# shape set -> the fp32 measurement of WORST_ELEMENT_RATIO on that set (torch and cuda-emu against numpy32)
ELEMENT_RATIO_BY_SET = {
    "tiny": WORST_ELEMENT_RATIO["fp32"],
    "small": (1.31, "torch on kda_prefill/B1-T257-H4-K128 o (worst element 2.25e-5 vs numpy32's 1.72e-5)"),
    # an outlier channel (|ref| 0.69 against a median head RMS of 2.4e-3): torch's dot products leave it 5 fp32
    # ulps of its own value off, numpy32's 1; a rounding of one large element, not a wrong one
    "k3": (8.17, "torch on kda_decode/B4-H96-K128-hist32 o (worst element 5.03e-5 vs numpy32's 6.16e-6)"),
    "k3-tp8": (7.97, "torch on kda_prefill/B1-T8192-H2-K128 o (worst element 1.3e-3 vs numpy32's 1.63e-4)"),
}
