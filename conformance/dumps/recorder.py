"""Record a dump from a PyTorch K3 model with forward hooks only (docs/dumps.md, "The hook an engine adds").

`TorchDumpHooks` attaches to the modules by their checkpoint names (matched by suffix, so any HF-style model
with the checkpoint's module names works): `layers.<i>` (its first argument is the AttnRes state before the
layer: blocks and prefix), `layers.<i>.input_layernorm` (input h), `layers.<i>.self_attn` (input x_mixer,
output a), `layers.<i>.self_attn.o_norm` (input: the KDA core output), `layers.<i>.post_attention_layernorm`
(input m), `layers.<i>.mlp` / `layers.<i>.block_sparse_moe` (input x_mlp, output f), `...block_sparse_moe.gate`
(output: expert ids and weights), `...block_sparse_moe.experts.<e>` (each routed expert: its input rows and
output rows, placed by the router's ids into experts.in [T, Dl] and experts.out [T, k, Dl]), `lm_head` (input)
or else `model.norm` (output) for final.hidden, and the model's own output for the logits. `record_torch`
runs greedy decoding with the hooks on and writes the dump.

torch is imported where it is used: this module loads without it.
"""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .names import DEFAULT_SPLITS, INT_KEYS, Split, key_of
from .writer import DumpWriter, to_numpy

_SUFFIX = re.compile(r"(?:^|\.)layers\.(\d+)(|\.self_attn|\.self_attn\.o_norm|\.input_layernorm|"
                     r"\.post_attention_layernorm|\.mlp|\.block_sparse_moe|\.block_sparse_moe\.gate)$")
_EXPERT = re.compile(r"(?:^|\.)layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)$")
_FINAL_NORM = re.compile(r"(?:^|\.)model\.norm$")
_LM_HEAD = re.compile(r"(?:^|\.)lm_head$")
# The rank of each recorded key without the batch dim (hooks see [B, ...] with B = 1, routers [B*T, k]).
_NDIM = {"kda.core_out": 3, "mla.attn_out": 3, "experts.out": 3}
_TORCH_DTYPES = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32",
                 "torch.float64": "float64"}
DEFAULT_ENGINE = "k3torch K3ForCausalLM (forward hooks)"


def _first(args: tuple, kwargs: dict, *names: str) -> Any:
    if args:
        return args[0]
    for n in names:
        if n in kwargs:
            return kwargs[n]
    raise ValueError(f"hook: expected the module's input as its first argument or one of {names}, found none")


def _out(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


class TorchDumpHooks:
    """Forward hooks that collect one step's dump tensors from a model (batch 1); `take()` hands them over.

        hooks = TorchDumpHooks(model)
        logits = model(ids, cache)          # the engine's own forward, unchanged
        tensors = hooks.take()              # {"layers.0.prefix": tensor [T, D], ..., "logits": [1, V]}
        hooks.remove()

    logits: "last" keeps the last position's logits ([1, V]), "all" every position ([T, V]). experts=False
    leaves out experts.in / experts.out (a model whose experts are not called on their routed tokens)."""

    def __init__(self, model: Any, *, logits: str = "last", experts: bool = True):
        if logits not in ("last", "all"):
            raise ValueError(f"logits: expected 'last' or 'all', found {logits!r}")
        self.logits = logits
        self.tensors: dict[str, Any] = {}
        self.handles: list[Any] = []
        self.experts: dict[int, _ExpertSlots] = {}
        self.dtype = _float_dtype(model)
        layers = 0
        for name, module in model.named_modules():
            m, e = _SUFFIX.search(name), _EXPERT.search(name)
            if e and experts:
                self.handles.append(module.register_forward_hook(self._expert(int(e.group(1)), int(e.group(2)))))
            elif m:
                layers += m.group(2) == ""
                self._attach(module, int(m.group(1)), m.group(2).lstrip("."))
            elif _FINAL_NORM.search(name):
                self.handles.append(module.register_forward_hook(self._final_norm))
            elif _LM_HEAD.search(name):
                self.handles.append(module.register_forward_pre_hook(self._lm_head, with_kwargs=True))
        if not layers:
            raise ValueError("TorchDumpHooks: expected modules named like '...layers.<i>' (the checkpoint's names), "
                             "found none")
        self.handles.append(model.register_forward_hook(self._model_out))

    def _attach(self, module: Any, layer: int, part: str) -> None:
        p = f"layers.{layer}."

        def pre(key: str, first_only: bool = False) -> Callable:
            def hook(_m: Any, args: tuple, kwargs: dict) -> None:
                if not (first_only and p + key in self.tensors):
                    self._put(p + key, _first(args, kwargs, "hidden_states", "x"))
            return hook

        def post(key: str) -> Callable:
            def hook(_m: Any, _args: tuple, output: Any) -> None:
                self._put(p + key, _out(output))
            return hook

        def add(pre_key: str | None, post_key: str | None, first_only: bool = False) -> None:
            if pre_key:
                self.handles.append(module.register_forward_pre_hook(pre(pre_key, first_only), with_kwargs=True))
            if post_key:
                self.handles.append(module.register_forward_hook(post(post_key)))

        if part == "":
            self.handles.append(module.register_forward_pre_hook(self._layer_state(p), with_kwargs=True))
        elif part == "self_attn":
            add("x_mixer", "a")
        elif part == "self_attn.o_norm":
            add("kda.core_out", None)
        elif part == "input_layernorm":      # first call: a model may reuse this norm later in the layer
            add("h", None, first_only=True)
        elif part == "post_attention_layernorm":
            add("m", None)
        elif part in ("mlp", "block_sparse_moe"):
            add("x_mlp", "f")
        else:
            self.handles.append(module.register_forward_hook(self._router(p)))

    def _layer_state(self, p: str) -> Callable:
        def hook(_m: Any, args: tuple, kwargs: dict) -> None:
            state = _first(args, kwargs, "state", "hidden_states")
            if hasattr(state, "prefix"):             # an AttnRes state: completed blocks + running prefix
                import torch  # noqa: PLC0415 -- optional dependency; a hook only runs inside a torch model

                if state.blocks:
                    self.tensors[p + "blocks"] = torch.stack([self._host(b, 2) for b in state.blocks])
                self._put(p + "prefix", state.prefix)
            else:
                self._put(p + "prefix", state)
        return hook

    def _router(self, p: str) -> Callable:
        def hook(_m: Any, _args: tuple, output: Any) -> None:
            for t in output:                         # (weights, ids) in k3torch; (ids, weights) in some others
                self._put(p + ("router.ids" if not t.is_floating_point() else "router.weights"), t)
        return hook

    def _expert(self, layer: int, expert: int) -> Callable:
        def hook(_m: Any, args: tuple, output: Any) -> None:
            ids = self.tensors.get(f"layers.{layer}.router.ids")
            if ids is None:
                raise ValueError(f"TorchDumpHooks: layer {layer} expert {expert} ran before its router: expected the "
                                 f"gate's expert ids first, found none")
            slots = self.experts.setdefault(layer, _ExpertSlots(ids))
            slots.put(layer, expert, _first(args, {}, "x").detach().to("cpu"), _out(output).detach().to("cpu"),
                      self.dtype)
        return hook

    def _final_norm(self, _m: Any, _args: tuple, output: Any) -> None:
        self.tensors.setdefault("final.hidden", self._host(_out(output), 2))

    def _lm_head(self, _m: Any, args: tuple, kwargs: dict) -> None:
        self.tensors["final.hidden"] = self._host(_first(args, kwargs, "input"), 2)

    def _model_out(self, _m: Any, _args: tuple, output: Any) -> None:
        logits = output.logits if hasattr(output, "logits") else _out(output)
        logits = self._host(logits, 2)
        self.tensors["logits"] = logits[-1:] if self.logits == "last" else logits

    def _put(self, name: str, t: Any) -> None:
        self.tensors[name] = self._host(t, _NDIM.get(key_of(name), 2))

    @staticmethod
    def _host(t: Any, ndim: int) -> Any:
        """A CPU copy of `t` without the batch dim (batch 1 only)."""
        t = t.detach().to("cpu", copy=True)
        if t.dim() == ndim + 1:
            if t.shape[0] != 1:
                raise ValueError(f"TorchDumpHooks: expected batch 1, found a tensor of shape {list(t.shape)}")
            t = t[0]
        return t

    def take(self) -> dict[str, Any]:
        """The tensors collected since the last take (and forget them)."""
        for layer, slots in sorted(self.experts.items()):
            self.tensors[f"layers.{layer}.experts.in"], self.tensors[f"layers.{layer}.experts.out"] = slots.done(layer)
        out, self.tensors, self.experts = self.tensors, {}, {}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def __enter__(self) -> TorchDumpHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class _ExpertSlots:
    """One layer's routed-expert rows of one step, placed by the router's ids [T, k]: an expert called on the
    tokens routed to it, in token order (k3torch, HF MoE blocks), fills its slots of experts.in / experts.out.

    The input is kept in the model's dtype: it is what the expert's matrices take (k3torch rounds a matmul's
    input to the bf16 weights' dtype; a bf16 engine holds it in bf16 anyway), so the compare recomputes the
    expert from the exact values the engine's expert computed with."""

    def __init__(self, ids: Any):
        self.ids = ids
        self.z: Any = None
        self.out: Any = None
        self.seen: Any = None

    def put(self, layer: int, expert: int, z: Any, out: Any, dtype: Any) -> None:
        import torch  # noqa: PLC0415 -- optional dependency; a hook only runs inside a torch model

        rows, slot = torch.nonzero(self.ids == expert, as_tuple=True)
        if z.shape[0] != rows.shape[0] or out.shape[0] != rows.shape[0]:
            raise ValueError(f"TorchDumpHooks: layer {layer} expert {expert}: expected its {rows.shape[0]} routed "
                             f"tokens (router ids), found input {list(z.shape)} and output {list(out.shape)} "
                             f"(experts=False records without experts.in / experts.out)")
        if self.z is None:
            T, k = self.ids.shape
            self.z = torch.zeros(T, z.shape[-1], dtype=dtype)
            self.out = torch.zeros(T, k, out.shape[-1], dtype=out.dtype)
            self.seen = torch.zeros(T, k, dtype=torch.bool)
        self.z[rows] = z.to(dtype)
        self.out[rows, slot] = out
        self.seen[rows, slot] = True

    def done(self, layer: int) -> tuple[Any, Any]:
        if not bool(self.seen.all()):
            missing = [int(i) for i in self.ids[~self.seen][:8]]
            raise ValueError(f"TorchDumpHooks: layer {layer}: expected every routed expert slot's output, found "
                             f"{int((~self.seen).sum())} slots without one (experts {missing})")
        return self.z, self.out


def _float_dtype(model: Any) -> Any:
    dtype = getattr(model, "dtype", None)
    return dtype if dtype is not None else next(p.dtype for p in model.parameters() if p.is_floating_point())


def _dtype_name(model: Any) -> str:
    dtype = _float_dtype(model)
    if str(dtype) not in _TORCH_DTYPES:
        raise ValueError(f"model dtype: expected one of {sorted(_TORCH_DTYPES)}, found {dtype}")
    return _TORCH_DTYPES[str(dtype)]


def rank_parts(name: str, tensor: Any, tp_size: int, splits: dict[str, Split] = DEFAULT_SPLITS) -> list[np.ndarray]:
    """What each of `tp_size` ranks holds of a merged tensor under `splits`: the whole tensor for replicated
    keys; for concat keys contiguous chunks of ceil(n / tp_size) along the axis, the last rank holding fewer
    (k3ref.tp.TpPlan's split of heads and vocab rows)."""
    a = to_numpy(tensor)
    split = splits.get(key_of(name), Split("replicated"))
    if tp_size == 1 or split.how == "replicated":
        return [a] * tp_size
    if split.how == "concat":
        chunk = -(-a.shape[split.axis] // tp_size)
        return np.split(a, [chunk * r for r in range(1, tp_size)], axis=split.axis)
    raise ValueError(f"rank_parts {name}: cannot split a merged tensor into partial sums")


def _forward(model: Any, ids: Any, cache: Any) -> tuple[Any, Any]:
    """(logits [1, T, V], cache) from a K3ForCausalLM (model(ids, cache)) or an HF-style causal LM."""
    if hasattr(model, "new_cache"):
        return model(ids, cache), cache
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


def record_torch(model: Any, prompt_ids: Any, max_new: int, path: str | os.PathLike, *,
                 engine: str = DEFAULT_ENGINE, tp_size: int = 1, config: dict | None = None,
                 logits: str = "last", overwrite: bool = False, experts: bool = True) -> Path:
    """Greedy-decode `prompt_ids` (prefill, then `max_new` decode steps) with `model` (batch 1) under
    TorchDumpHooks and write the dump at `path`; returns `path`.

    Tensors are stored in the dtype the model holds them (a k3torch bf16 model keeps activations in float32
    with bf16 weights: the manifest says bfloat16 and lists those keys in fp32). config: the checkpoint's
    config.json dict (default: the model's config dataclass). tp_size > 1 writes what each rank of a TP engine
    would hold (replicated tensors on every rank, head- and vocab-split ones sliced per the default splits),
    from this one model's tensors: a simulation of a TP engine's dump, not a TP run. experts: record
    experts.in / experts.out (see TorchDumpHooks)."""
    import torch  # noqa: PLC0415 -- optional dependency: only this recorder needs torch

    cfg = config if config is not None else dataclasses.asdict(model.config)
    dtype = _dtype_name(model)
    ids = torch.as_tensor(np.asarray(to_numpy(prompt_ids)).reshape(1, -1), dtype=torch.int64,
                          device=next(model.parameters()).device)
    writers: list[DumpWriter] = []
    cache = model.new_cache(1) if hasattr(model, "new_cache") else None
    start = 0
    with TorchDumpHooks(model, logits=logits, experts=experts) as hooks, torch.no_grad():
        for step in range(max_new + 1):
            out, cache = _forward(model, ids, cache)
            chosen = int(torch.argmax(out[0, -1]).item())
            tensors = hooks.take()
            if not writers:
                fp32 = sorted({key_of(n) for n, t in tensors.items()
                               if t.dtype == torch.float32 and dtype != "float32" and key_of(n) not in INT_KEYS})
                writers = [DumpWriter(path, engine=engine, dtype=dtype, config=cfg, tp_size=tp_size, rank=r,
                                      fp32=fp32, overwrite=overwrite) for r in range(tp_size)]
            for w in writers:
                w.begin_step("prefill" if step == 0 else "decode", ids[0].cpu().numpy(), start)
            for name in sorted(tensors):
                for w, part in zip(writers, rank_parts(name, tensors[name], tp_size), strict=True):
                    w.put(name, part)
            for w in writers:
                w.end_step(chosen)
            start += ids.shape[1]
            ids = ids.new_tensor([[chosen]])
    for w in reversed(writers):          # rank 0 last: its close writes the top manifest
        w.close()
    return Path(path)
