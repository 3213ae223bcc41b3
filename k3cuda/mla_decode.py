"""mla_decode: absorbed MLA decode over the paged latent cache on the GPU (kernel k3cuda/kernels/mla_decode.cu).

Same signature as k3ref.mla.mla_decode_core (FlashMLA's decode interface). Split-KV: `mla_decode_split_*`
writes per-split partial outputs (un-normalised o, running max m, running sum l), `mla_decode_combine` merges
them. `emulate_split_kv` is the same algorithm in NumPy, step by step (splits, 16-row tiles, online softmax,
combine), so the combine math is tested on a machine without a GPU.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from k3ref.cache import paged_latent_cache
from k3ref.checks import as_float, require
from k3ref.cores import require_supported
from k3ref.mla import check_decode_args

from . import runtime
from .forcing import forced_entry
from .spec import BenchCase, CheckCase, EntrySpec, KernelSpec, Traffic, register_budget

MAX_R, MAX_P = 512, 64        # latent and rope widths the register layout covers (K3: 512 + 64)
PAGE = 64                     # K3's page size (FlashMLA's); the kernel takes it as a parameter
TILE = 16                     # cache rows per shared-memory tile (MLA_TILE)
HEADS_PER_BLOCK = 16          # 4 warps x 4 heads (MLA_HEADS_PER_BLOCK)
THREADS, MIN_BLOCKS = 128, 2  # split blocks: MLA_THREADS, MLA_MIN_BLOCKS
COMBINE_THREADS, COMBINE_MIN_BLOCKS = 128, 4
MIN_CHUNK = 2 * TILE          # fewest rows a split gets (unless the sequence is shorter)
WAVES = 4                     # plan about this many blocks per SM (2 resident x 2 waves)
GRID_YZ_MAX = 65535           # CUDA's limit on gridDim.y and gridDim.z

ENTRY_F32, ENTRY_BF16, ENTRY_COMBINE = "mla_decode_split_f32", "mla_decode_split_bf16", "mla_decode_combine"
CHOOSABLE_ENTRIES = (ENTRY_F32, ENTRY_BF16)   # split_entry chooses by the cache dtype; k3cuda.force_entry may override
# packing order of the split entries (the .cu signature): pointers, then scalars
SPLIT_ARGS = ("q", "kv", "block_table", "seq_lens", "o_part", "m_part", "l_part",
              "scale", "H", "R", "P", "max_pages", "page_size", "chunk", "num_splits")
SPLIT_FORMAT = "PPPPPPPfiiiiiii"
COMBINE_ARGS = ("o_part", "m_part", "l_part", "o_lat", "H", "R", "num_splits")
COMBINE_FORMAT = "PPPPiii"

KERNEL = KernelSpec(
    block="mla_decode",
    source="mla_decode.cu",
    entries=(
        EntrySpec(ENTRY_F32, SPLIT_FORMAT, THREADS, register_budget(THREADS, MIN_BLOCKS)),
        EntrySpec(ENTRY_BF16, SPLIT_FORMAT, THREADS, register_budget(THREADS, MIN_BLOCKS)),
        EntrySpec(ENTRY_COMBINE, COMBINE_FORMAT, COMBINE_THREADS, register_budget(COMBINE_THREADS, COMBINE_MIN_BLOCKS)),
    ),
)


def _is_bf16(a) -> bool:
    return getattr(np.asarray(a).dtype, "name", "") == "bfloat16"


def check_inputs(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
    """Validate the core's arguments for the kernel; return (q f32, cache f32|bf16, table i32, lens i32, dims).

    q_abs: [B, H, W]; kv_cache: [N_pages, page, W]; block_table: [B, max_pages] int; seq_lens: [B] int in
    [1, max_pages*page]; page ids of used pages in [0, N_pages); the used cache rows finite. Kernel limits:
    R = kv_rank <= 512 with R % 4 == 0, P = W - R <= 64 with P % 2 == 0.
    dims = dict(B, H, W, R, P, N, page, max_pages).
    """
    q = as_float("q_abs", q_abs)
    bf16 = _is_bf16(kv_cache)
    kv = np.asarray(kv_cache) if bf16 else as_float("kv_cache", kv_cache, allow_nan=True)
    (B, H, W), _ = check_decode_args(q, kv, block_table, seq_lens, scale=scale, kv_rank=kv_rank)
    N, page, _ = kv.shape
    max_pages = np.shape(block_table)[1]
    R, P = int(kv_rank), W - int(kv_rank)
    require_supported(R <= MAX_R and R % 4 == 0 and P <= MAX_P and P % 2 == 0,
            f"mla_decode (CUDA): expected kv_rank R <= {MAX_R} with R % 4 == 0 and rope width P = W - R <= {MAX_P} "
            f"with P % 2 == 0, found R={R}, P={P}, W={W} (use the k3ref core for other widths)")
    q32 = np.ascontiguousarray(q, np.float32)
    kv_dev = np.ascontiguousarray(kv) if bf16 else np.ascontiguousarray(kv, np.float32)
    dims = dict(B=B, H=H, W=W, R=R, P=P, N=N, page=page, max_pages=max_pages)
    return q32, kv_dev, np.ascontiguousarray(block_table, np.int32), np.ascontiguousarray(seq_lens, np.int32), dims


def plan_splits(seq_lens, H: int, sm_count: int) -> tuple[int, int]:
    """(num_splits, chunk): split b's rows [s*chunk, min((s+1)*chunk, L_b)) among num_splits blocks.

    Enough splits for about WAVES blocks per SM over B * ceil(H/16) * num_splits blocks, at least MIN_CHUNK rows
    per split, chunk a multiple of TILE (so a split may end mid-page; sequences shorter than s*chunk leave
    split s empty).
    """
    lens = np.asarray(seq_lens)
    require(lens.ndim == 1 and lens.size >= 1 and int(lens.min()) >= 1,
            f"seq_lens: expected a non-empty [B] array of lengths >= 1, found {lens!r}")
    require(H >= 1 and sm_count >= 1, f"expected H >= 1 and sm_count >= 1, found H={H}, sm_count={sm_count}")
    max_len = int(lens.max())
    base = lens.size * (-(-H // HEADS_PER_BLOCK))
    want = max(1, -(-WAVES * sm_count // base))
    splits = max(1, min(want, -(-max_len // MIN_CHUNK)))
    chunk = -(-max_len // splits)
    chunk = -(-chunk // TILE) * TILE
    return -(-max_len // chunk), chunk


def split_grid(B: int, H: int, num_splits: int) -> tuple[int, int, int]:
    """Grid of the split entries: (head groups of 16, splits, sequences); head groups vary fastest so the
    blocks that read the same cache rows run side by side (L2 reuse). Grid y and z are limited to 65535."""
    require(B <= GRID_YZ_MAX and num_splits <= GRID_YZ_MAX,
            f"mla_decode (CUDA): expected B <= {GRID_YZ_MAX} and num_splits <= {GRID_YZ_MAX} (grid z, y), "
            f"found B={B}, num_splits={num_splits}")
    return (-(-H // HEADS_PER_BLOCK), num_splits, B)


def combine_grid(B: int, H: int) -> tuple[int, int]:
    """Grid of the combine entry: one block per (head, sequence); B <= 65535 (grid y)."""
    require(B <= GRID_YZ_MAX, f"mla_decode (CUDA): expected B <= {GRID_YZ_MAX} (grid y), found B={B}")
    return (H, B)


def split_entry(kv_cache) -> str:
    """The split entry for the cache's dtype: bf16 stays bf16 on the device, anything else goes as float32
    (or the entry k3cuda.force_entry set)."""
    return forced_entry(KERNEL.block) or (ENTRY_BF16 if _is_bf16(kv_cache) else ENTRY_F32)


def _cache_as(kv: np.ndarray, entry: str) -> np.ndarray:
    """The validated cache in the dtype `entry` reads. A forced bf16 entry takes a float cache only when every
    value is a bf16 value (a golden's bf16-exact cache), so that the entry computes the same math."""
    if entry == ENTRY_BF16 and not _is_bf16(kv):
        narrow = kv.astype(ml_dtypes.bfloat16)
        require(np.array_equal(narrow.astype(kv.dtype), kv, equal_nan=True),
                f"kv_cache: the bf16 entry {ENTRY_BF16} was forced, but the {kv.dtype} cache holds values bf16 "
                "cannot represent; round the cache to bf16 first")
        return np.ascontiguousarray(narrow)
    if entry == ENTRY_F32 and _is_bf16(kv):
        return np.ascontiguousarray(kv, np.float32)
    return kv


def device_launch(inputs: dict, num_splits: int | None = None, chunk: int | None = None) -> runtime.Launch:
    """Upload the core's inputs once and return a Launch (split entry, then combine).

    inputs: q_abs, kv_cache, block_table, seq_lens, scale, kv_rank; num_splits and chunk override the plan
    (plan_splits). Output: 'o_lat' [B, H, R]; the partials stay readable in `buffers` ('o_part' [B, S, H, R],
    'm_part' / 'l_part' [B, S, H]); all four are poisoned with NaN before the launch.
    """
    q, kv, table, lens, d = check_inputs(inputs["q_abs"], inputs["kv_cache"], inputs["block_table"],
                                         inputs["seq_lens"], scale=inputs["scale"], kv_rank=inputs["kv_rank"])
    B, H, R, P = d["B"], d["H"], d["R"], d["P"]
    if num_splits is None or chunk is None:
        num_splits, chunk = plan_splits(lens, H, runtime.multiprocessor_count())
    require(num_splits >= 1 and chunk >= 1 and num_splits * chunk >= int(lens.max()),
            f"num_splits, chunk: expected >= 1 each with num_splits * chunk >= max seq_len {int(lens.max())}, "
            f"found {num_splits} * {chunk}")
    entry = split_entry(inputs["kv_cache"])
    kv = _cache_as(kv, entry)
    bufs = dict(
        q=runtime.to_device(q),
        kv=runtime.to_device(kv.view(np.uint16), np.uint16) if entry == ENTRY_BF16 else runtime.to_device(kv),
        block_table=runtime.to_device(table, np.int32), seq_lens=runtime.to_device(lens, np.int32),
        o_part=runtime.empty_poisoned((B, num_splits, H, R)),
        m_part=runtime.empty_poisoned((B, num_splits, H)), l_part=runtime.empty_poisoned((B, num_splits, H)),
        o_lat=runtime.empty_poisoned((B, H, R)),
    )
    scalars = dict(scale=np.float32(inputs["scale"]), H=np.int32(H), R=np.int32(R), P=np.int32(P),
                   max_pages=np.int32(d["max_pages"]), page_size=np.int32(d["page"]), chunk=np.int32(chunk),
                   num_splits=np.int32(num_splits))
    split_args = pack_args(SPLIT_ARGS, bufs, scalars)
    combine_args = pack_args(COMBINE_ARGS, bufs, scalars)

    split = runtime.bind(KERNEL, entry, split_grid(B, H, num_splits), split_args)
    combine = runtime.bind(KERNEL, ENTRY_COMBINE, combine_grid(B, H), combine_args)

    def run():
        split()
        combine()

    return runtime.Launch(run, bufs, ("o_lat",))


def pack_args(names: tuple[str, ...], bufs: dict, scalars: dict) -> tuple:
    """Arguments in kernel order: device pointers for buffer names, numpy scalars for the rest."""
    return tuple(runtime.ptr(bufs[n]) if n in bufs else scalars[n] for n in names)


def mla_decode(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank):
    """Absorbed MLA decode on the GPU; the k3ref.mla.mla_decode_core contract.

    q_abs: [B, H, R+P]; kv_cache: [N_pages, page, R+P] rows [c | k_pe] (bf16 kept as bf16, else float32);
    block_table: [B, max_pages] int32; seq_lens: [B] int32 (>= 1, incl. the current token).
      s_hj = scale * q_abs_h . row_j (j < seq_lens[b]);  o_lat_h = sum_j softmax_j(s_h)_j row_j[:R]
    Returns o_lat [B, H, R] float32.
    """
    launch = device_launch(dict(q_abs=q_abs, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                                scale=scale, kv_rank=kv_rank))
    launch()
    return launch.buffers["o_lat"].get()


def emulate_split_kv(q_abs, kv_cache, block_table, seq_lens, *, scale, kv_rank, num_splits, chunk, tile=TILE,
                     return_partials=False):
    """The kernel's algorithm in NumPy float64, step by step: splits of `chunk` rows, tiles of `tile` rows with
    an online softmax (running max m, running sum l, un-normalised accumulator), then the combine.

    Per (b, split s): rows [s*chunk, min((s+1)*chunk, L_b)); an empty split leaves o = 0, m = -inf, l = 0.
    Per tile: m' = max(m, max_j s_j); alpha = e^(m - m'); p_j = e^(s_j - m'); l = alpha l + sum p; o = alpha o + p c.
    Combine: M = max_s m_s; o_lat = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
    Returns o_lat [B, H, R] (and (o_part [B,S,H,R], m_part [B,S,H], l_part [B,S,H]) with return_partials).
    """
    q = np.asarray(q_abs, np.float64)
    kv = np.asarray(np.asarray(kv_cache).astype(np.float32), np.float64)
    B, H, W = q.shape
    page = kv.shape[1]
    R = int(kv_rank)
    flat = kv.reshape(-1, W)
    o_part = np.zeros((B, num_splits, H, R))
    m_part = np.full((B, num_splits, H), -np.inf)
    l_part = np.zeros((B, num_splits, H))
    for b in range(B):
        L = int(seq_lens[b])
        for s in range(num_splits):
            t0, t1 = s * chunk, min((s + 1) * chunk, L)
            m, l_sum, acc = np.full(H, -np.inf), np.zeros(H), np.zeros((H, R))
            for tb in range(t0, t1, tile):
                t = np.arange(tb, min(tb + tile, t1))
                rows = flat[np.asarray(block_table)[b, t // page].astype(np.int64) * page + t % page]   # [n, W]
                sc = (q[b] @ rows.T) * scale                                                  # [H, n]
                m_new = np.maximum(m, sc.max(axis=1))
                alpha = np.exp(m - m_new)
                p = np.exp(sc - m_new[:, None])
                l_sum = l_sum * alpha + p.sum(axis=1)
                acc = acc * alpha[:, None] + p @ rows[:, :R]
                m = m_new
            o_part[b, s], m_part[b, s], l_part[b, s] = acc, m, l_sum
    M = m_part.max(axis=1, keepdims=True)                                                     # [B, 1, H]
    w = np.exp(m_part - M)                                                                     # empty split: 0
    o_lat = np.einsum("bsh,bshr->bhr", w, o_part) / np.einsum("bsh,bsh->bh", w, l_part)[..., None]
    return (o_lat, (o_part, m_part, l_part)) if return_partials else o_lat


def traffic(B: int, H: int, seq_len: int, R: int = MAX_R, P: int = MAX_P, cache_itemsize: int = 2,
            page: int = PAGE) -> Traffic:
    """FlashMLA's accounting for one decode step of B sequences of seq_len cached rows (incl. the new one)."""
    W = R + P
    pages = -(-seq_len // page)
    nbytes = (
        B * seq_len * W * cache_itemsize   # cache rows [c | k_pe], read once per sequence for all heads
        + B * H * W * 4                    # q_abs read (fp32)
        + B * H * R * 4                    # o_lat written (fp32)
        + B * pages * 4                    # block-table entries of the used pages (int32)
        + B * 4                            # seq_lens (int32)
    )
    flops = (
        2 * B * H * seq_len * W            # scores q_abs . row
        + 2 * B * H * seq_len * R          # p . c
    )
    return Traffic(bytes=nbytes, flops=flops)


def make_inputs(rng: np.random.Generator, seq_lens, H: int, *, R: int = MAX_R, P: int = MAX_P, page: int = PAGE,
                cache_dtype="float32", spare_pages: int = 1) -> dict:
    """Random core inputs: B = len(seq_lens) sequences on pages shuffled over a pool with `spare_pages` unused
    pages; unused pages and the unused tail of each last page hold NaN (the kernel must never read them).

    q ~ N(0, 1), cache ~ N(0, 1): scores have std ~ sqrt(W) * scale ~ 1 with scale = 1/sqrt(192).
    """
    lens = np.asarray(seq_lens, np.int32)
    B, W = lens.size, R + P
    cache, table = paged_latent_cache(rng, lens, W, page, spare_pages=spare_pages, spare_columns=0)
    pages = cache.astype(np.float32)
    if cache_dtype == "bfloat16":
        pages = pages.astype(ml_dtypes.bfloat16)
    return dict(q_abs=rng.standard_normal((B, H, W), dtype=np.float32), kv_cache=pages, block_table=table,
                seq_lens=lens, scale=1.0 / math.sqrt(192.0), kv_rank=R)


def bench_cases() -> list[BenchCase]:
    """B = 64 sequences, context 4096 / 8192, H in {12, 96}, bf16 cache; gate at 0.6 of copy bandwidth."""
    cases = []
    for ctx in (4096, 8192):
        for H in (12, 96):
            cases.append(BenchCase(
                label=f"B64-L{ctx}-H{H}-bf16",
                make_inputs=lambda rng, ctx=ctx, H=H: make_inputs(rng, [ctx] * 64, H, cache_dtype="bfloat16",
                                                                  spare_pages=0),
                traffic=traffic(64, H, ctx),
                target_bw_ratio=0.6,
            ))
    return cases


def check_cases() -> list[CheckCase]:
    """Small correctness cases: one row, ragged lengths (empty splits, splits ending mid-page), bf16, odd H,
    narrow latents (R=64, P=16; the tiny config's R=16, P=4 and an fp32 row of 18 values), more than one head
    group."""
    return [
        CheckCase("B1-L1-H1", lambda rng: make_inputs(rng, [1], 1)),
        CheckCase("B3-L1,63,130-H5", lambda rng: make_inputs(rng, [1, 63, 130], 5)),
        CheckCase("B2-L200,77-H17-bf16", lambda rng: make_inputs(rng, [200, 77], 17, cache_dtype="bfloat16")),
        CheckCase("B2-L97,33-H3-R64P16", lambda rng: make_inputs(rng, [97, 33], 3, R=64, P=16)),
        # tiny-config widths: bf16 rows of 40 bytes and fp32 rows of 72 bytes load element by element
        CheckCase("B2-L9,70-H4-R16P4-bf16", lambda rng: make_inputs(rng, [9, 70], 4, R=16, P=4,
                                                                   cache_dtype="bfloat16")),
        CheckCase("B1-L33-H2-R16P2", lambda rng: make_inputs(rng, [33], 2, R=16, P=2)),
        CheckCase("B1-L520-H33", lambda rng: make_inputs(rng, [520], 33)),   # 3 head groups, 17 splits
    ]
