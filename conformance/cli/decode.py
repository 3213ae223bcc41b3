"""`k3conf decode`: greedy decode on the CPU reference (synthetic weights or a checkpoint, or some of its layers).

The memory the decode will hold is counted first (k3ref.greedy.decode_memory) and a request that does not fit
what the machine has available is refused, naming the numbers; a real-size checkpoint runs with its embedding
gathered by rows, lm_head applied in blocks and its float weights converted one tensor at a time.

Output: the prompt's ids, one line per generated token (its step and position) and the generated ids, each
labelled; `--ids-only` prints the generated ids alone, comma-separated on one line, for scripts."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from conformance.cli.admit import load_config, parse_layers
from conformance.cli.run import add_tp_options
from conformance.cli.usage import UsageError
from conformance.tp.cli import decode_tp_command
from k3ref.cpu_forward import K3CpuModel
from k3ref.greedy import NonFiniteLogits, NotEnoughMemory, decode_memory, greedy_decode, non_finite_weight
from k3ref.weights import CheckpointError, CheckpointReader, admit_checkpoint, missing_layers, num_parameters


def register(sub) -> None:
    p = sub.add_parser("decode", help="greedy decode with the NumPy reference model")
    p.add_argument("--config", default=None,
                   help="preset name (tiny, k3geom, small, k3) or a config.json path; default: the checkpoint's "
                        "config.json with --checkpoint, else tiny")
    p.add_argument("--checkpoint", help="checkpoint directory (default: synthetic weights)")
    p.add_argument("--layers", default=None,
                   help="with --checkpoint: run only these 0-indexed layers (e.g. 1,3: a checkpoint written by "
                        "`k3conf synth --layers 1,3`); default: every layer")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights")
    p.add_argument("--prompt", required=True, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=int, default=8, help="tokens to generate")
    p.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    p.add_argument("--ids-only", action="store_true",
                   help="print only the generated token ids, comma-separated on one line (for scripts)")
    add_tp_options(p)
    p.set_defaults(func=run)


SEED_LIMIT = 2**63        # seeds are 64-bit in every generator the weights come from


def _check_request(args, cfg, prompt: list[int], synthetic: bool, dtype, layers) -> None:
    """Token ids, --max-new and --seed in range, and the memory the decode would take
    (k3ref.greedy.decode_memory against what the machine has available), before any work."""
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UsageError(f"--prompt: token id(s) {bad[:5]} out of range: the vocabulary is 0..{cfg.vocab_size - 1}")
    if args.max_new < 0:
        raise UsageError(f"--max-new: expected an int >= 0, found {args.max_new}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise UsageError(f"--seed: expected an int in [0, 2^63), found {args.seed}")
    estimate = decode_memory(cfg, prompt_len=len(prompt), max_new=args.max_new, dtype=dtype, layers=layers,
                             synthetic=synthetic)
    try:
        estimate.check(what=f"--max-new {args.max_new} with a {len(prompt)}-token prompt in {np.dtype(dtype).name}")
    except NotEnoughMemory as e:
        raise UsageError(f"{e}: ask for fewer tokens, float32, fewer --layers or a smaller config") from None


def _admit(checkpoint: Path, cfg, layers) -> None:
    """Every name, shape and dtype of the layers asked for, checked before anything is computed; a checkpoint
    that lacks whole layers is told which it holds (what --layers can run)."""
    try:
        verdict = admit_checkpoint(checkpoint, cfg, layers=layers)
        if verdict.ok:
            return
        gone = missing_layers(cfg, CheckpointReader(checkpoint).entries, layers)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    if gone is not None:
        raise UsageError(f"--checkpoint {checkpoint}: {gone}")
    raise UsageError(f"--checkpoint {checkpoint} does not hold this config's weights as stored:\n"
                     f"{verdict.summary(limit=5)}\n(`k3conf admit {checkpoint}` lists every problem)")


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
    if args.layers is not None and checkpoint is None:
        raise UsageError("--layers: runs some layers of a checkpoint; give --checkpoint (synthetic weights are "
                         "the whole model)")
    layers = parse_layers(args.layers, cfg)
    if args.tp != 1:
        if layers is not None:
            raise UsageError("--layers: not with --tp (a tensor-parallel decode runs every layer)")
        return decode_tp_command(args, cfg, prompt, show=lambda tokens: show_tokens(prompt, tokens, args.ids_only))
    dtype = np.dtype(args.dtype)
    _check_request(args, cfg, prompt, checkpoint is None, dtype, layers)
    if checkpoint is not None:
        _admit(checkpoint, cfg, layers)
    try:
        model = (K3CpuModel.from_checkpoint(args.checkpoint, cfg, dtype, layers=layers) if args.checkpoint
                 else K3CpuModel.synthetic(cfg, args.seed, dtype))
        tokens = _decode(model, prompt, args.max_new)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except KeyError as e:  # a tensor the config needs is not in the checkpoint (k3conf admit lists them all)
        raise UsageError(f"{e.args[0]}; run `k3conf admit {args.checkpoint}`") from None
    except _NonFinite as e:
        print(f"k3conf decode: {e}", file=sys.stderr)
        return 1
    show_tokens(prompt, tokens, args.ids_only)
    return 0


def show_tokens(prompt: list[int], tokens: list[int], ids_only: bool) -> None:
    """The decode's result on stdout: labelled lines, or (ids_only) the generated ids alone on one line."""
    ids = ",".join(map(str, tokens))
    if ids_only:
        print(ids)
        return
    print(f"prompt ids ({len(prompt)}): {','.join(map(str, prompt))}")
    for step, token in enumerate(tokens, start=1):
        print(f"step {step} (position {len(prompt) + step - 1}): token id {token}")
    print(f"generated ids ({len(tokens)}): {ids}")


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
