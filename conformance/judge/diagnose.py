"""The shape of an output's error: one short line that says what kind of bug a failing tensor points to.

A failure line names the worst element; it does not say that the whole output is 0.354 times the reference (a
hard-coded scale), that half the elements changed sign, that only heads 3 and 7 are wrong (a layout or head
index), or that every position from 1024 on is wrong (a split or a mask). `diagnose(out, ref, axes)` looks for
those patterns, in this order, and returns the first that holds with its evidence, or None:

- non-finite values where the reference has none (or the reverse): how many, and the first in C order, which for
  a recurrence or a scan over positions is where the NaN was born;
- errors confined to some indices of one or two axes (the per-index relative error jumps by ERROR_GAP between the
  right indices and the wrong ones), with what the wrong part shows: a constant ratio, a flipped sign, or out's
  index i holding the reference's index j (a permutation);
- a flipped sign on part of the elements (every element either right or equal to minus the reference);
- a constant ratio out / ref over nearly every element (a scale).
Low-precision noise, even growing along a recurrence, has no such jump, no such ratio and no such sign pattern,
so it gets None.

The statistics run on at most MAX_SAMPLES elements (a fixed-seed sample of a larger tensor, so the line is the same
on every run); the non-finite scan and the permutation check read the full tensor, each in one vectorised pass.
`axis_names(core, tensor, ndim)` reads the axis names from the core's docstring shapes (`o [B, H, V]`);
`diagnose_tensor(out, ref, core, tensor)` is diagnose with them, for a core's output or any other tensor.
"""
from __future__ import annotations

import re

import numpy as np

from k3ref.cores import CORE_NAMES, reference_cores

MAX_SAMPLES = 1 << 21          # elements the statistics read: K3-size tensors are sampled to this
ERROR_GAP = 10.0               # wrong indices err at least this many times more (relatively) than right ones
NOISE_FLOOR = 1e-13            # relative errors below this are float64 rounding, never a pattern
ROUNDING_ULPS = 8.0            # ... and below 8 epsilons of out's dtype, that dtype's rounding
# The worst wrong index must err by at least 4 bf16 ulps (relative RMS 2^-6): below that, low-precision rounding sits
# next to exact parts (slots a step leaves untouched, fp32-kept rows) and would look confined. A confined bug smaller
# than that (an fp32 kernel off by 1e-4 on one head) gets no diagnosis; its failure line still has the numbers.
MIN_PATTERN_ERROR = 2.0 ** -6
RATIO_SPREAD = 0.01            # a "constant" ratio: within 1% of its median ...
RATIO_SHARE = 0.9              # ... on at least 90% of the elements read
SIGN_MATCH = 0.05              # out = -ref within 5% counts as a flip, out = ref within 5% as right
SIGN_SHARE = 0.95              # every element either right or flipped, up to 5% of them
SMALL_REF = 1e-2               # elements or slices under 1% of the reference's RMS carry no ratio or sign evidence
MIN_RIGHT, MIN_RIGHT_AXIS = 2, 8   # on an axis of 8 or more indices, at least 2 must be right to speak of confinement
SECOND_AXIS_SHARE = 0.5        # a second axis is named only when at most half of its indices are wrong
MAX_LISTED = 8                 # indices listed by name; more are said as a count
MAX_PERMUTED = 8               # the permutation check compares at most this many wrong slices pairwise

AXIS_NOUNS = {"H": "head", "B": "row", "S": "slot", "N": "sequence"}   # axis name -> what one index of it is
PLURAL = {"index": "indices"}
POSITION_AXES = frozenset({"T", "Tq", "Tk"})


def diagnose(out, ref, axes_names: tuple[str | None, ...] | list[str | None] | None = None) -> str | None:
    """One line naming the shape of out's error against ref with its evidence, or None when no pattern stands out.

    out, ref: arrays of one shape (floats; compared in float64). axes_names: a name per axis ("B", "H", ...; None
    for an unnamed axis), used in the line; generic "axis i" without them.
    """
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape:
        raise ValueError(f"diagnose: expected out and ref of one shape, found {list(out.shape)} and {list(ref.shape)}")
    if out.dtype.kind not in "fiub" or ref.dtype.kind not in "fiub":
        raise ValueError(f"diagnose: expected numeric arrays, found {out.dtype} and {ref.dtype}")
    if axes_names is not None and len(axes_names) != ref.ndim:
        raise ValueError(f"diagnose: expected {ref.ndim} axis names for shape {list(ref.shape)}, "
                         f"found {len(axes_names)} ({list(axes_names)})")
    if ref.size == 0:
        return None
    names = tuple(axes_names) if axes_names is not None else (None,) * ref.ndim
    nonfinite = _nonfinite(out, ref, names)
    if nonfinite:
        return nonfinite
    idx, o, r = _sample(out, ref)
    d = o - r
    scale = float(np.sqrt(np.mean(r * r)))
    if not np.any(d) or scale == 0.0:
        return None if not np.any(d) else "the reference is zero everywhere and the output is not"
    where = _confinement(out, ref, idx, o, r, names, scale)
    if where:
        return where
    return _sign(o, r, scale, "") or _ratio(o, r, scale, "")


def diagnose_tensor(out, ref, core: str, tensor: str) -> str | None:
    """diagnose(out, ref) with the axis names of output `tensor` of `core` when its docstring gives them; never
    raises: a tensor it cannot read (a shape mismatch, not an array) has no diagnosis, its comparison says why."""
    try:
        ref = np.asarray(ref)
        return diagnose(out, ref, axis_names(core, tensor, ref.ndim))
    except (ValueError, TypeError):
        return None


def axis_names(core: str, tensor: str, ndim: int) -> tuple[str | None, ...] | None:
    """The axis names of output `tensor` of `core` from the core's docstring (`o [B, H, V]`), or None.

    Where the docstring gives alternatives (`[S, H, K, V] ("kv") or [S, H, V, K] ("vk")`), an axis on which they
    differ is left unnamed; a leading `...` leaves the leading axes unnamed; a shape of another rank is not used.
    """
    if core not in CORE_NAMES:
        return None
    doc = getattr(reference_cores(), core).__doc__ or ""
    m = re.search(rf"(?<![\w.]){re.escape(tensor)}:?\s*\[", doc)
    if m is None:
        return None
    shapes = []
    rest = doc[m.end() - 1:]
    while True:
        g = re.match(r"\[([^\]]*)\](?:\s*\(\"\w+\"\))?(\s+or\s+(?=\[))?", rest)
        if g is None:
            break
        shapes.append([s.strip() for s in g[1].split(",")])
        if not g[2]:
            break
        rest = rest[g.end():]
    named = [_right_aligned(s, ndim) for s in shapes]
    named = [n for n in named if n is not None]
    if not named:
        return None
    return tuple(n[0] if all(x == n[0] for x in n) else None for n in zip(*named, strict=True))


def _right_aligned(shape: list[str], ndim: int) -> tuple[str | None, ...] | None:
    """One docstring shape as `ndim` names: `[..., D]` names only the last axes; another rank gives None."""
    if shape and shape[0] == "...":
        tail = tuple(None if s.isdigit() else s for s in shape[1:])
        return (None,) * (ndim - len(tail)) + tuple(tail) if len(tail) <= ndim else None
    return tuple(None if s.isdigit() else s for s in shape) if len(shape) == ndim else None


def _axis(a: int, names: tuple[str | None, ...]) -> str:
    return f"axis {a}: {names[a]}" if names[a] else f"axis {a}"


def _nonfinite(out: np.ndarray, ref: np.ndarray, names: tuple[str | None, ...]) -> str | None:
    """Non-finite values where the reference has other values: the count and the first (the origin)."""
    if out.dtype.kind != "f" and ref.dtype.kind != "f":
        return None
    if np.isfinite(out).all() and np.isfinite(ref).all():
        return None
    bad = np.isnan(out) != np.isnan(ref)
    bad |= (np.isposinf(out) != np.isposinf(ref)) | (np.isneginf(out) != np.isneginf(ref))
    if not bad.any():
        return None
    first = np.unravel_index(int(np.argmax(bad.reshape(-1))), ref.shape)
    found = float(out[first])
    what = ("NaN" if np.isnan(found) else "+Inf" if found == np.inf else "-Inf" if found == -np.inf
            else f"a finite value where the reference holds {float(ref[first])}")
    axes = ", ".join(n or "?" for n in names)
    at = f"[{', '.join(str(int(i)) for i in first)}]" + (f" ({axes})" if any(names) else "")
    return (f"non-finite mismatch at {int(bad.sum())} of {bad.size} elements; first {what} at {at} "
            "(the origin: first in index order)")


def _sample(out: np.ndarray, ref: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat indices, out, ref) of every element, or of a fixed-seed sample of MAX_SAMPLES when larger."""
    n = ref.size
    if n <= MAX_SAMPLES:
        idx = np.arange(n)
    else:
        idx = np.random.default_rng(0).integers(0, n, MAX_SAMPLES)   # a repeat only weighs an element twice
    return (idx, np.asarray(out.reshape(-1)[idx], np.float64), np.asarray(ref.reshape(-1)[idx], np.float64))


def _bad_indices(axis_idx: np.ndarray, n: int, d: np.ndarray, o: np.ndarray, r: np.ndarray, scale: float,
                 floor: float) -> np.ndarray | None:
    """The indices of one axis whose relative error stands ERROR_GAP above every other index's, or None.

    An index whose slice is zero in both out and ref (a padded row, zeroed on both sides) takes no part. floor: the
    relative error that is rounding in out's dtype (an exact slice next to a rounded one is no pattern)."""
    err2 = np.bincount(axis_idx, d * d, minlength=n)
    ref2 = np.bincount(axis_idx, r * r, minlength=n)
    out2 = np.bincount(axis_idx, o * o, minlength=n)
    count = np.bincount(axis_idx, minlength=n)
    live = (count > 0) & ((ref2 > 0) | (out2 > 0))
    if live.sum() < 2:
        return None
    rel = np.sqrt(err2 / np.maximum(ref2, count * (SMALL_REF * scale) ** 2))
    live_rel = np.sort(rel[live])
    # the largest jump between consecutive relative errors, rounding-level ones counted as `floor`
    ratios = live_rel[1:] / np.maximum(live_rel[:-1], floor)
    cut = int(np.argmax(ratios))
    if ratios[cut] < ERROR_GAP:
        return None
    if live_rel[-1] < MIN_PATTERN_ERROR:
        return None   # rounding next to exactness (an untouched pool slot beside an updated one): no bug's shape
    if live_rel.size >= MIN_RIGHT_AXIS and cut + 1 < MIN_RIGHT:
        return None   # one right index among many wrong ones is as likely chance as a pattern
    return np.flatnonzero(live & (rel >= live_rel[cut + 1]))


def _confinement(out: np.ndarray, ref: np.ndarray, idx: np.ndarray, o: np.ndarray, r: np.ndarray,
                 names: tuple[str | None, ...], scale: float) -> str | None:
    """'errors only on <indices> of n (axis a)' for the (at most two) axes the error is confined to, with what the
    wrong part shows; None when no axis confines it."""
    d = o - r
    multi = np.unravel_index(idx, ref.shape)
    floor = max(NOISE_FLOOR, ROUNDING_ULPS * float(np.finfo(out.dtype).eps)) if out.dtype.kind == "f" else NOISE_FLOOR
    found = []
    for a, n in enumerate(ref.shape):
        if n < 2:
            continue
        bad = _bad_indices(multi[a], n, d, o, r, scale, floor)
        if bad is not None:
            found.append((len(bad) / n, a, bad))
    if not found:
        return None
    if len(found) == ref.ndim and all(len(b) == 1 for _, _, b in found):
        at = [int(b[0]) for _, _, b in sorted(found, key=lambda f: f[1])]
        return f"errors at one element only, [{', '.join(map(str, at))}]"
    found.sort(key=lambda f: f[0])
    found = found[:1] + [f for f in found[1:2] if f[0] <= SECOND_AXIS_SHARE]
    wheres = [_where(a, bad, ref.shape[a], names) for _, a, bad in found]
    inside = np.ones(idx.shape, bool)
    for _, a, bad in found:
        inside &= np.isin(multi[a], bad)
    what = _sign(o[inside], r[inside], scale, "there ") or _ratio(o[inside], r[inside], scale, "there ")
    if what is None and len(found) == 1:
        what = _permutation(out, ref, found[0][1], found[0][2], names)
    hint = wheres[0][1]   # what the main axis's confinement means; a second axis only narrows it down
    return ("errors only " + " and ".join(w for w, _ in wheres) + (f": {hint}" if hint else "")
            + (f"; {what}" if what else ""))


def _where(a: int, bad: np.ndarray, n: int, names: tuple[str | None, ...]) -> tuple[str, str]:
    """('on heads 3, 7 of 8 (axis 2: H)', ''), ('from position 1024 on, of 2048 (axis 1: T)', 'a split / chunk
    boundary / masking'): where along axis a, and what such a place says by itself (for positions only: wrong heads
    or rows may be a layout bug or data that only they hold, a tiny norm say)."""
    name = names[a]
    first, last = int(bad[0]), int(bad[-1])
    contiguous = last - first + 1 == len(bad)
    noun, hint = AXIS_NOUNS.get(name or "", "index"), ""
    if name in POSITION_AXES:
        noun, hint = "position", "a split / chunk boundary / masking"
        if contiguous and last == n - 1 and first > 0:
            return f"from position {first} on, of {n} ({_axis(a, names)})", hint
    if len(bad) > 1:
        noun = PLURAL.get(noun, noun + "s")
    if contiguous and len(bad) > 2:
        listed = f"{first}-{last}"
    elif len(bad) <= MAX_LISTED:
        listed = ", ".join(str(int(i)) for i in bad)
    else:
        listed = ", ".join(str(int(i)) for i in bad[:MAX_LISTED]) + f", ... ({len(bad)} in all)"
    return f"on {noun} {listed} of {n} ({_axis(a, names)})", hint


def _sign(o: np.ndarray, r: np.ndarray, scale: float, prefix: str) -> str | None:
    """'sign flipped on 49% of elements' when each element (of those not tiny) is either right or -ref."""
    big = np.abs(r) > SMALL_REF * scale
    if big.sum() < 2:
        return None
    o, r = o[big], r[big]
    tol = SIGN_MATCH * np.abs(r)
    flipped = np.abs(o + r) <= tol
    right = np.abs(o - r) <= tol
    if not flipped.any() or np.mean(flipped | right) < SIGN_SHARE:
        return None
    return f"{prefix}sign flipped on {100 * np.mean(flipped):.3g}% of elements (out = -ref there)"


def _ratio(o: np.ndarray, r: np.ndarray, scale: float, prefix: str) -> str | None:
    """'constant ratio out/ref = 0.354 (+-0.2%) over 98% of elements: a scale' when the ratio is one number."""
    big = np.abs(r) > SMALL_REF * scale
    if big.sum() < 2:
        return None
    ratio = o[big] / r[big]
    m = float(np.median(ratio))
    if m == 0.0 or abs(m - 1.0) <= RATIO_SPREAD:
        return None
    dev = np.abs(ratio / m - 1.0)
    share = float(np.mean(dev <= RATIO_SPREAD))
    if share < RATIO_SHARE:
        return None
    spread = 100 * float(np.quantile(dev, RATIO_SHARE))
    return (f"{prefix}constant ratio out/ref = {m:.4g} (+-{spread:.1f}%) over {100 * share:.3g}% of elements: "
            "a scale")


def _permutation(out: np.ndarray, ref: np.ndarray, a: int, bad: np.ndarray,
                 names: tuple[str | None, ...]) -> str | None:
    """'out index 3 = ref index 7, ...' when each wrong slice of axis a holds another wrong slice of the reference
    (a swapped or shifted index); None otherwise."""
    if not 2 <= len(bad) <= MAX_PERMUTED:
        return None
    outs = [np.asarray(np.take(out, int(i), axis=a), np.float64) for i in bad]
    refs = [np.asarray(np.take(ref, int(i), axis=a), np.float64) for i in bad]
    held = []
    for k, o in enumerate(outs):
        errs = [float(np.linalg.norm(o - r)) / max(float(np.linalg.norm(r)), np.finfo(np.float64).tiny) for r in refs]
        j = int(np.argmin(errs))
        if j == k or errs[j] * ERROR_GAP > errs[k]:
            return None
        held.append(f"out {int(bad[k])} = ref {int(bad[j])}")
    noun = AXIS_NOUNS.get(names[a] or "", "index")
    return f"{PLURAL.get(noun, noun + 's')} permuted: {', '.join(held)}: a layout / index mix-up"
