"""Gated NoPE MLA (docs/spec.md section 3.2): the absorbed decode form over the paged latent cache and the
expanded form, written independently so each checks the other.

Per token x [D], heads h = 0..H-1 (n = qk_nope, r = qk_rope, v = v_head, R = kv_lora):
    q = W_qb RMSNorm_1e-6(W_qa x)                 -> per head [q_nope_h (n) | q_pe_h (r)]
    [c_raw | k_pe] = W_kva x;  c = RMSNorm_1e-6(c_raw)   (k_pe: not normalised, not rotated, shared)
    W_kvb = kv_b_proj.weight [H*(n+v), R]: per head rows 0..n-1 = W_UK,h, rows n..n+v-1 = W_UV,h
    s_hj = (q_nope_h . W_UK,h c_j + q_pe_h . k_pe_j) / sqrt(n + r)   causal, incl. the current token
    o_h = W_UV,h sum_j softmax_j(s_h)_j c_j;   y = W_o (concat_h o_h * sigmoid(W_g x))
Absorbed: q_abs_h = [W_UK,h^T q_nope_h | q_pe_h] dotted with cache rows [c_j | k_pe_j] gives s_hj.
"""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping

import numpy as np

from . import fast, ops
from .cache import MlaKv
from .checks import as_float, check_shape, is_finite_real, is_int_value, require
from .engine import mla as engine_mla
from .fast import mla_jit, scan_jit
from .threads import fixed_blas


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """MLA geometry (names follow the published config.json). K3: 96, 1536, 512, 128, 64, 128."""

    num_heads: int            # H
    q_lora_rank: int          # width of the q_a bottleneck
    kv_lora_rank: int         # R, latent width of c
    qk_nope_head_dim: int     # n
    qk_rope_head_dim: int     # r (NoPE: the slots are kept, just not rotated)
    v_head_dim: int           # v
    page_size: int = 64       # tokens per cache page (FlashMLA)
    q_norm_eps: float = 1e-6  # q_a_layernorm
    kv_norm_eps: float = 1e-6 # kv_a_layernorm

    def __post_init__(self):
        for f in dataclasses.fields(self):
            val = getattr(self, f.name)
            if f.name.endswith("eps"):
                require(is_finite_real(val) and val > 0,
                        f"MlaConfig.{f.name}: expected a positive finite float, found {val!r}")
            else:
                require(is_int_value(val) and val >= 1,
                        f"MlaConfig.{f.name}: expected a positive int, found {val!r}")

    @property
    def qk_head_dim(self) -> int:
        """n + r: the per-head query/key width (192 for K3)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """1 / sqrt(n + r) = 1/sqrt(192) for K3 (the full q.k width, not just the nope part)."""
        return 1.0 / math.sqrt(self.qk_head_dim)

    @property
    def cache_width(self) -> int:
        """R + r: values cached per token per layer ([c | k_pe], 576 for K3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


K3_MLA = MlaConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128)


def mla_weight_shapes(cfg: MlaConfig, hidden: int) -> dict[str, tuple[int, ...]]:
    """Module-local MLA weight names (checkpoint names without `...layers.{i}.self_attn.`) -> shape."""
    H, n, r, v, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    return {
        "q_a_proj.weight": (cfg.q_lora_rank, hidden),
        "q_a_layernorm.weight": (cfg.q_lora_rank,),
        "q_b_proj.weight": (H * (n + r), cfg.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (R + r, hidden),
        "kv_a_layernorm.weight": (R,),
        "kv_b_proj.weight": (H * (n + v), R),
        "g_proj.weight": (H * v, hidden),
        "o_proj.weight": (hidden, H * v),
    }


def check_mla_weights(weights: Mapping[str, np.ndarray], cfg: MlaConfig, hidden: int) -> None:
    """Every MLA weight present with its shape (shapes only, values are not scanned): callers check this
    before mutating a cache."""
    for name, shape in mla_weight_shapes(cfg, hidden).items():
        require(name in weights, f"weights: missing '{name}' (expected shape {shape})")
        check_shape(f"weights['{name}']", weights[name], shape)


def _weight(weights: Mapping[str, np.ndarray], name: str, cfg: MlaConfig, hidden: int, dtype, *,
            scan: bool = False) -> np.ndarray:
    """weights[name] checked (present, real dtype, shape per mla_weight_shapes) and cast to the compute dtype.

    Values are scanned for NaN/Inf only with scan=True (the 1-D norm weights, cheap); the matrices are not
    scanned here: their products are (`_proj`, `_checked`), which names the weight's first NaN/Inf when a
    finite input gives a non-finite output. Scanning every matrix on every call cost ~1.2 ms per MLA layer
    and decode step on the `small` config (~20 ms of a ~150 ms step)."""
    require(name in weights, f"weights: missing '{name}' (expected shape {mla_weight_shapes(cfg, hidden)[name]})")
    w = as_float(f"weights['{name}']", weights[name], allow_nan=not scan)
    check_shape(f"weights['{name}']", w, mla_weight_shapes(cfg, hidden)[name])
    return w.astype(dtype, copy=False)


def _checked(y: np.ndarray, name: str, w: np.ndarray) -> np.ndarray:
    """y, a product of weight `name` (values w) with a finite input. Non-finite y raises ValueError at the
    weight's first NaN/Inf (`weights['...']: expected finite values, found nan at index (i, j)`), or, for a
    finite weight, says the product overflowed."""
    if not scan_jit.all_finite(y):
        as_float(f"weights['{name}']", w)                              # raises at the weight's first NaN/Inf
        raise ValueError(f"weights['{name}']: expected finite outputs, found NaN/Inf from finite inputs and "
                         f"weight (overflow in {y.dtype})")
    return y


def _proj(x: np.ndarray, weights: Mapping[str, np.ndarray], name: str, cfg: MlaConfig, hidden: int) -> np.ndarray:
    """ops.linear(x, weights[name]) in x's dtype, output checked (`_checked`; ops.linear rejects NaN/Inf in x)."""
    w = _weight(weights, name, cfg, hidden, x.dtype)
    return _checked(ops.linear(x, w), name, w)


def _normed(norm: str, y, shape: tuple) -> np.ndarray:
    """The rmsnorm core's output for `norm` (q_a_layernorm / kv_a_layernorm): a wrong shape or a NaN/Inf out
    of a finite input and a finite weight is the core's, and is named here."""
    label = f"rmsnorm core output ({norm})"
    y = as_float(label, y)
    check_shape(label, y, shape)
    return y


def _cores(cores):
    """`cores`, or this module's own reference steps when None (the registry k3ref.cores imports this module,
    so this module does not import it)."""
    if cores is None:
        return types.SimpleNamespace(rmsnorm=ops.rmsnorm, mla_decode=mla_decode_core)
    return cores


@fixed_blas
def mla_project(weights: Mapping[str, np.ndarray], x: np.ndarray, cfg: MlaConfig, cores=None):
    """The per-token projections of the absorbed form.

    x: [B, D] -> q_nope [B, H, n], q_pe [B, H, r], c [B, R], k_pe [B, r], gate [B, H*v] (gate before sigmoid).
    q = W_qb RMSNorm_q(W_qa x) split per head [q_nope | q_pe]; [c_raw | k_pe] = W_kva x;
    c = RMSNorm_kv(c_raw); gate = W_g x. k_pe and q_pe are used as they are (NoPE: no rotation).
    Every output is finite: a NaN/Inf raises ValueError naming its source (x, the weight's first NaN/Inf, an
    overflowing product, or the rmsnorm core), so the [c | k_pe] rows are safe to cache.
    """
    x = as_float("x", x)
    B, D = check_shape("x", x, (None, None))
    cores = _cores(cores)
    H, n, r, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    norm_w = lambda name: _weight(weights, name, cfg, D, x.dtype, scan=True)  # noqa: E731
    q_a = _proj(x, weights, "q_a_proj.weight", cfg, D)
    q_lat = _normed("q_a_layernorm", cores.rmsnorm(q_a, norm_w("q_a_layernorm.weight"), cfg.q_norm_eps),
                    (B, cfg.q_lora_rank)).astype(x.dtype, copy=False)
    q = _proj(q_lat, weights, "q_b_proj.weight", cfg, D).reshape(B, H, n + r)
    kv = _proj(x, weights, "kv_a_proj_with_mqa.weight", cfg, D)
    c = _normed("kv_a_layernorm", cores.rmsnorm(kv[:, :R], norm_w("kv_a_layernorm.weight"), cfg.kv_norm_eps),
                (B, R)).astype(x.dtype, copy=False)
    gate = _proj(x, weights, "g_proj.weight", cfg, D)
    return q[..., :n], q[..., n:], c, kv[:, R:], gate


def _split_kv_b(W_kvb: np.ndarray, cfg: MlaConfig) -> tuple[np.ndarray, np.ndarray]:
    per_head = W_kvb.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return per_head[:, :cfg.qk_nope_head_dim, :], per_head[:, cfg.qk_nope_head_dim:, :]


def split_kv_b(W_kvb: np.ndarray, cfg: MlaConfig) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj.weight [H*(n+v), R] -> (W_UK [H, n, R], W_UV [H, v, R]); per head rows [n | v]."""
    W_kvb = as_float("W_kvb", W_kvb)
    H, n, v, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    check_shape("W_kvb", W_kvb, (H * (n + v), R))
    return _split_kv_b(W_kvb, cfg)


def _absorb(q_nope: np.ndarray, q_pe: np.ndarray, W_UK: np.ndarray) -> np.ndarray:
    q_lat = np.einsum("bhn,hnr->bhr", q_nope, W_UK.astype(q_nope.dtype, copy=False))
    return np.concatenate([q_lat, q_pe], axis=-1)


def absorb_q(q_nope: np.ndarray, q_pe: np.ndarray, W_kvb: np.ndarray, cfg: MlaConfig) -> np.ndarray:
    """q_abs_h = [W_UK,h^T q_nope_h | q_pe_h], so q_abs_h . [c_j | k_pe_j] = q_h . k_hj.

    q_nope: [B, H, n]; q_pe: [B, H, r]; W_kvb: [H*(n+v), R] -> q_abs [B, H, R + r] in q_nope's dtype.
    """
    q_nope = as_float("q_nope", q_nope)
    B, H, n = check_shape("q_nope", q_nope, (None, cfg.num_heads, cfg.qk_nope_head_dim))
    q_pe = as_float("q_pe", q_pe).astype(q_nope.dtype, copy=False)
    check_shape("q_pe", q_pe, (B, H, cfg.qk_rope_head_dim))
    W_UK, _ = split_kv_b(W_kvb, cfg)
    return _absorb(q_nope, q_pe, W_UK)


def check_decode_args(q_abs: np.ndarray, kv_cache: np.ndarray, block_table, seq_lens, *, scale, kv_rank,
                      scan_rows: bool = True):
    """Validate the `mla_decode` core's arguments; every implementation (k3ref, k3cuda) calls this.

    q_abs: [B, H, W] and kv_cache: [N_pages, page, W] float arrays (bf16 allowed); block_table: [B, max_pages]
    int; seq_lens: [B] int in [1, max_pages * page]; the pages a sequence uses are in [0, N_pages) and its
    rows are finite (slots past seq_len may hold anything). Returns ((B, H, W), pages) with pages[b] the page
    ids sequence b reads, in order. scan_rows=False skips the finite scan of the rows (a copy of every row
    read): for a caller that checks the values as it reads them and calls again with the scan on a failure.
    """
    B, H, W = check_shape("q_abs", q_abs, (None, None, None))
    N, page, _ = check_shape("kv_cache", kv_cache, (None, None, W))
    block_table, seq_lens = np.asarray(block_table), np.asarray(seq_lens)
    require(block_table.dtype.kind in "iu", f"block_table: expected an integer array, found dtype {block_table.dtype}")
    require(seq_lens.dtype.kind in "iu", f"seq_lens: expected an integer array, found dtype {seq_lens.dtype}")
    max_pages = check_shape("block_table", block_table, (B, None))[1]
    check_shape("seq_lens", seq_lens, (B,))
    require(isinstance(kv_rank, (int, np.integer)) and bool(1 <= kv_rank <= W),
            f"kv_rank: expected an int in [1, {W}] (cache row width), found {kv_rank!r}")
    require(is_finite_real(scale) and scale > 0,
            f"scale: expected a positive finite float, found {scale!r}")
    pages = []
    for b in range(B):
        L = int(seq_lens[b])
        require(1 <= L <= max_pages * page,
                f"seq_lens[{b}]: expected 1 <= seq_len <= {max_pages * page} (rows the block table maps: "
                f"{max_pages} pages of {page}), found {L}")
        used = block_table[b, : -(-L // page)]
        require(bool(np.all((used >= 0) & (used < N))),
                f"block_table[{b}]: expected page ids in [0, {N}) for the {used.size} page(s) of seq_len {L}, "
                f"found {used.tolist()}")
        if scan_rows:
            rows = kv_cache[used].reshape(-1, W)[:L]
            require(bool(np.all(np.isfinite(rows if rows.dtype.kind == "f" else rows.astype(np.float32)))),
                    f"kv_cache: expected finite rows for sequence {b} (seq_len {L}), found NaN/Inf in pages "
                    f"{used.tolist()}")
        pages.append(used)
    return (B, H, W), pages


# The compiled decode (k3ref.fast.mla_jit) is BLAS-free: the same bits on any thread count and BLAS core type (its
# softmax's exp is libm's, whose float64 bits move where the CPU lacks FMA: 39 of 32,768 elements, up to 16 ulp,
# tests/k3ref/test_same_bits.py). On one core, 96 heads x 4096 rows, it takes 13.2 ms in float32 where the readable
# form's BLAS calls take 12.7 ms, but 40 ms in float64 against 24 ms (docs/measurements.md), so it runs only when
# asked for: the float64 goldens and the host graph keep BLAS's sums until its float64 score pass matches BLAS.
COMPILED_DECODE = False


@fixed_blas
def mla_decode_core(q_abs: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray,
                    *, scale: float, kv_rank: int) -> np.ndarray:
    """Absorbed MLA decode over a paged latent cache (FlashMLA's decode interface): q_abs [B, H, R+P], kv_cache
    [N_pages, page, R+P], block_table [B, max_pages], seq_lens [B] -> o_lat [B, H, kv_rank], as
    `mla_decode_readable` states it, computed by the compiled form (`k3ref.fast.mla_jit`) when COMPILED_DECODE
    is set, `k3ref.fast.enabled()` (K3_FAST unset or "jit") and q_abs and kv_cache are both float32 or both
    float64, else by the readable form itself.

    The compiled form gives the same bits on any machine and thread count (fixed-order sums, no BLAS); it
    agrees with the readable form to float64 rounding (tests/k3ref/test_fast_jit_mla.py). Bad arguments raise
    the readable form's errors: a NaN/Inf row read is found as the kernel reads it and then named by
    `check_decode_args`' scan.
    """
    if not (COMPILED_DECODE and fast.enabled() and isinstance(q_abs, np.ndarray) and isinstance(kv_cache, np.ndarray)
            and q_abs.dtype == kv_cache.dtype and q_abs.dtype in (np.float32, np.float64)):
        return mla_decode_readable(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)
    q_abs = as_float("q_abs", q_abs)
    check_decode_args(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank, scan_rows=False)
    o_lat, finite = mla_jit.mla_decode(q_abs, kv_cache, np.asarray(block_table), np.asarray(seq_lens),
                                       scale, int(kv_rank))
    if not finite.all():                                # the readable check names the sequence and its pages
        check_decode_args(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)
    return o_lat


def mla_decode_readable(q_abs: np.ndarray, kv_cache: np.ndarray, block_table: np.ndarray, seq_lens: np.ndarray,
                        *, scale: float, kv_rank: int) -> np.ndarray:
    """Absorbed MLA decode over a paged latent cache, in its readable form (the statement the compiled form
    is tested against).

    q_abs: [B, H, R+P]; kv_cache: [N_pages, page, R+P] rows [c | k_pe]; block_table: [B, max_pages] int
    (block_table[b, i] holds tokens page*i .. page*i + page-1 of sequence b); seq_lens: [B] int, the
    cached tokens incl. the current one. For rows j < seq_lens[b]:
        s_hj = scale * q_abs_h . row_j;  p_h = softmax_j(s_h) (stable, float32 or wider);
        o_lat_h = sum_j p_hj row_j[:kv_rank]                          -> o_lat [B, H, R]
    Computed in the wider of q_abs's and kv_cache's dtype (at least float32). Slots past seq_lens are
    never read (they may hold NaN); the rows read must be finite.
    """
    q_abs = as_float("q_abs", q_abs)
    kv_cache = as_float("kv_cache", kv_cache, allow_nan=True)
    # the rows are scanned as they are gathered here, not copied a second time for the scan; a NaN/Inf found is
    # then named by check_decode_args' own scan (the sequence and its pages)
    (B, H, W), pages = check_decode_args(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank,
                                         scan_rows=False)
    dt = np.result_type(q_abs.dtype, kv_cache.dtype, np.float32)
    o_lat = np.full((B, H, kv_rank), np.nan, dtype=dt)
    for b in range(B):
        rows = kv_cache[pages[b]].reshape(-1, W)[:int(seq_lens[b])].astype(dt, copy=False)
        if not scan_jit.all_finite(rows):
            check_decode_args(q_abs, kv_cache, block_table, seq_lens, scale=scale, kv_rank=kv_rank)
        s = (q_abs[b].astype(dt, copy=False) @ rows.T) * dt.type(scale)     # [H, L]
        o_lat[b] = ops.softmax(s, axis=-1) @ rows[:, :kv_rank]
    return o_lat


def _check_cache_rows(rows: np.ndarray, cache: MlaKv, ids: list, cfg: MlaConfig) -> None:
    """The new [c | k_pe] rows [B, R + r] are finite as the cache will store them (in its dtype), else ValueError
    naming the row's source; mla_project's outputs are finite, so what is left is overflow in a narrow cache
    dtype (float16 tops out at 65504), which would otherwise poison the sequence for good."""
    with np.errstate(over="ignore"):                                 # the overflow is reported below
        stored = rows.astype(cache.dtype)
    stored = stored if stored.dtype.kind == "f" else stored.astype(np.float32)   # bfloat16
    if np.isfinite(stored).all():
        return
    b, j = (int(i) for i in np.argwhere(~np.isfinite(stored))[0])
    source = ("k_pe = weights['kv_a_proj_with_mqa.weight'] x" if j >= cfg.kv_lora_rank
              else "c = rmsnorm(kv_a_proj_with_mqa x; weights['kv_a_layernorm.weight'])")
    raise ValueError(f"cache rows: expected [c | k_pe] finite in the cache dtype {cache.dtype.name}, found "
                     f"{float(rows[b, j])} -> {stored[b, j]} at index ({b}, {j}) (sequence {ids[b]}; {source}); "
                     f"nothing was appended")


@fixed_blas
def mla_decode_token(weights: Mapping[str, np.ndarray], x: np.ndarray, cache: MlaKv, seq_ids, cfg: MlaConfig,
                     cores=None) -> np.ndarray:
    """One decode step for B sequences: append each token's [c | k_pe] to its sequence, then attend.

    x: [B, D] (row b is the next token of sequence seq_ids[b]); cache: MlaKv with width R + r and
    cfg.page_size -> y [B, D] in x's dtype. Steps: mla_project; absorb_q; cache.append;
    o_lat = cores.mla_decode(...); o_h = W_UV,h o_lat_h; y = W_o (concat_h o_h * sigmoid(gate)).
    All-or-nothing: x, seq_ids, cache, weight shapes, the projections and the new rows are checked before the
    cache is touched; an error after the append (the mla_decode core's output must be finite and [B, H, R], a
    NaN/Inf in W_UV or o_proj shows in their products) takes the appended rows back out before it propagates.
    """
    x = as_float("x", x)
    B, D = check_shape("x", x, (None, None))
    ids = [seq_ids] if isinstance(seq_ids, (int, np.integer)) else list(seq_ids)
    require(len(ids) == B, f"seq_ids: expected {B} ids (one per row of x), found {len(ids)}")
    require(isinstance(cache, MlaKv), f"cache: expected an MlaKv, found {type(cache).__name__}")
    require(cache.width == cfg.cache_width and cache.page_size == cfg.page_size,
            f"cache: expected width {cfg.cache_width} and page_size {cfg.page_size} (cfg), "
            f"found width {cache.width} and page_size {cache.page_size}")
    check_mla_weights(weights, cfg, D)
    cores = _cores(cores)
    H, v, R = cfg.num_heads, cfg.v_head_dim, cfg.kv_lora_rank
    q_nope, q_pe, c, k_pe, gate = mla_project(weights, x, cfg, cores)
    W_kvb = _weight(weights, "kv_b_proj.weight", cfg, D, x.dtype)
    W_UK, W_UV = _split_kv_b(W_kvb, cfg)
    q_abs = _checked(_absorb(q_nope, q_pe, W_UK), "kv_b_proj.weight", W_kvb)
    rows = np.concatenate([c, k_pe], axis=-1)
    _check_cache_rows(rows, cache, ids, cfg)
    cache.append(ids, rows)
    try:
        o_lat = cores.mla_decode(q_abs, cache.pages, cache.block_table(ids), cache.seq_lens(ids),
                                 scale=cfg.softmax_scale, kv_rank=R)
        o_lat = as_float("mla_decode core output", o_lat)
        check_shape("mla_decode core output", o_lat, (B, H, R))
        o_lat = o_lat.astype(x.dtype, copy=False)
        o = _checked(np.einsum("bhr,hvr->bhv", o_lat, W_UV), "kv_b_proj.weight", W_kvb).reshape(B, H * v)
        return _proj(o * ops.sigmoid(gate), weights, "o_proj.weight", cfg, D)
    except BaseException:
        cache.pop_last(ids)
        raise


@fixed_blas
def gated_mla_attend(weights: Mapping[str, np.ndarray], X: np.ndarray, cfg: MlaConfig, cores=None) -> np.ndarray:
    """The expanded form over one sequence, causal: keys and values materialised per head.

    X: [T, D] -> Y [T, D] in X's dtype. K_h,j = [W_UK,h c_j | k_pe_j], V_h,j = W_UV,h c_j,
    s_h,tj = q_h,t . K_h,j / sqrt(n + r) for j <= t, Y_t = W_o(concat_h softmax(s_h,t) V_h * sigmoid(W_g X_t)).
    Shares no code with the absorbed path beyond ops.linear/softmax/sigmoid (the linears through the
    same checked `_proj`: a NaN/Inf weight is named by its product) and the rmsnorm core (`cores`,
    reference when None: the host graph's prefill passes the backend's, as the decode path does).
    """
    X = as_float("X", X)
    T, D = check_shape("X", X, (None, None))
    H, n, r, v, R = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    proj = lambda Z, name: _proj(Z, weights, name, cfg, D)  # noqa: E731
    norm_w = lambda name: _weight(weights, name, cfg, D, X.dtype, scan=True)  # noqa: E731
    rmsnorm = _cores(cores).rmsnorm
    q_lat = _normed("q_a_layernorm", rmsnorm(proj(X, "q_a_proj.weight"), norm_w("q_a_layernorm.weight"),
                                             cfg.q_norm_eps), (T, cfg.q_lora_rank))
    q = proj(q_lat, "q_b_proj.weight").reshape(T, H, n + r)
    kv_a = proj(X, "kv_a_proj_with_mqa.weight")
    c = _normed("kv_a_layernorm", rmsnorm(kv_a[:, :R], norm_w("kv_a_layernorm.weight"), cfg.kv_norm_eps), (T, R))
    kv = proj(c, "kv_b_proj.weight").reshape(T, H, n + v)
    K = np.concatenate([kv[..., :n], np.broadcast_to(kv_a[:, None, R:], (T, H, r))], axis=-1)  # [T, H, n+r]
    V = kv[..., n:]                                                                     # [T, H, v]
    prefill = getattr(cores, "mla_prefill", None)
    if prefill is not None and prefill is not engine_mla.mla_prefill:   # a backend's prefill attention kernel
        cu = np.array([0, T], np.int32)
        o, _ = prefill(q, K, V, cu, cu, scale=cfg.softmax_scale)
        o = as_float("mla_prefill core output", o)
        check_shape("mla_prefill core output", o, (T, H, v))
        o = o.astype(X.dtype, copy=False).reshape(T, H * v)
    else:
        s = np.einsum("thd,jhd->htj", q, K) / math.sqrt(n + r)
        s = np.where(np.tri(T, dtype=bool)[None], s, -np.inf)                           # j <= t
        o = np.einsum("htj,jhv->thv", ops.softmax(s, axis=-1), V).reshape(T, H * v)
    return proj(o * ops.sigmoid(proj(X, "g_proj.weight")), "o_proj.weight")


def random_mla_weights(cfg: MlaConfig, hidden: int, rng: np.random.Generator,
                       dtype=np.float64) -> dict[str, np.ndarray]:
    """Synthetic module-local MLA weights with O(1) activations for unit-RMS x.

    Linear weights ~ N(0, 1/fan_in) (outputs keep unit scale); norm weights ~ 1 + 0.1 N(0, 1).
    """
    require(isinstance(hidden, (int, np.integer)) and hidden >= 1, f"hidden: expected a positive int, found {hidden!r}")
    out = {}
    for name, shape in mla_weight_shapes(cfg, hidden).items():
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / math.sqrt(shape[1])
        out[name] = w.astype(dtype)
    return out
