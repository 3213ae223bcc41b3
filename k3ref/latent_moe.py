"""Stable LatentMoE: sigmoid router, routed SiTU experts in a latent width, shared experts (docs/spec.md section 3.4).

    s     = sigma(W_r x)                                   (fp32 or wider)
    idx   = top_k(s + e_score_correction_bias)             (the bias only selects; DeepSeek-V3 groups)
    w     = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    z     = W_down_lat x                                   ([T, D] -> [T, Dl])
    y_lat = sum_k w_k * E_idx_k(z)                         (E = MXFP4 SiTU-GLU expert; w applied after w2)
    y     = W_up_lat RMSNorm_1e-5(y_lat; routed_expert_norm) + Shared(x)

Weights are a module-local Mapping (names of docs/spec.md section 7 without the layer prefix); only the
selected experts' tensors are read from it.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Mapping

import numpy as np

from . import fast, mxfp4
from .checks import as_float, check_shape, require
from .engine import moe as engine_moe
from .fast import latent_moe as moe_fast
from .fast import scan_jit
from .ops import linear, rmsnorm, sigmoid
from .situ import situ_glu, situ_glu_vec

RENORM_EPS = 1e-20
EXPERT_PROJS = ("w1", "w2", "w3")   # w1 = gate [I, Dl], w3 = up [I, Dl], w2 = down [Dl, I]


@dataclasses.dataclass(frozen=True)
class LatentMoeConfig:
    """Geometry and routing of one LatentMoE layer (K3: 7168, 896, 16, 3584, 3072, 2, 6144)."""

    hidden_size: int                 # D, the residual width
    num_experts: int                 # E routed experts
    top_k: int                       # experts per token
    latent_size: int                 # Dl, routed_expert_hidden_size (multiple of 32: MXFP4 groups of w1/w3)
    moe_intermediate_size: int       # I per routed expert (multiple of 32: MXFP4 groups of w2)
    n_shared_experts: int            # shared experts, fused into one SiTU MLP
    shared_intermediate_size: int    # width of the FUSED shared MLP (K3: 2 x 3072 = 6144), not per expert
    n_group: int = 1                 # DeepSeek-V3 expert groups
    topk_group: int = 1              # groups kept per token
    renormalize: bool = True         # norm_topk_prob
    routed_scaling_factor: float = 1.0
    use_norm: bool = True            # latent_moe_use_norm: RMSNorm on y_lat before the up projection
    situ_beta: float = 4.0
    linear_beta: float = 25.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        for f in ("hidden_size", "num_experts", "top_k", "latent_size", "moe_intermediate_size",
                  "n_group", "topk_group"):
            v = getattr(self, f)
            require(isinstance(v, (int, np.integer)) and v >= 1, f"{f}: expected a positive int, found {v!r}")
        for f in ("n_shared_experts", "shared_intermediate_size"):
            v = getattr(self, f)
            require(isinstance(v, (int, np.integer)) and v >= 0, f"{f}: expected an int >= 0, found {v!r}")
        require(self.top_k <= self.num_experts,
                f"top_k: expected <= num_experts = {self.num_experts}, found {self.top_k}")
        _check_groups(self.num_experts, self.top_k, self.n_group, self.topk_group)
        for f in ("latent_size", "moe_intermediate_size"):
            require(getattr(self, f) % 32 == 0,
                    f"{f}: expected a multiple of 32 (MXFP4 groups), found {getattr(self, f)}")
        require(self.routed_scaling_factor > 0,
                f"routed_scaling_factor: expected > 0, found {self.routed_scaling_factor}")
        require(self.n_shared_experts == 0 or self.shared_intermediate_size >= 1,
                f"shared_intermediate_size: expected >= 1 with {self.n_shared_experts} shared experts, "
                f"found {self.shared_intermediate_size}")

    @property
    def shared_width(self) -> int:
        """Rows of shared_experts.gate_proj / up_proj (0 without shared experts): the fused MLP's width."""
        return self.shared_intermediate_size if self.n_shared_experts > 0 else 0


def _check_groups(E: int, top_k: int, n_group: int, topk_group: int) -> None:
    require(isinstance(n_group, (int, np.integer)) and n_group >= 1,
            f"n_group: expected a positive int, found {n_group!r}")
    require(E % n_group == 0, f"n_group: expected a divisor of num_experts = {E}, found {n_group}")
    require(1 <= topk_group <= n_group, f"topk_group: expected 1..n_group = {n_group}, found {topk_group}")
    if n_group > 1:
        require(E // n_group >= 2, f"n_group: expected >= 2 experts per group (group score = top-2 sum), "
                                   f"found {E // n_group}")
    require(top_k <= topk_group * (E // n_group),
            f"top_k: expected <= topk_group * experts per group = {topk_group * (E // n_group)}, found {top_k}")


def _topk_desc(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, descending; ties: lower index first (stable sort)."""
    return np.argsort(-scores, axis=-1, kind="stable")[..., :k]


def sigmoid_topk(logits: np.ndarray, bias: np.ndarray, top_k: int, n_group: int = 1, topk_group: int = 1,
                 renormalize: bool = True, scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The `moe_route` core (DeepSeek-V3 gate with sigmoid scores and a selection-only bias).

    logits: [T, E]; bias: [E] -> (weights [T, k] float32/float64, indices [T, k] int64).
    s = sigma(logits) (fp32 or wider); choice = s + bias; with n_group > 1 each group scores the sum of its
    top-2 choice values, the best topk_group groups are kept and the rest set to -inf; indices = top_k(choice),
    ordered by descending choice, ties to the lower expert index. weights = s[indices] (unbiased), divided by
    (sum + 1e-20) when renormalize, times scaling.
    """
    logits = as_float("logits", logits)
    T, E = check_shape("logits", logits, (None, None))
    bias = as_float("bias", bias)
    check_shape("bias", bias, (E,))
    require(isinstance(top_k, (int, np.integer)) and 1 <= top_k <= E,
            f"top_k: expected an int in 1..{E}, found {top_k!r}")
    _check_groups(E, top_k, n_group, topk_group)
    s = sigmoid(logits)
    choice = s + bias.astype(s.dtype)
    if n_group > 1:
        grouped = choice.reshape(T, n_group, E // n_group)
        top2 = -np.sort(-grouped, axis=-1)[..., :2]
        keep = _topk_desc(top2.sum(axis=-1), topk_group)           # [T, topk_group]
        masked = np.full((T, n_group), True)
        np.put_along_axis(masked, keep, False, axis=-1)
        choice = np.where(masked[..., None], -np.inf, grouped).reshape(T, E)
    idx = _topk_desc(choice, top_k).astype(np.int64)
    return route_weights(s, idx, renormalize, scaling), idx


def route_weights(s: np.ndarray, idx: np.ndarray, renormalize: bool = True, scaling: float = 1.0) -> np.ndarray:
    """The routing weights of chosen experts: s [T, E] (sigmoid scores, unbiased), idx [T, k] -> [T, k] in s's
    dtype, s[idx] divided by (sum + 1e-20) when renormalize, times scaling. sigmoid_topk's last step; also
    what a caller that fixes the choice (a teacher-forced route) weights it by."""
    w = np.take_along_axis(s, idx, axis=-1)
    if renormalize:
        w = w / (np.sum(w, axis=-1, keepdims=True) + RENORM_EPS)
    return (w * scaling).astype(s.dtype, copy=False)


def _checked_route(T: int, weights, indices) -> tuple[np.ndarray, np.ndarray]:
    """The routing of T tokens checked: weights float [T, k], indices int [T, k] with k distinct experts a row."""
    weights = as_float("weights", weights)
    _, k = check_shape("weights", weights, (T, None))
    indices = np.asarray(indices)
    require(indices.dtype.kind in "iu", f"indices: expected an integer dtype, found {indices.dtype}")
    check_shape("indices", indices, (T, k))
    ordered = np.sort(indices, axis=-1)
    repeats = np.nonzero(np.any(ordered[:, 1:] == ordered[:, :-1], axis=-1))[0]
    if len(repeats):
        raise ValueError(f"indices: expected k distinct experts per token, found a repeat in row {int(repeats[0])}: "
                         f"{indices[repeats[0]].tolist()}")
    return weights, indices


def mix_routed_experts(z: np.ndarray, weights: np.ndarray, indices: np.ndarray,
                       expert_fn: Callable[[int, np.ndarray], np.ndarray], experts: range | None = None) -> np.ndarray:
    """y_lat[t] = sum_k weights[t, k] * expert_fn(indices[t, k], z[t]), grouped by expert.

    experts: when given, only the selected experts in it contribute (one expert-parallel rank's partial sum).

    z: [T, Dl]; weights: [T, k]; indices: [T, k] int -> y_lat [T, Dl] in z's dtype. expert_fn(e, rows [n, Dl])
    -> [n, Dl] is called once per selected expert with the rows that chose it (never for unselected ones);
    the routing weight is applied to its output (after w2).
    """
    z = as_float("z", z)
    T, Dl = check_shape("z", z, (None, None))
    weights, indices = _checked_route(T, weights, indices)
    y = np.zeros_like(z)
    for e in np.unique(indices):
        if experts is not None and int(e) not in experts:
            continue
        tok, slot = np.nonzero(indices == e)                          # distinct experts: tok has no repeats, so a
        out = np.asarray(expert_fn(int(e), z[tok]))                   # fancy-index += adds each row once (no add.at)
        check_shape(f"expert_fn({int(e)}) output", out, (len(tok), Dl))
        y[tok] += weights[tok, slot, None].astype(z.dtype) * out.astype(z.dtype, copy=False)
    return y


def _tensor(weights: Mapping, name: str, shape: tuple) -> np.ndarray:
    try:
        a = weights[name]
    except KeyError:
        raise ValueError(f"weights: missing tensor {name!r} (expected shape {list(shape)})") from None
    a = np.asarray(a)
    check_shape(name, a, shape)
    return a


def _check_expert(weights: Mapping, e: int, cfg: LatentMoeConfig) -> moe_fast.ExpertTensors:
    Dl, Di = cfg.latent_size, cfg.moe_intermediate_size
    out: moe_fast.ExpertTensors = {}
    for proj, (rows, cols) in (("w1", (Di, Dl)), ("w3", (Di, Dl)), ("w2", (Dl, Di))):
        packed = _tensor(weights, f"experts.{e}.{proj}.weight_packed", (rows, cols // 2))
        scale = _tensor(weights, f"experts.{e}.{proj}.weight_scale", (rows, cols // 32))
        for name, a in (("weight_packed", packed), ("weight_scale", scale)):
            if a.dtype != np.uint8:                 # not `require`: its message would be formatted on every call
                raise ValueError(f"experts.{e}.{proj}.{name}: expected dtype uint8, found {a.dtype}")
        out[proj] = (packed, scale)
    # Where every projection lies (None for a strided one), taken once with the checks: the compiled pairs form
    # reads the experts by address, and taking 16 arrays' addresses costs ~16 us a projection.
    out["at"] = {proj: moe_fast.addresses(*out[proj]) for proj in ("w1", "w3", "w2")}
    return out


def _expert_tensors(weights: Mapping, e: int, cfg: LatentMoeConfig) -> moe_fast.ExpertTensors:
    """Expert e's (packed, scale) per projection, shapes and dtypes checked: once per model where the weights
    are a view that keeps its casts (`k3ref.cpu_weights.ModuleView.memo`), else on every layer call."""
    memo = getattr(weights, "memo", None)
    if memo is None:
        return _check_expert(weights, e, cfg)
    return memo(("expert", e), lambda: _check_expert(weights, e, cfg))


def _cores(cores):
    """`cores`, or this module's own reference steps when None (the registry k3ref.cores imports this module,
    so this module does not import it)."""
    if cores is None:
        return types.SimpleNamespace(moe_route=sigmoid_topk, mxfp4_gemv=mxfp4.mxfp4_gemv, rmsnorm=rmsnorm,
                                     situ_glu=situ_glu, moe_experts=engine_moe.moe_experts)
    return cores


def _gemv_of(cores):
    """The gemv for experts whose tensors `_expert_tensors` checked: the reference core's checked-once form when
    `cores` has the reference core, else the swapped-in core itself (a kernel under test sees every call)."""
    return mxfp4.mxfp4_gemv_prechecked if cores.mxfp4_gemv is mxfp4.mxfp4_gemv else cores.mxfp4_gemv


def _run_expert(t: dict, z: np.ndarray, cfg: LatentMoeConfig, cores, gemv) -> np.ndarray:
    """E(z) = W2 situ_glu(W1 z, W3 z) for checked tensors `t` and a checked float z [n, Dl] -> [n, Dl]."""
    h = cores.situ_glu(np.asarray(gemv(*t["w1"], z)), np.asarray(gemv(*t["w3"], z)), beta=cfg.situ_beta,
                       linear_beta=cfg.linear_beta)
    return np.asarray(gemv(*t["w2"], np.asarray(h).astype(z.dtype, copy=False))).astype(z.dtype, copy=False)


def routed_expert(weights: Mapping, e: int, z: np.ndarray, cfg: LatentMoeConfig, cores=None) -> np.ndarray:
    """One routed expert: E_e(z) = W2 situ_glu(W1 z, W3 z) with MXFP4 weights via `cores.mxfp4_gemv`.

    weights: `experts.{e}.w{1,3}.weight_packed` u8 [I, Dl/2] + `.weight_scale` u8 [I, Dl/32],
    `experts.{e}.w2.weight_packed` u8 [Dl, I/2] + `.weight_scale` u8 [Dl, I/32]; z: [n, Dl] -> [n, Dl].
    """
    cores = _cores(cores)
    z = as_float("z", z)
    check_shape("z", z, (None, cfg.latent_size))
    return _run_expert(_expert_tensors(weights, e, cfg), z, cfg, cores, _gemv_of(cores))


def _fused_routed_experts(weights: Mapping, z: np.ndarray, w: np.ndarray, idx: np.ndarray, cfg: LatentMoeConfig,
                          fused: Callable, chosen: list[int]) -> np.ndarray:
    """y_lat by a backend's fused `moe_experts` kernel, called once for the layer's tokens on the stack of the
    `chosen` experts only (ids remapped to stack rows, as an engine holding a rank's experts does). A slot whose
    expert is not chosen (another expert-parallel rank's) gets weight 0 on stack row 0: its term is exactly 0."""
    idx = np.asarray(idx)
    if not chosen:
        return np.zeros_like(z)
    row = np.zeros(int(idx.max()) + 1, idx.dtype)                    # expert id -> stack row; not chosen -> 0
    row[chosen] = np.arange(len(chosen))
    w = np.asarray(w)
    local_w = np.where(np.isin(idx, chosen), w, 0).astype(w.dtype)
    y = fused(z, local_w, row[idx], *engine_moe.stack_experts(weights, chosen, cfg), beta=cfg.situ_beta,
              linear_beta=cfg.linear_beta)
    out = np.asarray(y).astype(z.dtype, copy=False)
    check_shape("moe_experts output", out, z.shape)
    return out


def routed_experts(weights: Mapping, z: np.ndarray, w: np.ndarray, idx: np.ndarray, cfg: LatentMoeConfig,
                   cores=None, experts: range | None = None) -> np.ndarray:
    """y_lat = sum_k w_k E_idx_k(z): every selected expert of a layer in one call, inputs checked once here.

    z: [T, Dl]; w: [T, k]; idx: [T, k] -> y_lat [T, Dl] (mixed by `mix_routed_experts`). The experts' tensors
    are checked when first read; the gemvs inside run unchecked (the reference core) or through the swapped core.
    experts: the expert ids this rank holds (expert parallelism: the others' terms are left out, the partial
    sums all-reduced by the caller); None = all.
    A `cores.moe_experts` other than k3ref's (a backend's fused kernel) computes y_lat in one call on the stacked
    experts (`_fused_routed_experts`); with k3ref's own, the compiled pairs form runs by default
    (`k3ref.fast.latent_moe.routed_pairs_jit`: every expert's bytes read once for all its tokens, same bits on any
    thread count) and K3_FAST=numpy keeps the NumPy per-expert path.
    """
    cores = _cores(cores)
    gemv = _gemv_of(cores)
    z = as_float("z", z)
    check_shape("z", z, (None, cfg.latent_size))
    chosen = [int(e) for e in np.unique(idx) if experts is None or int(e) in experts]
    if cores.moe_experts is not engine_moe.moe_experts:
        y_lat = _fused_routed_experts(weights, z, w, idx, cfg, cores.moe_experts, chosen)
    elif gemv is mxfp4.mxfp4_gemv_prechecked and fast.enabled():
        glu = functools.partial(cores.situ_glu, beta=cfg.situ_beta, linear_beta=cfg.linear_beta)
        w_chk, idx_chk = _checked_route(z.shape[0], w, idx)
        y_lat = moe_fast.routed_pairs_jit([_expert_tensors(weights, e, cfg) for e in chosen], z, w_chk, idx_chk,
                                          chosen, glu)
    elif (z.shape[0] == 1 and gemv is mxfp4.mxfp4_gemv_prechecked
            and moe_fast.fits_one_batch(len(chosen), cfg.latent_size, cfg.moe_intermediate_size)):
        glu = functools.partial(cores.situ_glu, beta=cfg.situ_beta, linear_beta=cfg.linear_beta)
        outs = moe_fast.one_token_experts({e: _expert_tensors(weights, e, cfg) for e in chosen}, z,
                                          cfg.latent_size, cfg.moe_intermediate_size, glu)
        y_lat = mix_routed_experts(z, w, idx, lambda e, rows: outs[e], experts)
    else:
        y_lat = mix_routed_experts(z, w, idx, lambda e, rows: _run_expert(_expert_tensors(weights, e, cfg), rows,
                                                                         cfg, cores, gemv), experts)
    if not scan_jit.all_finite(y_lat):                                # name the first expert whose output is not
        for e in chosen:                                              # finite (the checks inside were hoisted)
            tok = np.nonzero(np.any(idx == e, axis=-1))[0]
            as_float(f"routed expert {e} output", routed_expert(weights, e, z[tok], cfg, cores))
    return y_lat


def latent_moe_forward(weights: Mapping, x: np.ndarray, cfg: LatentMoeConfig, cores=None,
                       experts: range | None = None, all_reduce=None) -> np.ndarray:
    """One LatentMoE layer: x [T, D] -> y [T, D] in x's dtype (float32 for bf16 x).

    y = routed_expert_up_proj RMSNorm_eps(mix_k w_k E_k(routed_expert_down_proj x)) (norm when use_norm)
        + situ_glu_vec(x, shared_experts.{gate,up,down}_proj); routing by `cores.moe_route` on gate.weight x.
    Expert parallel (one rank): `experts` are the routed experts this rank holds, so its y_lat is a partial
    sum, and `all_reduce(y_lat)` completes it before the routed norm; router and the rest are replicated.
    """
    cores = _cores(cores)
    x = as_float("x", x)
    D, E, Dl = cfg.hidden_size, cfg.num_experts, cfg.latent_size
    check_shape("x", x, (None, D))
    logits = linear(x, _tensor(weights, "gate.weight", (E, D)))
    bias = _tensor(weights, "gate.e_score_correction_bias", (E,))
    w, idx = cores.moe_route(logits, bias, cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                             renormalize=cfg.renormalize, scaling=cfg.routed_scaling_factor)
    z = linear(x, _tensor(weights, "routed_expert_down_proj.weight", (Dl, D)))
    y_lat = routed_experts(weights, z, np.asarray(w), np.asarray(idx), cfg, cores, experts)
    if all_reduce is not None:
        y_lat = all_reduce(y_lat)
    if cfg.use_norm:
        y_lat = np.asarray(cores.rmsnorm(y_lat, _tensor(weights, "routed_expert_norm.weight", (Dl,)),
                                         cfg.norm_eps)).astype(x.dtype, copy=False)
    y = linear(y_lat, _tensor(weights, "routed_expert_up_proj.weight", (D, Dl)))
    if cfg.n_shared_experts > 0:
        Is = cfg.shared_width
        y = y + situ_glu_vec(x, _tensor(weights, "shared_experts.gate_proj.weight", (Is, D)),
                             _tensor(weights, "shared_experts.up_proj.weight", (Is, D)),
                             _tensor(weights, "shared_experts.down_proj.weight", (D, Is)),
                             beta=cfg.situ_beta, linear_beta=cfg.linear_beta, cores=cores)
    return y


def random_moe_weights(cfg: LatentMoeConfig, rng: np.random.Generator, dtype=np.float64) -> dict[str, np.ndarray]:
    """A synthetic module-local weight dict for tests and goldens.

    Linear weights ~ N(0, 1/in) in `dtype` (float64, float32 or ml_dtypes.bfloat16), norm weights ~ 1 + 0.1 N,
    router bias (F32) ~ N(0, 0.1) -- nonzero and large enough to change the selection against sigmoid
    scores of spread ~0.2; routed experts quantised to MXFP4 with `quantize`.
    """
    D, E, Dl, Di, Is = (cfg.hidden_size, cfg.num_experts, cfg.latent_size, cfg.moe_intermediate_size,
                       cfg.shared_width)

    def lin(out, inp):
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(dtype)

    w = {
        "gate.weight": lin(E, D),
        "gate.e_score_correction_bias": (0.1 * rng.standard_normal(E)).astype(np.float32),
        "routed_expert_down_proj.weight": lin(Dl, D),
        "routed_expert_norm.weight": (1.0 + 0.1 * rng.standard_normal(Dl)).astype(dtype),
        "routed_expert_up_proj.weight": lin(D, Dl),
    }
    if cfg.n_shared_experts > 0:
        w["shared_experts.gate_proj.weight"] = lin(Is, D)
        w["shared_experts.up_proj.weight"] = lin(Is, D)
        w["shared_experts.down_proj.weight"] = lin(D, Is)
    for e in range(E):
        for proj, (rows, cols) in (("w1", (Di, Dl)), ("w3", (Di, Dl)), ("w2", (Dl, Di))):
            packed, scale = mxfp4.quantize(rng.standard_normal((rows, cols)) / np.sqrt(cols))
            w[f"experts.{e}.{proj}.weight_packed"] = packed
            w[f"experts.{e}.{proj}.weight_scale"] = scale
    return w
