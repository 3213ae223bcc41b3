"""`k3conf decode`: greedy decode on the CPU reference (synthetic weights or a checkpoint)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from conformance.cli.admit import load_config
from conformance.cli.run import add_tp_options
from conformance.cli.usage import UsageError
from conformance.tp.cli import decode_tp_command
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import NonFiniteLogits, greedy_decode, non_finite_weight
from k3ref.weights import CheckpointError, admit_checkpoint, inventory_totals, num_parameters


def register(sub) -> None:
    p = sub.add_parser("decode", help="greedy decode with the NumPy reference model")
    p.add_argument("--config", default=None,
                   help="preset name (tiny, k3geom, small, k3) or a config.json path; default: the checkpoint's "
                        "config.json with --checkpoint, else tiny")
    p.add_argument("--checkpoint", help="checkpoint directory (default: synthetic weights)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=int, default=8, help="tokens to generate")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    add_tp_options(p)
    p.set_defaults(func=run)


SEED_LIMIT = 2**63        # seeds are 64-bit in every generator the weights come from
# The share of this machine's memory a decode may plan to hold (cache, kept logits, synthetic weights).
MEMORY_SHARE = 0.5


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def machine_memory() -> int:
    """Physical memory in bytes (0 when the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def decode_bytes(cfg, prompt_len: int, max_new: int, itemsize: int, synthetic: bool) -> dict[str, int]:
    """What a greedy decode holds, by part, worked out before allocating any of it.

    The MLA cache is allocated whole for prompt + max_new tokens (pages of 64, one spare); the logits of
    every step are kept ([max_new, vocab], twice while stacked); synthetic weights are materialised.
    """
    tokens = prompt_len + max_new
    pages = -(-tokens // 64) + 1
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    out = {
        "MLA cache": len(cfg.mla_layers) * pages * 64 * width * itemsize,
        "logits": 2 * max_new * cfg.vocab_size * itemsize,
    }
    if synthetic:
        out["synthetic weights"] = inventory_totals(cfg).parameters * itemsize
    return out


def _check_request(args, cfg, prompt: list[int], synthetic: bool, itemsize: int) -> None:
    """Token ids, --max-new and --seed in range, and the memory the decode would take, before any work."""
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"--prompt: token id(s) {bad[:5]} out of range: the vocabulary is 0..{cfg.vocab_size - 1}")
    if args.max_new < 0:
        raise UsageError(f"--max-new: expected an int >= 0, found {args.max_new}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UsageError(f"--seed: expected an int in [0, 2^63), found {args.seed}")
    parts = decode_bytes(cfg, len(prompt), args.max_new, itemsize, synthetic)
    total, have = sum(parts.values()), machine_memory()
    if have and total > MEMORY_SHARE * have:
        detail = ", ".join(f"{k} {_gib(v)}" for k, v in parts.items())
        raise UsageError(f"--max-new {args.max_new} with a {len(prompt)}-token prompt on this config would hold "
                         f"about {_gib(total)} ({detail}); this machine has {_gib(have)} and a decode may use "
                         f"{MEMORY_SHARE:.0%} of it: ask for fewer tokens or a smaller config")


def run(args) -> int:
    try:
        prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--prompt: expected comma-separated integers, found {args.prompt!r:.200}") from None
    if not prompt:
        raise UsageError("--prompt: expected at least one token id, e.g. --prompt 1,2,3")
    checkpoint = Path(args.checkpoint) if args.checkpoint else None
    cfg = load_config(args.config if args.config or checkpoint else "tiny", checkpoint)
    if num_parameters(cfg) > 2e9 and not args.checkpoint:
        raise UsageError(f"--config {args.config}: {num_parameters(cfg) / 1e9:,.0f}B parameters is too large to "
                         "synthesise on the CPU; use tiny or small, or give --checkpoint")
    if args.tp != 1:
        return decode_tp_command(args, cfg, prompt)
    dtype = np.dtype(args.dtype)
    _check_request(args, cfg, prompt, checkpoint is None, dtype.itemsize)
    if checkpoint is not None:   # every name, shape and dtype checked before anything is computed
        try:
            verdict = admit_checkpoint(checkpoint, cfg)
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if not verdict.ok:
            raise UsageError(f"--checkpoint {checkpoint} does not hold this config's weights as stored:\n"
                             f"{verdict.summary(limit=5)}\n(`k3conf admit {checkpoint}` lists every problem)")
    try:
        model = (K3CpuModel.from_checkpoint(args.checkpoint, cfg, dtype) if args.checkpoint
                 else K3CpuModel.synthetic(cfg, args.seed, dtype))
        tokens = _decode(model, prompt, args.max_new)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except KeyError as e:  # a tensor the config needs is not in the checkpoint (k3conf admit lists them all)
        raise UsageError(f"{e.args[0]}; run `k3conf admit {args.checkpoint}`") from None
    except _NonFinite as e:
        print(f"k3conf decode: {e}", file=sys.stderr)
        return 1
    print(",".join(map(str, tokens)))
    return 0


class _NonFinite(Exception):
    """The decode met a NaN / Inf (in the logits, or a weight the forward checks): a failure, exit 1."""


def _decode(model: K3CpuModel, prompt: list[int], max_new: int) -> list[int]:
    """The greedy tokens; _NonFinite naming the checkpoint tensor (layer, expert) behind a non-finite value.

    The forward's own finite checks name a weight by its local name (`o_proj.weight`); the scan of the
    model's weights names it as the checkpoint does, which is what a kernel engineer can look up.
    """
    try:
        with Progress(console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
            task = bar.add_task("decoding", total=max_new)
            return greedy_decode(model, prompt, max_new, on_token=lambda _t: bar.advance(task)).tokens
    except ValueError as e:
        source = non_finite_weight(model)
        if source is not None:
            raise _NonFinite(f"{e}; {source}") from None
        if isinstance(e, NonFiniteLogits):   # finite weights, non-finite logits: no token can be chosen
            raise _NonFinite(f"{e}; every weight is finite: the forward itself overflowed") from None
        raise
