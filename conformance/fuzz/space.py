"""The legal space of each core's inputs, in regions a fuzz draw is taken from, and how a failing draw shrinks.

Every case table is a fixed list of shapes, and a kernel can be right only on the shapes it has seen. A region is
one part of a core's space where kernels go wrong in a known way, drawn afresh on every run:

- sizes past a threshold: KDA heads past 64 (up to K3's 96), MLA and KDA batches of 32 and more (padded rows among
  them), MXFP4 dot products across the split-K boundaries of 2048 and 4096, KDA prefill tails of 1..15 tokens and
  63 / 64 / 65 (chunks of 64), MLA contexts one past a page (L % page == 1) at page sizes 1, 16 and 64;
- contracts: router ties (to the lower expert id), an expert chosen twice by one token (counted twice), an explicit
  `scale` for KDA, varlen batches with empty and one-token sequences (repeated offsets in cu_seqlens);
- K3's geometry (KDA head_dim 128, MLA kv_rank 512 + rope 64) at small counts, where the CUDA kernels run, and K3's
  measured magnitudes (draw="k3": activations with their outliers, gates at the lower bound).

A region gives the builder's params (conformance.cases.core_data and the engine case modules); `describe`
names the shape ("B=33 H=2 K=16 V=16"); `dims` lists the dimensions a failing draw is walked down along, which the
shrinker bisects one at a time (conformance.fuzz.draws), keeping what `valid` and the builder accept.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

Params = dict
Draw = Callable[[np.random.Generator], Params]


@dataclasses.dataclass(frozen=True)
class Region:
    """One region of a core's space: its name (in the fuzz case's name), how to draw it, and the shape set whose
    magnitudes it draws at (`k3`: K3's measured scales; `tiny`: the toy draws)."""

    name: str
    draw: Draw
    config: str = "tiny"


def _pick(rng, values):
    return values[int(rng.integers(len(values)))]


def _int(rng, lo: int, hi: int) -> int:
    """An int in lo..hi, both included."""
    return int(rng.integers(lo, hi + 1))


# ---- the host graph's cores

def _kda_dims(rng, H: tuple[int, int] = (1, 3), K=(8, 16, 32)) -> dict:
    k = int(_pick(rng, K))
    v = k if rng.random() < 0.7 else int(_pick(rng, (8, 16, 32)))
    return dict(H=_int(rng, *H), K=k, V=v, lower_bound=_pick(rng, (-5.0, -5.0, None)))


def _kda_decode(rng, B=(1, 3), H=(1, 3), K=(8, 16, 32), scale=False) -> Params:
    dims = _kda_dims(rng, H, K)
    if scale:
        dims["scale"] = round(float(rng.uniform(0.05, 0.6)), 4)
    return dict(B=_int(rng, *B), **dims)


def _kda_prefill(rng, T=None, B=(1, 2), H=(1, 3), K=(8, 16, 32), scale=False) -> Params:
    t = int(_pick(rng, T)) if T is not None else _int(rng, 1, 70)
    dims = _kda_dims(rng, H, K)
    if scale:
        dims["scale"] = round(float(rng.uniform(0.05, 0.6)), 4)
    return dict(B=_int(rng, *B), T=t, **dims)


TAILS = (*range(1, 16), 63, 64, 65, 127, 128, 129)


def _mla_lens(rng, B: int, page: int, tail: bool = False) -> tuple[int, ...]:
    """B context lengths of 1..3 pages; with `tail`, some one past a page boundary (L % page == 1)."""
    lens = [_int(rng, 1, 3 * page) for _ in range(B)]
    if tail:
        for b in range(0, B, 2):
            lens[b] = page * _int(rng, 1, 3) + 1
    return tuple(lens)


def _mla_decode(rng, B=(1, 3), H=(1, 3), R=(32, 64), P=(16,), page=None, tail=False) -> Params:
    pg = int(_pick(rng, (1, 16, 64))) if page is None else page
    b = _int(rng, *B)
    return dict(H=_int(rng, *H), R=int(_pick(rng, R)), P=int(_pick(rng, P)), seq_lens=_mla_lens(rng, b, pg, tail),
                page=pg)


def _mxfp4(rng, K: tuple[int, int] = (1, 8), N=(1, 9), lead=False) -> Params:
    groups = _int(rng, *K)            # K in groups of 32
    out: Params = dict(N=_int(rng, *N), K=32 * groups)
    if lead:
        out["lead"] = (_int(rng, 2, 3),)
    return out


def _split_k(rng) -> Params:
    """K just past 2048 or 4096 (a partial last chunk of 2048), or across both, with 16..32 outputs: the bound is k x
    numpy32's error on the same draw, and numpy32's relative RMS over 1..4 long sums is one noisy sample (a correct
    fp32 GEMV with other sums failed 7 of 1,500 such draws at up to 2.26x the bound; over 16..32 outputs, 0 of 1,500
    at 0.33x at worst: tools/verdict_rates.py region, docs/verdict_rates.md)."""
    base = int(_pick(rng, (2048, 4096)))
    return dict(N=_int(rng, 16, 32), K=base + 32 * _int(rng, 1, 20))


def _route(rng, ties=False, groups=False) -> Params:
    if groups:
        n_group = int(_pick(rng, (2, 4)))
        per_group = _int(rng, 2, 6)
        topk_group = _int(rng, 1, n_group - 1)
        return dict(T=_int(rng, 1, 6), E=n_group * per_group, top_k=_int(rng, 1, min(4, topk_group * per_group)),
                    n_group=n_group, topk_group=topk_group)
    E = _int(rng, 4, 40)
    # a tie at the k-th choice needs an expert below the tied pair: top_k <= E - 2 (core_data's tied route)
    out = dict(T=_int(rng, 1, 6), E=E, top_k=_int(rng, 1, min(8, E - 2 if ties else E - 1)))
    if ties:
        out["ties"] = True
    return out


def _attnres(rng, S=(1, 9), D=(1, 300)) -> Params:
    return dict(S=_int(rng, *S), lead=(_int(rng, 1, 4),), D=_int(rng, *D), mix=_pick(rng, (1.0, 1.0, 0.5)))


# ---- the engine-shaped cores

def _pool_decode(rng, B=(1, 4), H=(1, 3), K=(8, 16)) -> Params:
    b = _int(rng, *B)
    padded = tuple(sorted(set(int(x) for x in rng.integers(0, b, _int(rng, 0, max(0, b // 4))))))
    live = b - len(padded)
    return dict(B=b, S=live + _int(rng, 0, 3), padded=padded, state_layout=_pick(rng, ("kv", "vk")),
                **_kda_dims(rng, H, K))


def _varlen(rng, empty=False, H=(1, 3), K=(8, 16)) -> Params:
    lens = [_int(rng, 1, 70) for _ in range(_int(rng, 1, 4))]
    if empty:
        lens.insert(_int(rng, 0, len(lens)), 0)     # an empty sequence: a repeated offset in cu_seqlens
        lens.insert(_int(rng, 0, len(lens)), 1)     # and a one-token one
    return dict(lens=tuple(lens), S=len(lens) + _int(rng, 0, 2), state_layout=_pick(rng, ("kv", "vk")),
                **_kda_dims(rng, H, K))


def _conv(rng) -> Params:
    b = _int(rng, 1, 40)
    padded = tuple(sorted(set(int(x) for x in rng.integers(0, b, _int(rng, 0, max(0, b // 4))))))
    return dict(B=b, S=b - len(padded) + _int(rng, 0, 3), C=_int(rng, 1, 400), padded=padded,
                layout=_pick(rng, ("cw", "wc")))


def _fp8(rng, B=(1, 4), page=None) -> Params:
    pg = int(_pick(rng, (1, 16, 64))) if page is None else page
    lens = list(_mla_lens(rng, _int(rng, *B) + 1, pg, tail=True))
    lens[_int(rng, 0, len(lens) - 1)] = 0      # a padded row (seq_len 0) among real ones: its output is unspecified
    return dict(H=_int(rng, 1, 3), R=int(_pick(rng, (128, 256))), P=16, seq_lens=tuple(lens), page=pg)


def _prefill_attn(rng, empty=False) -> Params:
    seqs = []
    for _ in range(_int(rng, 1, 3)):
        q = _int(rng, 1, 20)
        seqs.append((q, q + _int(rng, 0, 20)))
    if empty:
        seqs.insert(_int(rng, 0, len(seqs)), (0, _int(rng, 0, 5)))
    return dict(seqs=tuple(seqs), H=_int(rng, 1, 3), Dqk=int(_pick(rng, (16, 24, 32))), Dv=int(_pick(rng, (8, 16))))


def _experts(rng, repeated=False) -> Params:
    E = _int(rng, 2, 10)
    k = _int(rng, 1, min(4, E))
    out = dict(T=_int(rng, 1, 6), E=E, k=k, Dl=32 * _int(rng, 1, 3), Di=32 * _int(rng, 1, 3))
    if repeated:
        out["repeated"] = True
        out["k"] = max(2, k)
        out["E"] = max(E, out["k"])
    return out


def _rows(rng, D=(1, 600)) -> Params:
    return dict(T=_int(rng, 1, 40), D=_int(rng, *D), eps=_pick(rng, (1e-5, 1e-6)))


# core -> its regions, in the order a run covers them (one draw of each: the default fuzz of `k3conf run`)
REGIONS: dict[str, tuple[Region, ...]] = {
    "rmsnorm": (Region("rows", _rows), Region("k3-hidden", lambda r: dict(T=_int(r, 1, 4), D=7168, eps=1e-5,
                                                                          draw="k3"), "k3")),
    "situ_glu": (Region("rows", lambda r: dict(shape=(_int(r, 1, 33), _int(r, 1, 3100)))),),
    "kda_decode": (
        Region("heads-past-64", lambda r: _kda_decode(r, B=(1, 2), H=(65, 96), K=(8,))),
        Region("batch-32", lambda r: _kda_decode(r, B=(32, 40), H=(1, 2), K=(8,))),
        Region("scale", lambda r: _kda_decode(r, scale=True)),
        Region("geometry", lambda r: _kda_decode(r, B=(1, 3), H=(1, 2), K=(128,))),
    ),
    "kda_prefill": (
        Region("tails", lambda r: _kda_prefill(r, T=TAILS, B=(1, 2), H=(1, 2), K=(8,))),
        Region("heads-past-64", lambda r: _kda_prefill(r, T=(1, 2, 3), B=(1, 1), H=(65, 96), K=(8,))),
        Region("scale", lambda r: _kda_prefill(r, T=TAILS[:15], scale=True)),
        Region("geometry", lambda r: _kda_prefill(r, T=TAILS, B=(1, 1), H=(1, 2), K=(128,))),
    ),
    "mla_decode": (
        Region("batch-32", lambda r: _mla_decode(r, B=(33, 40), H=(1, 2), page=16)),
        Region("page-tails", lambda r: _mla_decode(r, tail=True, page=int(_pick(r, (16, 64))))),
        Region("page-1", lambda r: _mla_decode(r, tail=True, page=1)),
        Region("heads", lambda r: _mla_decode(r, B=(1, 2), H=(3, 96), R=(32,), page=16)),
        Region("geometry", lambda r: _mla_decode(r, B=(1, 2), H=(1, 17), R=(512,), P=(64,), page=64)),
    ),
    "mxfp4_gemv": (
        Region("split-k", _split_k),
        Region("rows", lambda r: _mxfp4(r, K=(1, 40), N=(1, 300), lead=r.random() < 0.5)),
    ),
    "moe_route": (
        Region("ties", lambda r: _route(r, ties=True)),
        Region("plain", _route),
        Region("groups", lambda r: _route(r, groups=True)),
    ),
    "attnres_mix": (Region("sources", _attnres), Region("kernel-geometry", lambda r: _attnres(r, S=(2, 9),
                                                                                            D=(128, 300)))),
    "kda_decode_pool": (
        Region("batch-32", lambda r: _pool_decode(r, B=(32, 40), H=(1, 2))),
        Region("heads-past-64", lambda r: _pool_decode(r, B=(1, 3), H=(65, 96), K=(8,))),
    ),
    "kda_conv_pool": (Region("rows", _conv),),
    "kda_prefill_varlen": (
        Region("empty-sequences", lambda r: _varlen(r, empty=True)),
        Region("heads-past-64", lambda r: _varlen(r, H=(65, 96), K=(8,))),
    ),
    "mla_decode_fp8": (
        Region("batch-32", lambda r: _fp8(r, B=(33, 40), page=16)),
        Region("pages", _fp8),
    ),
    "mla_prefill": (Region("empty-sequences", lambda r: _prefill_attn(r, empty=True)),
                    Region("sequences", _prefill_attn)),
    "moe_experts": (Region("repeated-ids", lambda r: _experts(r, repeated=True)), Region("stack", _experts)),
    "add_rmsnorm": (Region("rows", _rows),),
}


def describe(params: Params) -> str:
    """The shape a draw's params give, as a reader names it: 'B=33 H=2 K=16 V=16 lower_bound=None'; a long tuple
    by its length and range ('seq_lens=33 x 1..40'); an MLA decode's batch, the length of its seq_lens, as B."""
    parts = []
    for key, value in params.items():
        if key == "draw":
            continue
        if key == "seq_lens" and "B" not in params:
            parts.append(f"B={len(value)}")
        if isinstance(value, tuple | list):
            flat = [x for x in value if isinstance(x, int)]
            if len(value) > 6 and len(flat) == len(value):
                value = f"{len(value)} x {min(flat)}..{max(flat)}" if min(flat) != max(flat) else \
                    f"{len(value)} x {flat[0]}"
            else:
                value = "(" + ",".join(map(str, value)) + ")" if value else "()"
        parts.append(f"{key}={value}")
    return " ".join(parts)


# ---- shrinking: the dimensions a failing draw is walked down along

# an integer dimension's smallest legal value and the step it keeps (K of MXFP4 and the experts' widths in groups
# of 32), by the builders' own param names; a dimension not named here shrinks to 1 in steps of 1
_FLOORS = {"E": 2}
_STEPS = {"Dl": 32, "Di": 32}
_FIXED = frozenset({"lower_bound", "eps", "mix", "scale", "page", "draw", "state_layout", "layout", "qk_head",
                    "ties", "repeated", "renormalize", "scaling", "n_group", "topk_group", "shared_rope"})


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dimension of a draw's params that a shrinker may walk down: an int param (`index` None), or a tuple
    param's length (`index` -1: entries dropped from its end) or its entries (`index` -2: every entry set to
    `floor`)."""

    name: str
    floor: int
    step: int = 1
    index: int | None = None


def dims(core: str, params: Params) -> list[Dim]:
    """The dimensions of `params` to shrink, in the order a reader scans a shape (counts first)."""
    out = []
    for key, value in params.items():
        if key in _FIXED or isinstance(value, bool):
            continue
        if isinstance(value, int):
            step = 32 if (core == "mxfp4_gemv" and key == "K") else _STEPS.get(key, 1)
            out.append(Dim(key, _FLOORS.get(key, step), step))
        elif isinstance(value, tuple) and value and all(isinstance(x, int) for x in value):
            out.append(Dim(key, 1, 1, -1))                                  # fewer entries (a smaller batch)
            out.append(Dim(key, 1 if min(value) > 0 else 0, 1, -2))         # every entry at its smallest
    return out


def with_dim(params: Params, dim: Dim, value: int) -> Params:
    """`params` with dimension `dim` at `value` (a tuple's length or its entries' common value)."""
    current = params[dim.name]
    if dim.index is None:
        return {**params, dim.name: value}
    if dim.index == -1:
        return {**params, dim.name: tuple(current[:value])}
    return {**params, dim.name: tuple(value if x > 0 else x for x in current)}


def size(params: Params, dim: Dim) -> int:
    """Where dimension `dim` stands in `params` (a tuple's length, or its largest entry)."""
    current = params[dim.name]
    if dim.index is None:
        return int(current)
    return len(current) if dim.index == -1 else max(current)


def valid(core: str, p: Params) -> bool:
    """Whether `p` lies in `core`'s legal space (the builder's and the core's constraints)."""
    if core in ("kda_decode_pool",):
        live = p["B"] - len([x for x in p["padded"] if x < p["B"]])
        return all(x < p["B"] for x in p["padded"]) and p["S"] >= live
    if core == "kda_conv_pool":
        live = p["B"] - len(p["padded"])
        return all(x < p["B"] for x in p["padded"]) and p["S"] >= live
    if core == "kda_prefill_varlen":
        return len(p["lens"]) >= 1 and p["S"] >= len(p["lens"]) and sum(p["lens"]) >= 1
    if core in ("mla_decode", "mla_decode_fp8"):
        return len(p["seq_lens"]) >= 1 and any(L > 0 for L in p["seq_lens"]) and (
            core == "mla_decode" or p["R"] % 128 == 0) and (core != "mla_decode" or min(p["seq_lens"]) >= 1)
    if core == "mla_prefill":
        return all(q <= k for q, k in p["seqs"]) and sum(q for q, _ in p["seqs"]) >= 1
    if core == "moe_route":
        E, k, g = p["E"], p["top_k"], p.get("n_group", 1)
        return 1 <= k < E and E % g == 0 and p.get("topk_group", 1) < g + (g == 1) and (g == 1 or k <= E // g)
    if core == "moe_experts":
        return 1 <= p["k"] <= p["E"] and (not p.get("repeated") or p["k"] >= 2)
    return True


__all__ = ["REGIONS", "Dim", "Region", "TAILS", "describe", "dims", "size", "valid", "with_dim"]
