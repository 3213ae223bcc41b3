"""K3Config: the text-decoder geometry of Kimi K3 (and the scaled `small` / `tiny` configs).

Field names follow the published `config.json` text_config where one exists (HF / DeepSeek spellings for
the MoE fields). `from_json` reads the multimodal wrapper (`{"text_config": {...}}`) or a plain text config,
in the published spelling (`num_experts`, `num_experts_per_token`, `linear_attn_config: {full_attn_layers,
kda_layers, num_heads, head_dim, short_conv_kernel_size, use_full_rank_gate, gate_lower_bound}`, ...) or
flat with this class's field names. `to_json` writes the published spelling plus `a_log_size`.

Layer indices: `full_attn_layers` is 1-indexed as published; every method taking a layer takes the
0-indexed layer i (layer i is MLA iff i + 1 is listed). See docs/spec.md section 2.2.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .checks import is_finite_real
from .kda import KdaConfig
from .latent_moe import LatentMoeConfig
from .mla import MlaConfig
from .safetensors_io import FormatError, is_int, read_json

MXFP4_GROUP = 32  # OCP MX block size: one E8M0 scale per 32 E2M1 codes


@dataclasses.dataclass(frozen=True, kw_only=True)
class K3Config:
    """Geometry of the K3 text decoder. Validated on construction (ValueError names the field)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    full_attn_layers: tuple[int, ...]          # 1-indexed MLA layers, as published
    first_k_dense_replace: int = 1             # layers 0..k-1 have the dense SiTU MLP
    intermediate_size: int                     # dense MLP width (layer 0)
    # MLA
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int = 4
    use_full_rank_gate: bool = True
    gate_lower_bound: float | None = -5.0      # None: the Kimi Linear softplus gate
    a_log_size: int = 128                      # A_log is stored padded to this length (K3: 128 for 96 heads)
    # LatentMoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int             # latent width the routed experts work in
    latent_moe_use_norm: bool = True
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    # SiTU and Block AttnRes
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    attn_res_block_size: int = 12

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "full_attn_layers", tuple(self.full_attn_layers))
        _validate(self)

    # ----- layer schedule -----

    def _layer(self, i: int) -> int:
        if not (isinstance(i, int) and 0 <= i < self.num_hidden_layers):
            raise ValueError(f"layer index: expected an int in [0, {self.num_hidden_layers}), found {i!r}")
        return i

    def is_mla(self, i: int) -> bool:
        """True iff 0-indexed layer i is an MLA (full attention) layer, i.e. i + 1 is in full_attn_layers."""
        return (self._layer(i) + 1) in self.full_attn_layers

    def mlp_is_dense(self, i: int) -> bool:
        """True iff 0-indexed layer i has the dense SiTU MLP (i < first_k_dense_replace); else LatentMoE."""
        return self._layer(i) < self.first_k_dense_replace

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """0-indexed MLA layers."""
        return tuple(i - 1 for i in sorted(self.full_attn_layers))

    @property
    def kda_layers(self) -> tuple[int, ...]:
        """0-indexed KDA layers."""
        mla = set(self.mla_layers)
        return tuple(i for i in range(self.num_hidden_layers) if i not in mla)

    # ----- per-block configs (k3ref.kda / mla / latent_moe) -----

    def kda_config(self) -> KdaConfig:
        """k3ref.kda.KdaConfig for the KDA layers."""
        return KdaConfig(
            num_heads=self.kda_num_heads, head_dim=self.kda_head_dim, conv_size=self.short_conv_kernel_size,
            gate_lower_bound=self.gate_lower_bound, use_full_rank_gate=self.use_full_rank_gate,
            norm_eps=self.rms_norm_eps,
        )

    def mla_config(self) -> MlaConfig:
        """k3ref.mla.MlaConfig for the MLA layers (page size 64, FlashMLA's)."""
        return MlaConfig(
            num_heads=self.num_attention_heads, q_lora_rank=self.q_lora_rank, kv_lora_rank=self.kv_lora_rank,
            qk_nope_head_dim=self.qk_nope_head_dim, qk_rope_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
        )

    def moe_config(self) -> LatentMoeConfig:
        """k3ref.latent_moe.LatentMoeConfig for the MoE layers (shared experts fused: width n_shared * I)."""
        return LatentMoeConfig(
            hidden_size=self.hidden_size, num_experts=self.n_routed_experts, top_k=self.num_experts_per_tok,
            latent_size=self.routed_expert_hidden_size, moe_intermediate_size=self.moe_intermediate_size,
            n_shared_experts=self.n_shared_experts, shared_intermediate_size=self.shared_intermediate_size,
            n_group=self.n_group, topk_group=self.topk_group, renormalize=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor, use_norm=self.latent_moe_use_norm,
            situ_beta=self.situ_beta, linear_beta=self.situ_linear_beta, norm_eps=self.rms_norm_eps,
        )

    @property
    def shared_intermediate_size(self) -> int:
        """Width of the fused shared-expert SiTU MLP: n_shared_experts * moe_intermediate_size."""
        return self.n_shared_experts * self.moe_intermediate_size

    # ----- tensor parallelism -----

    def validate_tp(self, tp: int) -> None:
        """Raise ValueError unless tp >= 1 divides both the KDA and the MLA head counts."""
        if not (isinstance(tp, int) and tp >= 1):
            raise ValueError(f"tp: expected a positive int, found {tp!r}")
        for what, heads in (("kda_num_heads", self.kda_num_heads), ("num_attention_heads", self.num_attention_heads)):
            if heads % tp:
                raise ValueError(f"tp={tp} does not divide {what}={heads}; choose tp among "
                                 f"{[d for d in range(1, heads + 1) if heads % d == 0]}")

    # ----- JSON -----

    @classmethod
    def from_json(cls, path_or_dict: str | os.PathLike | Mapping[str, Any]) -> K3Config:
        """Read a config.json (a file, a checkpoint directory holding one, or an already-parsed dict).

        Accepts the multimodal wrapper (`text_config`) or a plain text config; published nested spelling
        (`linear_attn_config`) or flat field names. Aliases that disagree raise ValueError.

        Unknown keys: a published config carries many keys this geometry does not use (rope, token ids,
        quantization, ...), so an unknown key is accepted and ignored, unless it is so close to a key this
        reader knows (difflib ratio >= UNKNOWN_KEY_CUTOFF) that it is most likely that key misspelled: then
        ValueError names both ("unknown field 'rms_norm_esp' in config.json; did you mean 'rms_norm_eps'?").
        Published keys that merely look like known ones (`qk_head_dim`, `head_dim`) are listed as ignored.
        """
        if isinstance(path_or_dict, Mapping):
            raw = dict(path_or_dict)
        else:
            path = Path(path_or_dict)
            try:
                if path.is_dir():
                    path = path / "config.json"
                raw = read_json(path, "config")
            except (FormatError, OSError) as e:
                raise ValueError(f"config: cannot read {str(e)[:400]}") from None
            if not isinstance(raw, dict):
                raise ValueError(f"config: expected a JSON object in {path}, found {type(raw).__name__}")
        return cls(**_fields_from_json(raw))

    def to_json(self) -> dict[str, Any]:
        """The text config in the published spelling (nested linear_attn_config) plus `a_log_size`."""
        out: dict[str, Any] = {"model_type": "kimi_linear", "hidden_act": "situ",
                               "moe_router_activation_func": "sigmoid"}
        nested_rev = {field: key for key, field in _LINEAR_ATTN_KEYS.items()}
        lac: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "full_attn_layers":
                value = list(value)
            if f.name in nested_rev:
                lac[nested_rev[f.name]] = value
            else:
                out[_PUBLISHED_NAME.get(f.name, f.name)] = value
        lac["kda_layers"] = [i + 1 for i in self.kda_layers]
        out["linear_attn_config"] = lac
        out["num_key_value_heads"] = self.num_attention_heads
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write to_json() to `path` (a file, or config.json inside a directory) via a temp file + rename."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return path

    # ----- presets -----

    @classmethod
    def preset(cls, name: str) -> K3Config:
        """One of the shipped configs: `k3` (full geometry), `small` (~0.40B params), `tiny` (toy)."""
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"preset: unknown name {name!r}; expected one of {sorted(PRESETS)}") from None


# Published text_config key -> field name (only where they differ).
_PUBLISHED_NAME = {
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "situ_beta": "activation_situ_beta",
    "situ_linear_beta": "activation_situ_linear_beta",
}
# Keys inside linear_attn_config -> field name.
_LINEAR_ATTN_KEYS = {
    "full_attn_layers": "full_attn_layers",
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "use_full_rank_gate": "use_full_rank_gate",
    "gate_lower_bound": "gate_lower_bound",
}
# Keys this reader understands besides the fields and their published names (checked or used elsewhere).
_OTHER_KEYS = ("moe_router_activation_func", "num_key_value_heads", "layer_types", "kda_layers",
               "linear_attn_config", "text_config", "model_type", "hidden_act")
# Published keys that are not misspellings although they resemble a known key: accepted and not used.
_IGNORED_KEYS = ("qk_head_dim", "head_dim", "conv_kernel_size")
# How similar (difflib ratio) an unknown key must be to a known one to be taken for its misspelling.
UNKNOWN_KEY_CUTOFF = 0.85
# layer_types spellings seen in HF-style configs -> is MLA
_LAYER_KINDS = {"kda": False, "linear_attention": False, "mla": True, "attention": True, "full_attention": True}


def _fields_from_json(raw: dict[str, Any]) -> dict[str, Any]:
    """Map a published / flat config dict to K3Config keyword arguments (see K3Config.from_json)."""
    text = _text_config(raw)
    out, lac = _named_fields(text)
    _check_router_and_kv_heads(text, out)
    _layer_kinds(text, lac, out)
    if "a_log_size" not in out and is_int(out.get("kda_num_heads")):
        out["a_log_size"] = max(128, out["kda_num_heads"])   # K3 pads A_log to 128
    missing = sorted(f.name for f in dataclasses.fields(K3Config)
                     if f.default is dataclasses.MISSING and f.name not in out)
    if missing:
        raise ValueError(f"config: missing required field(s) {missing} (published or flat spelling)")
    return out


def _text_config(raw: dict[str, Any]) -> Mapping[str, Any]:
    """The text model's part of a published multimodal config (`text_config`), or `raw` itself."""
    if "text_config" not in raw:
        return raw
    text = raw["text_config"]
    if not isinstance(text, Mapping):
        raise ValueError(f"config: text_config must be an object, found {type(text).__name__}")
    return text


def _put(out: dict[str, Any], field: str, value: Any, key: str) -> None:
    """Set `field` from config key `key`; two spellings of one field must agree."""
    if field in out and out[field] != value:
        raise ValueError(f"config: {key}={value!r} disagrees with another spelling of {field} ({out[field]!r})")
    out[field] = value


def _named_fields(raw: Mapping) -> tuple[dict[str, Any], Mapping]:
    """The fields given by name (flat, published or inside linear_attn_config), and linear_attn_config."""
    names = {f.name for f in dataclasses.fields(K3Config)}
    out: dict[str, Any] = {}
    published = {v: k for k, v in _PUBLISHED_NAME.items()}
    for key, value in raw.items():
        if key in names:
            _put(out, key, value, key)
        elif key in published:
            _put(out, published[key], value, key)
    _check_misspelled(raw, names | set(published) | set(_OTHER_KEYS), "")
    lac = raw.get("linear_attn_config") or {}
    if not isinstance(lac, Mapping):
        raise ValueError(f"config: linear_attn_config must be an object, found {type(lac).__name__}")
    _check_misspelled(lac, set(_LINEAR_ATTN_KEYS) | {"kda_layers"}, "linear_attn_config.")
    for key, field in _LINEAR_ATTN_KEYS.items():
        if key in lac:
            _put(out, field, lac[key], f"linear_attn_config.{key}")
    return out, lac


def _check_misspelled(raw: Mapping, known: set[str], where: str) -> None:
    """ValueError for an unknown key close to a known one (see K3Config.from_json); other unknown keys pass."""
    for key in raw:
        if key in known or key in _IGNORED_KEYS or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=UNKNOWN_KEY_CUTOFF)
        if close:
            raise ValueError(f"config: unknown field '{where}{key}' in config.json; did you mean '{where}{close[0]}'?")


def _check_router_and_kv_heads(raw: Mapping, out: dict[str, Any]) -> None:
    """Published keys K3 does not store but fixes: a sigmoid router, and key/value heads that divide the heads."""
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError(f"config: moe_router_activation_func: expected 'sigmoid' (K3), "
                         f"found {raw['moe_router_activation_func']!r}")
    kvh = raw.get("num_key_value_heads")
    heads = out.get("num_attention_heads")
    if kvh is not None and not (is_int(kvh) and kvh > 0):
        raise ValueError(f"config: num_key_value_heads must be a positive int, found {kvh!r:.80}")
    if kvh is not None and is_int(heads) and heads % kvh:
        raise ValueError(f"config: num_attention_heads={heads} is not divisible by num_key_value_heads={kvh}")


def _layer_kinds(raw: Mapping, lac: Mapping, out: dict[str, Any]) -> None:
    """full_attn_layers from the other spellings of the layer kinds (layer_types, kda_layers), checked against
    num_hidden_layers: every layer has exactly one kind."""
    layers = out.get("num_hidden_layers")
    if "layer_types" in raw:
        kinds = raw["layer_types"]
        if not (isinstance(kinds, list) and all(isinstance(k, str) for k in kinds)):
            raise ValueError(f"config: layer_types must be a list of strings, found {kinds!r:.80}")
        unknown = sorted({k for k in kinds if k not in _LAYER_KINDS})
        if unknown:
            raise ValueError(f"config: unknown layer kind(s) {unknown} in layer_types; expected some of "
                             f"{sorted(_LAYER_KINDS)}")
        _put(out, "full_attn_layers", [i + 1 for i, k in enumerate(kinds) if _LAYER_KINDS[k]], "layer_types")
        if layers is not None and len(kinds) != layers:
            raise ValueError(f"config: layer_types has {len(kinds)} entries, num_hidden_layers is {layers}")
    kda_layers = lac.get("kda_layers", raw.get("kda_layers"))
    if kda_layers is not None:
        _check_kda_layers(kda_layers, layers, out)


def _check_kda_layers(kda_layers: Any, layers: Any, out: dict[str, Any]) -> None:
    """kda_layers (1-indexed) and full_attn_layers partition 1..num_hidden_layers; the first implies the second."""
    if not (isinstance(kda_layers, list) and all(is_int(i) for i in kda_layers)):
        raise ValueError(f"config: kda_layers must be a list of ints (1-indexed layers), found {kda_layers!r:.80}")
    if not is_int(layers):
        raise ValueError(f"config: kda_layers given without an int num_hidden_layers (found {layers!r:.40})")
    kda = list(kda_layers)
    if "full_attn_layers" not in out:
        out["full_attn_layers"] = [i for i in range(1, layers + 1) if i not in set(kda)]
    fal = out["full_attn_layers"]
    if not (isinstance(fal, (list, tuple)) and all(is_int(i) for i in fal)):
        raise ValueError(f"config: full_attn_layers must be a list of ints (1-indexed layers), found {fal!r:.80}")
    full = set(fal)
    both = sorted(full & set(kda))
    if both:
        raise ValueError(f"config: layer(s) {both} (1-indexed) are in both full_attn_layers and kda_layers")
    neither = sorted(set(range(1, layers + 1)) - full - set(kda))
    if neither:
        raise ValueError(f"config: layer(s) {neither} (1-indexed) have no known kind: in neither "
                         f"full_attn_layers (MLA) nor kda_layers (KDA)")
    extra = sorted(i for i in kda if not 1 <= i <= layers)
    if extra:
        raise ValueError(f"config: kda_layers {extra} out of range 1..{layers}")


def _is_number(v: Any) -> bool:
    """A finite JSON number: a Python int or float (what json.loads makes), never a bool."""
    return isinstance(v, (int, float)) and is_finite_real(v)


# annotation -> (what it must be, the check); JSON true is not 1, "false" is not false, "36" is not [3, 6]
_TYPE_RULES = {
    "int": ("an int", is_int),
    "float": ("a finite number", _is_number),
    "bool": ("a JSON bool (true/false)", lambda v: isinstance(v, bool)),
    "float | None": ("a finite number or null", lambda v: v is None or _is_number(v)),
    "tuple[int, ...]": ("a list of ints", lambda v: isinstance(v, (list, tuple)) and all(is_int(i) for i in v)),
}


def _check_types(c: K3Config) -> None:
    """Each field has its declared type, nothing coerced; ValueError names the field and the value found."""
    for f in dataclasses.fields(c):
        # The module's postponed annotations make every field type its source text, the key of _TYPE_RULES.
        if not isinstance(f.type, str):
            raise TypeError(f"K3Config.{f.name}: expected its annotation as text, found {f.type!r}")
        what, ok = _TYPE_RULES[f.type]
        v = getattr(c, f.name)
        if not ok(v):
            raise ValueError(f"config: {f.name} must be {what}, found {type(v).__name__} {v!r:.80}")


def _validate(c: K3Config) -> None:
    """Every rule a K3Config must satisfy; ValueError names the field, the rule and the value found."""
    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "kda_num_heads", "kda_head_dim", "short_conv_kernel_size", "a_log_size", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "routed_expert_hidden_size", "n_group",
                "topk_group", "attn_res_block_size"]
    for name in positive:
        v = getattr(c, name)
        if not (is_int(v) and v > 0):
            raise ValueError(f"config: {name} must be a positive int, found {v!r}")
    if not (isinstance(c.n_shared_experts, int) and c.n_shared_experts >= 0):
        raise ValueError(f"config: n_shared_experts must be an int >= 0, found {c.n_shared_experts!r}")
    if not c.rms_norm_eps > 0:
        raise ValueError(f"config: rms_norm_eps must be > 0, found {c.rms_norm_eps}")
    L = c.num_hidden_layers
    fal = c.full_attn_layers
    bad = sorted(i for i in fal if not 1 <= i <= L)
    if bad:
        raise ValueError(f"config: full_attn_layers {bad} out of range: they are 1-indexed, expected 1..{L}")
    dup = sorted({i for i in fal if fal.count(i) > 1})
    if dup:
        raise ValueError(f"config: full_attn_layers lists {dup} more than once")
    if not 0 <= c.first_k_dense_replace <= L:
        raise ValueError(f"config: first_k_dense_replace must be in 0..{L}, found {c.first_k_dense_replace}")
    if c.kda_num_heads > c.a_log_size:
        raise ValueError(f"config: a_log_size={c.a_log_size} must be >= kda_num_heads={c.kda_num_heads} "
                         "(A_log holds one entry per head, then zero padding)")
    if c.n_routed_experts % c.n_group:
        raise ValueError(f"config: n_routed_experts={c.n_routed_experts} is not divisible by n_group={c.n_group}")
    if c.topk_group > c.n_group:
        raise ValueError(f"config: topk_group={c.topk_group} must be <= n_group={c.n_group}")
    reachable = c.topk_group * (c.n_routed_experts // c.n_group)
    if c.num_experts_per_tok > reachable:
        raise ValueError(f"config: num_experts_per_tok={c.num_experts_per_tok} exceeds the "
                         f"{reachable} experts reachable (n_routed_experts={c.n_routed_experts}, "
                         f"n_group={c.n_group}, topk_group={c.topk_group})")
    # MXFP4: w1/w3 are [I, latent] and w2 is [latent, I]; the input dim of each is cut in groups of 32.
    for name in ("routed_expert_hidden_size", "moe_intermediate_size"):
        v = getattr(c, name)
        if v % MXFP4_GROUP:
            raise ValueError(f"config: {name}={v} must be a multiple of {MXFP4_GROUP} (MXFP4 scale group)")
    for name in ("situ_beta", "situ_linear_beta", "routed_scaling_factor"):
        v = getattr(c, name)
        if not v > 0:   # softcap divides by the SiTU betas; a scale <= 0 flips or zeroes every routed expert's output
            raise ValueError(f"config: {name} must be > 0, found {v}")
    if c.gate_lower_bound is not None and not c.gate_lower_bound < 0:
        raise ValueError(f"config: gate_lower_bound must be < 0 (log-decay), found {c.gate_lower_bound}")


# ----- presets (docs/spec.md section 2.3) -----

def _k3_full_attn(num_layers: int) -> tuple[int, ...]:
    """K3's schedule, 1-indexed: every 4th layer, plus the last one."""
    return tuple(sorted(set(range(4, num_layers + 1, 4)) | {num_layers}))


PRESETS: dict[str, dict[str, Any]] = {
    "k3": dict(
        vocab_size=163840, hidden_size=7168, num_hidden_layers=93, full_attn_layers=_k3_full_attn(93),
        intermediate_size=33792, num_attention_heads=96, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=96, kda_head_dim=128,
        a_log_size=128, n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2,
        moe_intermediate_size=3072, routed_expert_hidden_size=3584, attn_res_block_size=12,
    ),
    # K3's structure at ~0.40B parameters: 17 layers (MLA at 4, 8, 12, 16, 17), head dims of K3,
    # 8 KDA / MLA heads (tp 1, 2, 4, 8 all legal), 64 experts top-8 in a latent of half the width.
    "small": dict(
        vocab_size=32000, hidden_size=1024, num_hidden_layers=17, full_attn_layers=_k3_full_attn(17),
        intermediate_size=4864, num_attention_heads=8, q_lora_rank=384, kv_lora_rank=256,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=8, kda_head_dim=128,
        a_log_size=16, n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=2,
        moe_intermediate_size=128, routed_expert_hidden_size=512, attn_res_block_size=4,
    ),
    # Every feature at toy size: layers 0..6 = KDA KDA MLA | KDA KDA MLA | MLA (1-indexed MLA 3, 6, 7:
    # two in a row at the end), dense layer 0, MoE 1..6, AttnRes blocks start at 0, 3, 6; odd vocab,
    # expert count and dense width; 4 heads so that the simulated TP 2 and TP 4 forwards are legal;
    # A_log padded 4 -> 5; MXFP4 dims 32.
    "tiny": dict(
        vocab_size=97, hidden_size=36, num_hidden_layers=7, full_attn_layers=(3, 6, 7),
        intermediate_size=45, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kda_num_heads=4, kda_head_dim=8,
        a_log_size=5, n_routed_experts=7, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, routed_expert_hidden_size=32, attn_res_block_size=3,
    ),
    # K3's per-head geometry at toy counts, so that every CUDA kernel runs inside a model trace: KDA head_dim
    # 128 (K = V, what kda_decode is built for); MLA kv_lora 512, qk_rope 64, qk_nope 128, v_head 128 (the
    # mla_decode register layout); MXFP4 dims multiples of the group of 32. Layers 0..4 = KDA KDA KDA | MLA
    # MLA (K3's schedule cut at 5 layers: MLA at 1-indexed 4 and the last, two in a row), dense layer 0, MoE
    # 1..4, AttnRes blocks start at 0, 2, 4 (at most 3 blocks + the prefix: attnres_mix takes up to 9 sources);
    # 2 KDA and 2 MLA heads (TP 2 legal); A_log padded 2 -> 3; odd vocab, expert count and dense width.
    "k3geom": dict(
        vocab_size=97, hidden_size=32, num_hidden_layers=5, full_attn_layers=_k3_full_attn(5),
        intermediate_size=75, num_attention_heads=2, q_lora_rank=32, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, kda_num_heads=2, kda_head_dim=128,
        a_log_size=3, n_routed_experts=5, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=64, routed_expert_hidden_size=32, attn_res_block_size=2,
    ),
}
