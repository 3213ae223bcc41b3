"""`k3conf blocks`: every block with the one-line formula it implements."""
from __future__ import annotations

# name: (reference, one-line formula). Names match the kernel files, golden cases and gate rows.
BLOCKS: dict[str, tuple[str, str]] = {
    "rmsnorm": ("k3ref.ops.rmsnorm", "w * x / sqrt(mean(x^2) + eps)"),
    "softcap": ("k3ref.situ.softcap", "c * tanh(z / c)"),
    "situ_glu": ("k3ref.situ.situ_glu", "softcap_4(g) * sigma(g) * softcap_25(u); MLP out = W2 h"),
    "kda_gate": ("k3ref.kda.kda_gate", "g = lb * sigma(exp(A_log) * (g_raw + dt_bias)), lb = -5"),
    "short_conv": ("k3ref.kda.short_conv", "y_t[c] = sum_j w[c,j] x_{t-3+j}[c]; then SiLU"),
    "kda_decode": ("k3ref.kda.kda_decode_core",
                   "S <- diag(e^g) S; S += beta k (v - S^T k)^T; o = S^T q (q, k L2-normed, eps 1e-6; q * K^-1/2)"),
    "kda_chunked": ("k3ref.kda.kda_chunked", "the KDA recurrence in chunks of 64 (WY/UT transform)"),
    "mla_decode": ("k3ref.mla.mla_decode_core",
                   "softmax((q_nope W_UK c + q_pe k_pe) / sqrt(192)) . c over paged [c | k_pe]"),
    "mla_gate": ("k3ref.mla.mla_decode_token", "y = W_o(concat_h W_UV,h o_h * sigma(W_g x))"),
    "attnres_mix": ("k3ref.attnres.attnres_mix", "softmax_i(RMSNorm(V_i) . (gamma*w)) weighted sum of V_i"),
    "moe_route": ("k3ref.latent_moe.sigmoid_topk",
                  "idx = topk(sigma(W_r x) + bias); w = s[idx] / (sum s[idx] + 1e-20) * scaling"),
    "latent_moe": ("k3ref.latent_moe.latent_moe_forward", "W_up RMSNorm(sum_k w_k E_k(W_down x)) + Shared(x)"),
    "mxfp4_gemv": ("k3ref.mxfp4.mxfp4_gemv", "y = W x, W = E2M1[code] * 2^(e-127), 32 codes per E8M0 scale"),
}


def register(sub) -> None:
    p = sub.add_parser("blocks", help="list every block with its formula")
    p.set_defaults(func=run)


def run(args) -> int:
    width = max(map(len, BLOCKS))
    for name, (ref, formula) in BLOCKS.items():
        print(f"{name:<{width}}  {formula}    [{ref}]")
    return 0
