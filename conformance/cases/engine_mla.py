"""The engine-shaped mla cores' cases (k3ref.engine.mla): specs, input builders and the cases of each shape set.

mla_decode_fp8: the latent rows are drawn as core_data's MLA builder draws its cache (each sequence's pages in a
shuffled order, one spare page, unused pages and the slots past each sequence's end full of NaN), then stored as
an FP8 engine stores them: c as e4m3 codes with one float32 scale per token and group of 128 (quantize_latent;
NaN rows get NaN codes and scales), k_pe rounded to bf16. Padded batch rows (seq_len 0) sit among the real ones,
their block-table rows pointing at the NaN page; their output is not judged. Page sizes 1, 16 and 64.

mla_prefill: sequences packed along one token axis, one of them with a cached prefix (fewer new tokens than
tokens: the bottom-right causal mask differs from a top-left one there), and at K3's geometry the key's last
64 channels (k_pe) shared by every head, as MLA's expanded keys have them.

Also here: page-size-1 cases of the host graph's `mla_decode` core (core_data's builder with page=1).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from conformance.cases import magnitudes as mag
from conformance.cases.core_data import drawn
from conformance.cases.core_spec import CoreSpec
from conformance.cases.core_table import mixed_lengths
from k3ref.cache import paged_latent_cache
from k3ref.config import K3Config
from k3ref.engine.mla import quantize_latent

K3_QK_HEAD = 192        # n + r: K3's query/key width, the softmax scale 1/sqrt(192)


# ---- mla_decode_fp8


def _padded_cache(rng, seq_lens, width: int, page: int) -> tuple[np.ndarray, np.ndarray]:
    """paged_latent_cache over the real rows (seq_len > 0) with the padded rows' block-table rows (all columns)
    pointing at the spare NaN page -> (cache [N, page, width], block_table [B, max_pages + 1])."""
    real = [int(L) for L in seq_lens if L > 0]
    cache, table = paged_latent_cache(rng, real, width, page)
    full = np.full((len(seq_lens), table.shape[1]), table[0, -1], dtype=table.dtype)   # the spare column: NaN page
    full[[b for b, L in enumerate(seq_lens) if L > 0]] = table
    return cache, full


def _fp8_inputs(cache: np.ndarray, R: int) -> dict[str, np.ndarray]:
    """The FP8 engine's cache of float64 rows [N, page, R + P]: e4m3 codes + float32 scales of c, bf16 k_pe."""
    codes, scales = quantize_latent(cache[..., :R])
    k_pe = cache[..., R:].astype(ml_dtypes.bfloat16).astype(np.float64)
    return {"kv_fp8": codes, "kv_scale": scales.astype(np.float64), "k_pe": k_pe}


def _decode_fp8(rng, H, R, P, seq_lens, page=64, qk_head=K3_QK_HEAD):
    B = len(seq_lens)
    cache, table = _padded_cache(rng, seq_lens, R + P, page)
    q_abs = 3.0 * rng.standard_normal((B, H, R + P))     # peaked softmax, as core_data's mla_decode draw
    return ({"q_abs": q_abs, **_fp8_inputs(cache, R), "block_table": table,
             "seq_lens": np.asarray(seq_lens, np.int32)}, {"scale": qk_head ** -0.5})


def _decode_fp8_k3(rng, H, R, P, seq_lens, page=64, qk_head=K3_QK_HEAD):
    """As the toy draw, the latent rows and the absorbed query at the measured scales."""
    B = len(seq_lens)
    cache, table = _padded_cache(rng, seq_lens, R + P, page)
    cache *= mag.MEASURED["mla.kv"]["scale"]
    q_abs = mag.activations(rng, (B, H, R + P), "mla.q_abs")
    return ({"q_abs": q_abs, **_fp8_inputs(cache, R), "block_table": table,
             "seq_lens": np.asarray(seq_lens, np.int32)}, {"scale": qk_head ** -0.5})


def padded_rows_zeroed(inputs: dict, outputs: dict) -> dict:
    """o_lat with the padded rows' (seq_len 0) outputs set to 0: the contract leaves them unspecified."""
    o_lat = np.array(outputs["o_lat"], copy=True)
    o_lat[np.asarray(inputs["seq_lens"]) == 0] = 0
    return {**outputs, "o_lat": o_lat}


# ---- mla_prefill


def _packed(seqs) -> tuple[np.ndarray, np.ndarray]:
    """((q_n, k_n), ...) -> (cu_seqlens_q, cu_seqlens_k) int32."""
    q_lens, k_lens = zip(*seqs, strict=True)
    return (np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
            np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32))


def _prefill_inputs(q, k, v, seqs, shared_rope: int) -> tuple[dict, dict]:
    if shared_rope:
        k[..., -shared_rope:] = k[:, :1, -shared_rope:]       # k_pe: one per token, the same for every head
    cu_q, cu_k = _packed(seqs)
    return {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}, {"scale": q.shape[-1] ** -0.5}


def _prefill(rng, seqs, H, Dqk, Dv, shared_rope=0):
    Tq, Tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    q = 2.0 * rng.standard_normal((Tq, H, Dqk))      # scores ~ 2 N(0, 1): softmaxes neither flat nor one-hot
    k, v = rng.standard_normal((Tk, H, Dqk)), rng.standard_normal((Tk, H, Dv))
    return _prefill_inputs(q, k, v, seqs, shared_rope)


def _prefill_k3(rng, seqs, H, Dqk, Dv, shared_rope=0):
    """q at the absorbed query's measured scale, keys and values at the latent cache's (the expanded keys and
    values were not measured; W_UK and W_UV keep unit scale)."""
    Tq, Tk = sum(s[0] for s in seqs), sum(s[1] for s in seqs)
    q = mag.activations(rng, (Tq, H, Dqk), "mla.q_abs")
    k, v = mag.activations(rng, (Tk, H, Dqk), "mla.kv"), mag.activations(rng, (Tk, H, Dv), "mla.kv")
    return _prefill_inputs(q, k, v, seqs, shared_rope)


SPECS: dict[str, CoreSpec] = {
    # kv_scale is float32 in every FP8 engine: a bf16 backend receives it unrounded
    "mla_decode_fp8": CoreSpec("mla_decode_fp8", ("o_lat",), drawn(_decode_fp8, _decode_fp8_k3),
                               fp32_inputs=("kv_scale",), unjudged=padded_rows_zeroed),
    "mla_prefill": CoreSpec("mla_prefill", ("o", "lse"), drawn(_prefill, _prefill_k3)),
}


def _decode_name(p: dict) -> str:
    lens = p["seq_lens"]
    return f"mla_decode_fp8/B{len(lens)}-H{p['H']}-R{p['R']}-P{p['P']}-page{p['page']}-L{'-'.join(map(str, lens))}"


def _seqs_name(seqs) -> str:
    return "-".join(f"{q}of{k}" for q, k in seqs)


# The tiny cases: page sizes 1, 16 and 64, padded rows first, among and after the real ones, one and two scale
# groups (R 128, 256) and K3's geometry (R 512, P 64); their goldens together stay under 0.5 MB.
_TINY_DECODE: list[dict] = [
    dict(H=2, R=128, P=16, page=1, seq_lens=(5, 0, 9)),
    dict(H=2, R=256, P=16, page=16, seq_lens=(0, 17, 1, 40)),
    dict(H=1, R=128, P=16, page=64, seq_lens=(65, 0, 0)),
    dict(H=2, R=512, P=64, page=64, seq_lens=(33, 0)),
]
_TINY_PREFILL: list[dict] = [
    dict(seqs=((5, 5), (3, 11), (1, 1)), H=2, Dqk=32, Dv=16),
    dict(seqs=((1, 7), (4, 4)), H=1, Dqk=24, Dv=40),
    dict(seqs=((5, 13), (3, 3)), H=2, Dqk=K3_QK_HEAD, Dv=128, shared_rope=64),    # K3's head geometry
    dict(seqs=((3, 5), (0, 4), (2, 2), (0, 0)), H=2, Dqk=16, Dv=8),   # sequences with no new token (cached or empty)
]
# the host graph's mla_decode core at page size 1 (every token its own page, the block table one column a token)
_TINY_DECODE_P1 = [
    ("mla_decode/B2-H3-R32-P16-page1-L5-1", dict(H=3, R=32, P=16, seq_lens=(5, 1), page=1)),
    ("mla_decode/B1-H2-R64-P16-page1-L20", dict(H=2, R=64, P=16, seq_lens=(20,), page=1)),
]


def _k3_sets() -> dict[str, list[tuple[str, dict]]]:
    """k3: 96 heads; k3-tp8: one rank's 12. Decode: 16 rows of mixed lengths up to 4096, 2 of them padded.
    Prefill: a 512-token chunk after a 1024-token prefix next to a second sequence (goldens < 150 MB)."""
    c = K3Config.preset("k3")
    R, P = c.kv_lora_rank, c.qk_rope_head_dim
    qk_head, Dv = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
    lens = list(mixed_lengths(14, (4096,)))
    lens[3:3] = [0]
    lens.append(0)
    sets: dict[str, list[tuple[str, dict]]] = {}
    for name, tp, prefill_heads, seqs in (("k3", 1, 8, ((512, 1536), (509, 1533))),
                                          ("k3-tp8", 8, 12, ((512, 1536), (64, 64)))):
        H = c.num_attention_heads // tp
        decode = dict(H=H, R=R, P=P, page=64, seq_lens=tuple(lens), qk_head=qk_head, draw="k3")
        sets[name] = [
            (f"mla_decode_fp8/B{len(lens)}-H{H}-R{R}-P{P}-page64-mixed", decode),
            (f"mla_prefill/{_seqs_name(seqs)}-H{prefill_heads}-D{qk_head}-V{Dv}",
             dict(seqs=seqs, H=prefill_heads, Dqk=qk_head, Dv=Dv, shared_rope=P, draw="k3")),
        ]
    return sets


TABLE: dict[str, list[tuple[str, dict]]] = {
    "tiny": [
        *[(_decode_name(p), p) for p in _TINY_DECODE],
        *[(f"mla_prefill/{_seqs_name(p['seqs'])}-H{p['H']}-D{p['Dqk']}-V{p['Dv']}", p) for p in _TINY_PREFILL],
        *_TINY_DECODE_P1,
    ],
    **_k3_sets(),
}

__all__ = ["SPECS", "TABLE", "padded_rows_zeroed"]
