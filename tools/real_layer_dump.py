"""A dump of one layer of a partial checkpoint (`k3conf synth DIR --config k3 --layers 1`) by k3ref's host graph, for
measuring `k3conf compare` at K3's real size:

    python tools/real_layer_dump.py --checkpoint DIR --layer 1 --out DUMP      # 16 prompt tokens + 1 decode step
    k3conf compare DUMP --checkpoint DIR

Such a checkpoint holds one layer and the globals, so the layers before it cannot run. The dump format wants the
AttnRes state a whole model has before the layer; it is stood in for by the embedding as every completed block
and 2 x the embedding as the prefix (deterministic, embedding-sized). Every tensor of the layer is then what k3ref
computes from that state, step after step with its cache, as an engine would. There is no free run (the other
layers are missing), so the report judges the added divergence only and says so.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from conformance.dumps.recompute import open_cache
from conformance.dumps.writer import DumpWriter
from k3ref.attnres import AttnResHub
from k3ref.cores import reference_cores
from k3ref.cpu_forward import ForwardContext, K3CpuModel, embed, forward_one_layer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--layer", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (then one decode step)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = ap.parse_args()
    t0, layer, dtype = time.perf_counter(), args.layer, np.dtype(args.dtype)
    model = K3CpuModel.from_checkpoint(args.checkpoint, dtype=dtype, layers=[layer])
    cfg = model.cfg
    prompt = [int(t) for t in (np.arange(args.prompt) * 7919 + 11) % cfg.vocab_size]
    steps = [("prefill", prompt, 0), ("decode", [4242 % cfg.vocab_size], len(prompt))]
    cache, seq = open_cache(model, len(prompt) + 1)
    blocks = -(-layer // cfg.attn_res_block_size)         # completed blocks before `layer`
    writer = DumpWriter(args.out, engine=f"k3ref {dtype.name} host graph, layer {layer} alone (earlier layers stood "
                                         "in for)", dtype=dtype.name, config=cfg.to_json())
    for kind, tokens, start in steps:
        e = embed(model, np.asarray(tokens)).astype(dtype)
        hub = AttnResHub(cfg.attn_res_block_size, eps=cfg.rms_norm_eps)
        hub.blocks, hub.prefix = [e] * blocks, dtype.type(2) * e
        writer.begin_step(kind, tokens, start)
        if blocks:
            writer.put(f"layers.{layer}.blocks", np.stack(hub.blocks))
        writer.put(f"layers.{layer}.prefix", hub.prefix)
        _, _, rec = forward_one_layer(ForwardContext(model, reference_cores(), seq, kind == "prefill"), layer, hub,
                                      cache)
        cache.advance(seq, len(tokens))
        for name, value in rec.items():
            writer.put(f"layers.{layer}.{name}", np.asarray(value, dtype))
        writer.end_step(None)
        print(f"{kind}: {time.perf_counter() - t0:.1f} s", flush=True)
    writer.close()
    print(f"recorded {args.out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
