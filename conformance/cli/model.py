"""`k3conf model info --config k3 --tp 8`: parameters and per-rank memory of a K3 config.

Prints total and active parameters, the weight bytes one rank holds by group (attention, mlp, experts,
embeddings, norms), per rank, and per layer (rank 0, the largest; the last rank where it differs), the
binding-memory plan (the F32 tensors that get BF16 device copies when bound to the kernels, and their bytes per
rank: docs/spec.md, "Binding memory"), MLA cache bytes per token and KDA state bytes per sequence
(k3ref.tp.TpPlan).
"""
from __future__ import annotations

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
    info.set_defaults(func=run_info)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def _gib(n: int) -> str:
    return f"{n / 2**30:10.3f} GiB"


# The per-rank plan lists every tensor (K3: 497,052); a config asking for far more is summed, not planned.
MAX_PLANNED_TENSORS = 5_000_000


def run_info(args) -> int:
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
        return 0
    try:
        plan = TpPlan(cfg, args.tp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    print("weight bytes per rank:")
    per = plan.weight_bytes_per_rank()
    for group in (*GROUPS, "total"):
        print(f"  {group:<11} {per[group]:>18,} B {_gib(per[group])}")
    if args.tp > 1:
        print("per rank (bytes held; `replicated` is the part every rank holds):")
        for r in range(args.tp):
            b = plan.rank_bytes(r)
            print(f"  rank {r:<3} total {b['total']:>18,} B  replicated {b['replicated']:>18,} B  "
                  f"experts {b['experts']:>18,} B  embeddings {b['embeddings']:>14,} B")
    _print_layers(plan)
    _print_binding(plan)
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


def _print_binding(plan: TpPlan) -> None:
    """The binding-memory plan: the BF16 device copies of the F32 tensors the kernels read in bf16, per rank."""
    print(f"binding memory (BF16 device copies of the F32 {', '.join(BINDING_BF16_COPIES)} of every KDA layer; "
          "every other tensor is bound as stored):")
    for r in range(plan.tp):
        b = plan.binding_bytes(r)
        print(f"  rank {r:<3} " + "  ".join(f"{t} {b[t]:,} B" for t in BINDING_BF16_COPIES)
              + f"  total {b['total']:,} B {_gib(b['total']).strip()}")
