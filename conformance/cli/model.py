"""`k3conf model info --config k3 --tp 8`: parameters and per-rank memory of a K3 config.

Prints total and active parameters, the weight bytes one rank holds by group (attention, mlp, experts,
embeddings, norms), per rank, and per layer (rank 0, the largest; the last rank where it differs), the
binding-memory plan (the F32 tensors that get BF16 device copies when bound to the kernels, and their bytes per
rank: docs/spec.md, "Binding memory"), MLA cache bytes per token and KDA state bytes per sequence
(k3ref.tp.TpPlan).

With `--device-memory GIB` each rank's device bytes (its weights plus its binding copies) are compared with a
device of that size: fits with how much to spare, or does not fit by how much. The MLA cache and the KDA state
come on top (per token and per sequence, printed last): a rank that only just fits has no room for them.
"""
from __future__ import annotations

import math

from conformance.cli.admit import load_config
from conformance.cli.usage import UsageError
from k3ref.tp import BINDING_BF16_COPIES, GLOBAL, GROUPS, TpPlan
from k3ref.weights import active_parameters, inventory_totals, num_parameters


def register(sub) -> None:
    p = sub.add_parser("model", help="model geometry: parameters and per-rank memory")
    msub = p.add_subparsers(dest="model_command", metavar="ACTION")
    info = msub.add_parser("info", help="parameters, per-rank weight bytes, KV and KDA state bytes")
    info.add_argument("--config", default="k3", help="preset name (k3, small, tiny, k3geom) or config.json path")
    info.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (must divide the head counts)")
    info.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                      help="memory of one device in GiB (e.g. 141): say whether each rank's weights and binding "
                           "copies fit, and by how much")
    info.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


# The per-rank plan lists every tensor (K3: 497,052); a config asking for far more is summed, not planned.
MAX_PLANNED_TENSORS = 5_000_000


def run_info(args) -> int:
    if args.device_memory is not None and not (math.isfinite(args.device_memory) and args.device_memory > 0):
        raise UsageError(f"--device-memory: expected a size in GiB > 0 (e.g. 141), found {args.device_memory}")
    cfg = load_config(args.config)
    try:
        cfg.validate_tp(args.tp)
    except ValueError as e:
        raise UsageError(f"--tp {args.tp}: {e}") from None
    totals = inventory_totals(cfg)
    n_mla = len(cfg.mla_layers)
    print(f"config {args.config}: {cfg.num_hidden_layers} layers ({cfg.num_hidden_layers - n_mla} KDA, "
          f"{n_mla} MLA), hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, tp {args.tp}")
    print(f"parameters: total {num_parameters(cfg):,}  active per token {active_parameters(cfg):,}")
    print(f"checkpoint: {totals.tensors:,} tensors, {totals.nbytes:,} B {_gib(totals.nbytes)}")
    if totals.tensors > MAX_PLANNED_TENSORS:
        print(f"weight bytes per rank: not planned: {totals.tensors:,} tensors is more than the "
              f"{MAX_PLANNED_TENSORS:,} a per-rank plan lists; the totals above are exact")
        if args.device_memory is not None:
            print(f"device memory {args.device_memory:g} GiB: not compared (no per-rank plan)")
        return 0
    try:
        plan = TpPlan(cfg, args.tp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    held = [plan.rank_bytes(r) for r in range(args.tp)]        # each a pass over every tensor: once per rank
    binding = [plan.binding_bytes(r) for r in range(args.tp)]
    print("weight bytes per rank:")
    for group in (*GROUPS, "total"):   # rank 0 holds the most
        print(f"  {group:<11} {held[0][group]:>18,} B {_gib(held[0][group])}")
    if args.tp > 1:
        print("per rank (bytes held; `replicated` is the part every rank holds):")
        for r, b in enumerate(held):
            print(f"  rank {r:<3} total {b['total']:>18,} B  replicated {b['replicated']:>18,} B  "
                  f"experts {b['experts']:>18,} B  embeddings {b['embeddings']:>14,} B")
    _print_layers(plan)
    _print_binding(binding)
    if args.device_memory is not None:
        _print_fit([h["total"] + b["total"] for h, b in zip(held, binding, strict=True)], args.device_memory)
    print(f"MLA cache per token (bf16, all {len(cfg.mla_layers)} MLA layers): {plan.kv_bytes_per_token():,} B")
    print(f"KDA state per sequence (fp32, all {len(cfg.kda_layers)} KDA layers): "
          f"{plan.kda_state_bytes_per_sequence():,} B")
    return 0


def _layer_kind(cfg, layer: int | str) -> str:
    if layer == GLOBAL:
        return "embedding, final norm, lm_head"
    i = int(layer)
    return f"{'MLA' if cfg.is_mla(i) else 'KDA'} + {'dense MLP' if cfg.mlp_is_dense(i) else 'LatentMoE'}"


def _print_layers(plan: TpPlan) -> None:
    """Bytes per layer on rank 0 (the largest), by group; the last rank's total where it holds less."""
    first, last = plan.layer_bytes(0), plan.layer_bytes(plan.tp - 1)
    print(f"weight bytes per layer, rank 0{f' (rank {plan.tp - 1} where it differs)' if plan.tp > 1 else ''}:")
    print(f"  {'layer':<8} {'kind':<31} " + " ".join(f"{g:>15}" for g in (*GROUPS, "total")))
    for layer in sorted(first, key=lambda k: (k == GLOBAL, k if isinstance(k, int) else -1)):
        row = first[layer]
        other = last.get(layer, {}).get("total", 0)
        tail = f"  rank {plan.tp - 1}: {other:,}" if plan.tp > 1 and other != row["total"] else ""
        print(f"  {layer!s:<8} {_layer_kind(plan.cfg, layer):<31} "
              + " ".join(f"{row[g]:>15,}" for g in (*GROUPS, "total")) + tail)


def _bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**30:.3f} GiB)"


def _print_fit(needs: list[int], device_gib: float) -> None:
    """Each rank's device bytes (needs[rank]: its weights + binding copies) against a device of `device_gib`
    GiB: fits (with what is left) or not (by how much), then one line for all ranks."""
    capacity = round(device_gib * 2**30)
    print(f"device memory {device_gib:g} GiB ({capacity:,} B) per rank, against each rank's weights + binding "
          "copies (the MLA cache and KDA state below come on top):")
    for r, need in enumerate(needs):
        spare = capacity - need
        verdict = f"fits, {_bytes(spare)} spare" if spare >= 0 else f"does NOT fit: {_bytes(-spare)} over"
        print(f"  rank {r:<3} needs {need:>18,} B {_gib(need)}: {verdict}")
    over = [r for r, need in enumerate(needs) if need > capacity]
    if not over:
        print(f"  every rank fits a {device_gib:g} GiB device")
        return
    worst = max(over, key=lambda r: needs[r])   # the first of the largest
    print(f"  {len(over)} of {len(needs)} rank(s) do not fit a {device_gib:g} GiB device (worst: rank {worst}, "
          f"{_bytes(needs[worst] - capacity)} over): more ranks (--tp) or a larger device")


def _print_binding(binding: list[dict[str, int]]) -> None:
    """The binding-memory plan: the BF16 device copies of the F32 tensors the kernels read in bf16, per rank."""
    print(f"binding memory (BF16 device copies of the F32 {', '.join(BINDING_BF16_COPIES)} of every KDA layer; "
          "every other tensor is bound as stored):")
    for r, b in enumerate(binding):
        print(f"  rank {r:<3} " + "  ".join(f"{t} {b[t]:,} B" for t in BINDING_BF16_COPIES)
              + f"  total {b['total']:,} B {_gib(b['total']).strip()}")
