"""The core cases of each shape set: case name -> the builder params of conformance.cases.core_data.

`tiny` (committed) and `small` (generated into the cache) are toy-sized. `k3` and `k3-tp8` run every block at
the sizes K3 ships with (k3ref.config.PRESETS["k3"]), drawn at K3's magnitudes (draw="k3"), and are generated
on demand into the cache (`k3conf regen --shapes k3`): `k3` at the full head counts (KDA and MLA H = 96), `k3-tp8`
at one rank's share under tensor parallelism 8 (H = 12, the dense MLP's intermediate split 8 ways). Each set is
sized so that its float64 goldens are made in about a minute and a run of every CPU backend takes minutes
(docs/inputs.md lists the cases, what each covers and the times measured).
"""
from __future__ import annotations

from k3ref.config import K3Config

# The toy sets. Odd sizes on purpose (113, 203, 239, 1), B=1, H=1, T=1/63/65,
# MLA contexts of 1, exactly one page (64), one past a page (65) and several pages.
TOY_TABLE: dict[str, list[tuple[str, dict]]] = {
    "tiny": [
        ("rmsnorm/T1-D113", dict(T=1, D=113, eps=1e-5)),
        ("rmsnorm/T7-D203", dict(T=7, D=203, eps=1e-5)),
        ("rmsnorm/T3-D239-eps1e-6", dict(T=3, D=239, eps=1e-6)),
        ("situ_glu/T1-I113", dict(shape=(1, 113))),
        ("situ_glu/T5-I203", dict(shape=(5, 203))),
        ("situ_glu/I239", dict(shape=(239,))),
        ("kda_decode/B2-H3-K16", dict(B=2, H=3, K=16, V=16)),
        ("kda_decode/B1-H1-K128", dict(B=1, H=1, K=128, V=128)),
        ("kda_decode/B3-H2-K32-V16", dict(B=3, H=2, K=32, V=16)),
        ("kda_decode/B2-H2-K16-nolb", dict(B=2, H=2, K=16, V=16, lower_bound=None)),
        ("kda_prefill/B1-T1-H1-K16", dict(B=1, T=1, H=1, K=16, V=16)),
        ("kda_prefill/B2-T63-H2-K16", dict(B=2, T=63, H=2, K=16, V=16)),
        ("kda_prefill/B1-T65-H3-K32", dict(B=1, T=65, H=3, K=32, V=32)),
        ("mla_decode/B2-H3-R32-P16-L65-1", dict(H=3, R=32, P=16, seq_lens=(65, 1))),
        ("mla_decode/B3-H1-R64-P16-L64-113-203", dict(H=1, R=64, P=16, seq_lens=(64, 113, 203))),
        ("mla_decode/B1-H2-R512-P64-L70", dict(H=2, R=512, P=64, seq_lens=(70,))),
        ("mxfp4_gemv/N113-K64", dict(N=113, K=64)),
        ("mxfp4_gemv/N1-K32", dict(N=1, K=32)),
        ("mxfp4_gemv/M3-N203-K96", dict(N=203, K=96, lead=(3,))),
        ("moe_route/T5-E16-k4", dict(T=5, E=16, top_k=4)),
        ("moe_route/T1-E8-k2", dict(T=1, E=8, top_k=2)),
        ("moe_route/T7-E32-k4-G4-g2", dict(T=7, E=32, top_k=4, n_group=4, topk_group=2)),
        ("moe_route/T3-E13-k1-norenorm-s2.5", dict(T=3, E=13, top_k=1, renormalize=False, scaling=2.5)),
        ("attnres_mix/S3-T5-D113", dict(S=3, lead=(5,), D=113)),
        ("attnres_mix/S1-T1-D64", dict(S=1, lead=(1,), D=64)),
        ("attnres_mix/S13-T2-D203-mix0.5", dict(S=13, lead=(2,), D=203, mix=0.5)),
        # K3's per-head geometry (the k3geom traces run the same widths inside the model): every entry of every
        # kernel. kda_decode's full-width entry is picked only for B*H >= 2 x the SM count, so it is forced
        # (with the softplus gate, the Kimi Linear form); B1-H1-K128 above takes the 4-way V split. MLA: the
        # bf16 cache entry (K3's cache dtype) with 17 heads (two head groups of 16) and two splits, the
        # second one row long; B1-H2-R512-P64-L70 above takes the fp32 entry over three splits.
        ("kda_decode/B1-H2-K128-nolb-full", dict(B=1, H=2, K=128, V=128, lower_bound=None,
                                                 entry="kda_decode_f32")),
        ("mla_decode/B1-H17-R512-P64-L33-bf16", dict(H=17, R=512, P=64, seq_lens=(33,), bf16_cache=True,
                                                     entry="mla_decode_split_bf16")),
        ("rmsnorm/T3-D512-eps1e-6", dict(T=3, D=512, eps=1e-6)),     # MLA kv_a norm width
        ("rmsnorm/T4-D128", dict(T=4, D=128, eps=1e-5)),               # KDA o_norm: one row per head
        ("attnres_mix/S9-T2-D256", dict(S=9, lead=(2,), D=256)),      # the kernel's most sources (K3: 8 + 1)
        # every entry of the batched kernels on B > 1 at the kernel's geometry: a kernel that reads sequence 0's
        # row (head h instead of b*H + h) passes every B = 1 case above. MLA's f32 entry already runs at B > 1
        # (B2-H3-R32-P16, B3-H1-R64-P16); its bf16 entry gets two sequences and two head groups here (R 64 keeps
        # the committed golden small: the kernel's layout covers R <= 512).
        ("kda_decode/B2-H1-K128-full", dict(B=2, H=1, K=128, V=128, entry="kda_decode_f32")),
        ("kda_decode/B2-H1-K128-split", dict(B=2, H=1, K=128, V=128, entry="kda_decode_f32_split4")),
        ("mla_decode/B2-H17-R64-P16-L33-20-bf16", dict(H=17, R=64, P=16, seq_lens=(33, 20), bf16_cache=True,
                                                       entry="mla_decode_split_bf16")),
        # stated contracts (docs/spec.md): an explicit KDA scale (a kernel that ignores it uses 1/sqrt(K)), and
        # router ties at the k-th choice, broken to the lower expert id (top-3 and top-1)
        ("kda_decode/B2-H3-K16-scale0.3", dict(B=2, H=3, K=16, V=16, scale=0.3)),
        ("kda_prefill/B1-T5-H2-K16-scale0.3", dict(B=1, T=5, H=2, K=16, V=16, scale=0.3)),
        ("moe_route/T4-E9-k3-ties", dict(T=4, E=9, top_k=3, ties=True)),
        ("moe_route/T2-E6-k1-ties", dict(T=2, E=6, top_k=1, ties=True)),
    ],
    "small": [
        ("rmsnorm/T16-D1024", dict(T=16, D=1024, eps=1e-5)),
        ("situ_glu/T16-I1536", dict(shape=(16, 1536))),
        ("kda_decode/B4-H8-K128", dict(B=4, H=8, K=128, V=128)),
        ("kda_prefill/B1-T257-H4-K128", dict(B=1, T=257, H=4, K=128, V=128)),
        ("mla_decode/B4-H8-R512-P64-L1-64-65-700", dict(H=8, R=512, P=64, seq_lens=(1, 64, 65, 700))),
        ("mxfp4_gemv/M4-N1024-K1536", dict(N=1024, K=1536, lead=(4,))),
        ("moe_route/T32-E128-k8", dict(T=32, E=128, top_k=8)),
        ("attnres_mix/S9-T16-D1024", dict(S=9, lead=(16,), D=1024)),
    ],
}



def mixed_lengths(batch: int, longest: tuple[int, ...], short: int = 200) -> tuple[int, ...]:
    """`batch` MLA context lengths: mostly short (1 .. short, spread by a fixed pattern that hits 1, a page
    boundary and one past it) and the `longest` ones placed among them (not last: a kernel that sizes its work by
    the last sequence shows)."""
    n = batch - len(longest)
    lens = [1, 64, 65] + [(37 * i * i + 11 * i) % short + 1 for i in range(3, n)]
    lens = lens[:n]
    for j, L in enumerate(longest):
        lens.insert((j + 1) * n // (len(longest) + 1), L)
    return tuple(lens)


def _k3_sets() -> dict[str, list[tuple[str, dict]]]:
    """k3 and k3-tp8 from K3's config: H = 96 heads and one rank's 12 under tensor parallelism 8."""
    c = K3Config.preset("k3")
    D, Kd, R, P = c.hidden_size, c.kda_head_dim, c.kv_lora_rank, c.qk_rope_head_dim
    L, I_moe, E, k = c.routed_expert_hidden_size, c.moe_intermediate_size, c.n_routed_experts, c.num_experts_per_tok
    eps, lb = c.rms_norm_eps, c.gate_lower_bound
    qk_head = c.qk_nope_head_dim + c.qk_rope_head_dim
    kda = dict(K=Kd, V=Kd, lower_bound=lb, draw="k3")
    mla = dict(R=R, P=P, qk_head=qk_head, draw="k3")
    router = dict(E=E, top_k=k, n_group=c.n_group, topk_group=c.topk_group, renormalize=c.norm_topk_prob,
                  scaling=c.routed_scaling_factor, draw="k3")
    sets: dict[str, list[tuple[str, dict]]] = {}
    for name, tp in (("k3", 1), ("k3-tp8", 8)):
        H_kda, H_mla = c.kda_num_heads // tp, c.num_attention_heads // tp
        mixed = mixed_lengths(64, (4096, 1025))
        long_pair = (32768, 1000 if tp == 1 else 17)
        cases: list[tuple[str, dict]] = [
            (f"rmsnorm/T32-D{D}", dict(T=32, D=D, eps=eps, draw="k3")),                     # hidden norms
            (f"rmsnorm/T{2 * H_kda}-D{Kd}", dict(T=2 * H_kda, D=Kd, eps=eps, draw="k3")),    # KDA o_norm, 2 tokens
            (f"situ_glu/T8-I{c.intermediate_size // tp}", dict(shape=(8, c.intermediate_size // tp), draw="k3")),
            (f"situ_glu/T32-I{c.shared_intermediate_size // tp}",
             dict(shape=(32, c.shared_intermediate_size // tp), draw="k3")),
        ]
        if tp == 1:
            cases += [
                (f"rmsnorm/T32-D{c.q_lora_rank}", dict(T=32, D=c.q_lora_rank, eps=eps, draw="k3")),
                (f"rmsnorm/T32-D{R}", dict(T=32, D=R, eps=eps, draw="k3")),
                (f"rmsnorm/T32-D{L}", dict(T=32, D=L, eps=eps, draw="k3")),               # the latent norm
                (f"situ_glu/T32-I{I_moe}", dict(shape=(32, I_moe), draw="k3")),            # a routed expert
                (f"kda_decode/B2-H{H_kda}-K{Kd}-hist1024", dict(B=2, H=H_kda, history=1024, **kda)),
                (f"kda_decode/B4-H{H_kda}-K{Kd}-hist32", dict(B=4, H=H_kda, history=32, **kda)),
                # a prefill golden holds 7 float64 [B, T, H, 128] tensors: B*T*H = 12288 is 88 MB
                (f"kda_prefill/B2-T64-H{H_kda}-K{Kd}", dict(B=2, T=64, H=H_kda, **kda)),
                # routed experts are not split by TP (expert parallelism): their GEMVs are the same on every rank
                (f"mxfp4_gemv/M4-N{I_moe}-K{L}", dict(N=I_moe, K=L, lead=(4,), draw="k3")),   # w1 / w3
                (f"mxfp4_gemv/M4-N{L}-K{I_moe}", dict(N=L, K=I_moe, lead=(4,), draw="k3")),   # w2
                (f"mxfp4_gemv/M1-N{I_moe}-K{L}", dict(N=I_moe, K=L, draw="k3")),
                (f"moe_route/T64-E{E}-k{k}", dict(T=64, **router)),
                (f"attnres_mix/S9-T16-D{D}", dict(S=9, lead=(16,), D=D, draw="k3")),   # 8 blocks of 12 + the prefix
                (f"attnres_mix/S2-T64-D{D}", dict(S=2, lead=(64,), D=D, draw="k3")),
            ]
        else:
            cases += [
                (f"kda_decode/B2-H{H_kda}-K{Kd}-hist8192", dict(B=2, H=H_kda, history=8192, **kda)),
                (f"kda_decode/B4-H{H_kda}-K{Kd}-hist1024", dict(B=4, H=H_kda, history=1024, **kda)),
                # the longest prefill at 2 of the rank's heads (its float64 golden: 117 MB), and all 12 at T = 512
                (f"kda_prefill/B1-T8192-H2-K{Kd}", dict(B=1, T=8192, H=2, **kda)),
                (f"kda_prefill/B2-T512-H{H_kda}-K{Kd}", dict(B=2, T=512, H=H_kda, **kda)),
            ]
        cases += [
            (f"mla_decode/B64-H{H_mla}-R{R}-P{P}-mixed", dict(H=H_mla, seq_lens=mixed, **mla)),
            (f"mla_decode/B2-H{H_mla}-R{R}-P{P}-L{long_pair[0]}-{long_pair[1]}-bf16",
             dict(H=H_mla, seq_lens=long_pair, bf16_cache=True, entry="mla_decode_split_bf16", **mla)),
        ]
        sets[name] = cases
    return sets


# config -> [(case name, builder params)]
TABLE: dict[str, list[tuple[str, dict]]] = {**TOY_TABLE, **_k3_sets()}
