"""Family registry: HF config -> (DecoderSpec, weight table)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from ..model.positions.rope import RopeSpec, rope_spec_from_hf_config
from ..model.spec import DecoderSpec
from ..model.positions.yarn import rope_parameters, yarn_spec_from_params


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    spec: Callable[[object], DecoderSpec]
    table: tuple
    causal_architecture: str
    value_architecture: str
    # The multi-token-prediction tensors this family carries without running them, picked from a checkpoint's
    # tensors ({HF name: shape}, read from the safetensors headers) -> ((name, shape), ...) in a fixed order
    # (Qwen3.5 / Qwen3-Next: ``mtp.*``); the model holds them on its last stage (spec.carried_mtp). None: the
    # family has none, or describes them in its table (DeepSeek-V3's num_nextn_predict_layers).
    mtp_tensors: Callable[[dict], tuple] | None = None
    # (checkpoint prefix, in-memory prefix) pairs where transformers holds a module under another path than the
    # checkpoint names it (Nemotron-H: ``backbone.`` is ``model.``): PEFT names adapters by the in-memory path
    peft_renames: tuple[tuple[str, str], ...] = ()
    # A checkpoint's tensor names -> {checkpoint name: table name}, applied by the loader before anything else, for
    # a family whose released checkpoints spell names otherwise than transformers saves them (DeepSeek-V4's Hub
    # names: :func:`parallm.families.deepseek_v4_names.checkpoint_names`); None: the table's names as they are
    checkpoint_names: Callable[[object], dict] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.name] = family
    return family


def supported_architectures() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.architectures)


def _get(config, key, default=None):
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


# Keys only DeepSeek-V4 configs have. V4-Flash's first configs say ``architectures: ["DeepseekV3ForCausalLM"]``
# (model_type deepseek_v3) and carry these; read as DeepSeek-V3 they would build a silently wrong model, so such a
# config is read as V4 (transformers' DeepseekV4Config folds the legacy keys: compress_ratios -> layer_types,
# num_hash_layers -> mlp_layer_types, compress_rate_csa / _hca -> compress_rates, qk_rope_head_dim ->
# partial_rotary_factor, a top-level expert_dtype into quantization_config).
V4_ONLY_KEYS = ("compress_ratios", "compress_rate_csa", "compress_rate_hca", "compress_rates", "num_hash_layers",
                "hc_mult", "hc_sinkhorn_iters", "hc_eps", "o_groups", "o_lora_rank", "compress_rope_theta")
V4_ARCHITECTURE = "DeepseekV4ForCausalLM"


def _config_as_dict(config) -> dict:
    if isinstance(config, dict):
        return config
    if isinstance(config, _DictConfig):
        return config._raw
    return config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))


def is_legacy_v4(config) -> bool:
    """Whether ``config`` (object or config.json dict) says DeepSeek-V3 (``model_type: deepseek_v3`` or
    ``DeepseekV3ForCausalLM``) but carries keys only DeepSeek-V4 has (:data:`V4_ONLY_KEYS`)."""
    d = _config_as_dict(config)
    v3 = d.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in (d.get("architectures") or [])
    return v3 and any(d.get(k) is not None for k in V4_ONLY_KEYS)


def legacy_v4_config(config):
    """A legacy V4 config (:func:`is_legacy_v4`) as transformers' ``DeepseekV4Config`` built from its keys
    (``model_type: deepseek_v4``, ``architectures: ["DeepseekV4ForCausalLM"]``), the legacy keys folded in."""
    from transformers import DeepseekV4Config
    d = {k: v for k, v in _config_as_dict(config).items()
         if k not in ("model_type", "architectures", "auto_map", "transformers_version")}
    out = DeepseekV4Config(**d)
    out.architectures = [V4_ARCHITECTURE]
    return out


def family_for(config) -> Family:
    """The family of an HF config (object or config.json dict), or a ValueError listing what is supported. A
    legacy DeepSeek-V4 config (:func:`is_legacy_v4`) is V4's, never DeepSeek-V3's."""
    if is_legacy_v4(config):
        for f in FAMILIES.values():
            if V4_ARCHITECTURE in f.architectures:
                return f
        raise ValueError(f"this config says DeepseekV3ForCausalLM but carries DeepSeek-V4 keys "
                         f"({', '.join(k for k in V4_ONLY_KEYS if _config_as_dict(config).get(k) is not None)}): it is a DeepSeek-V4"
                         f" config, and this parallm has no {V4_ARCHITECTURE} family (it is not read as DeepSeek-V3)")
    archs = _get(config, "architectures") or []
    for f in FAMILIES.values():
        if any(a in f.architectures for a in archs):
            return f
    model_type = _get(config, "model_type")
    if not archs:
        for f in FAMILIES.values():
            if model_type in f.model_types:
                return f
    got = f"architectures={list(archs)}" if archs else f"model_type={model_type!r}"
    raise ValueError(f"unsupported architecture ({got}); parallm supports: {', '.join(supported_architectures())}")


class _DictConfig:
    """Attribute access over a config.json dict (so family spec functions read objects and dicts alike)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)
        self._raw = d

    def get(self, key, default=None):
        return self._raw.get(key, default)


def load_config(hf_config):
    """A PretrainedConfig, a checkpoint directory, a config.json path, or a dict -> a config object.

    Directories / files are read as plain JSON (no transformers model code is imported), so config.json files
    written by transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x (``rope_parameters``) both work. A
    legacy DeepSeek-V4 config (``DeepseekV3ForCausalLM`` with V4 keys, :func:`is_legacy_v4`), file, dict or
    object, becomes transformers' ``DeepseekV4Config`` (:func:`legacy_v4_config`).
    """
    config = _load_config(hf_config)
    return legacy_v4_config(config) if is_legacy_v4(config) else config


def _load_config(hf_config):
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.fspath(hf_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            try:
                raw = json.load(f)
            except ValueError as e:
                raise ValueError(f"{path} is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} does not hold a JSON object")
        return _DictConfig(raw)
    if isinstance(hf_config, dict):
        return _DictConfig(hf_config)
    return hf_config


REQUIRED_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


def base_spec_kwargs(config, family: str) -> dict:
    """Fields every LLaMA-like family reads the same way."""
    missing = [k for k in REQUIRED_FIELDS if getattr(config, k, None) is None]
    if missing:
        raise ValueError(f"the {family} config is missing required field(s): {', '.join(missing)}")
    bad = [f"{k}={getattr(config, k)!r}" for k in REQUIRED_FIELDS
           if not isinstance(getattr(config, k), int) or isinstance(getattr(config, k), bool)
           or getattr(config, k) <= 0]
    if bad:
        raise ValueError(f"the {family} config has invalid value(s): {', '.join(bad)} (positive integers expected)")
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    archs = getattr(config, "architectures", None) or []
    act = getattr(config, "hidden_act", "silu")
    return dict(
        family=family,
        architecture=archs[0] if archs else family,
        model_type=getattr(config, "model_type", family),
        hidden_size=hidden,
        num_layers=int(config.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        intermediate_size=int(config.intermediate_size),
        vocab_size=int(config.vocab_size),
        rms_norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)),
        **_rope_kwargs(config if not isinstance(config, _DictConfig) else config._raw, int(head_dim)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        pad_token_id=_pad_token_id(config),
        hidden_act=act,
    )


def _rope_kwargs(config, head_dim: int) -> dict:
    """``rope`` (a :class:`RopeSpec`), and for ``rope_type: "yarn"`` also ``yarn`` (a :class:`YarnSpec`, over the
    whole head; ``rope`` then holds the base only): the decoder takes YaRN's frequencies and its cos / sin
    attention factor from it, as transformers' LLaMA-like rotary embeddings do from ``ROPE_INIT_FUNCTIONS``."""
    params = rope_parameters(config)
    if params["rope_type"] != "yarn" or "mrope_section" in params or _get(config, "mrope_section") is not None:
        return {"rope": rope_spec_from_hf_config(config, head_dim)}     # every other kind and its errors
    factor = params.get("partial_rotary_factor")
    if factor is not None and float(factor) != 1.0:
        raise ValueError(f"partial_rotary_factor={factor} is not supported with yarn RoPE in this family (only "
                         "full rotary embeddings)")
    max_pos = _get(config, "max_position_embeddings")
    max_pos = int(max_pos) if max_pos is not None else None
    yarn = yarn_spec_from_params(params, dim=head_dim, max_position_embeddings=max_pos)
    return {"rope": RopeSpec(dim=head_dim, theta=yarn.theta, kind="default", max_position_embeddings=max_pos),
            "yarn": yarn}


def _pad_token_id(config) -> int | None:
    """``config.pad_token_id`` when it names a row of the vocabulary (transformers then builds its embedding with
    ``padding_idx``), else None."""
    pad = getattr(config, "pad_token_id", None)
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < int(config.vocab_size):
        return None
    return pad


def _effective_window(config) -> int | None:
    """The config's ``sliding_window`` where transformers uses it: set (not None, not 0) and, for the families
    with the switch, ``use_sliding_window`` true (transformers 5 clears ``sliding_window`` otherwise; 4.x
    configs may still carry it)."""
    window = _get(config, "sliding_window")
    if _get(config, "use_sliding_window", True) is False or not window:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} is not a positive integer")
    return window


def layer_windows(config, name: str, *, every_layer: bool = False, default_types=None) -> tuple:
    """Each layer's sliding window (None: full causal attention) as transformers builds the model's masks, for
    :attr:`parallm.model.spec.DecoderSpec.layer_windows`; ``()`` when no layer has one.

    ``every_layer`` (Mistral, Mixtral, Qwen3-MoE): the window on every layer (their models read
    ``sliding_window`` alone; Mistral ignores ``layer_types``). Otherwise ``layer_types`` (``"sliding_attention"``:
    the window, any other kind: none), or when the config has none ``default_types(config, num_layers)`` (the
    family's rule, e.g. Qwen2: ``"sliding_attention"`` from ``max_window_layers`` on). A layer typed
    ``"sliding_attention"`` without a window is a ValueError (transformers fails on it too)."""
    n = int(config.num_hidden_layers)
    window = _effective_window(config)
    if every_layer:
        return (window,) * n if window is not None else ()
    types = _get(config, "layer_types")
    if types is None:
        types = default_types(config, n) if default_types is not None else []
    types = list(types)
    if types and len(types) != n:
        raise ValueError(f"the {name} config has {len(types)} layer_types for num_hidden_layers={n}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if not sliding:
        return ()
    if window is None:
        raise ValueError(f"the {name} config types layers {sliding[:8]} as sliding_attention but sets no "
                         f"sliding_window (use_sliding_window={_get(config, 'use_sliding_window')!r}, "
                         f"sliding_window={_get(config, 'sliding_window')!r})")
    return tuple(window if t == "sliding_attention" else None for t in types)


def qwen_window_types(config, n: int) -> list[str]:
    """Qwen2 / Qwen3 (transformers' Qwen2Config): layers from ``max_window_layers`` on slide when
    ``use_sliding_window``."""
    start = _get(config, "max_window_layers", n)
    start = n if start is None else int(start)
    on = _effective_window(config) is not None
    return ["sliding_attention" if on and i >= start else "full_attention" for i in range(n)]


def qwen2_moe_window_types(config, n: int) -> list[str]:
    """Qwen2-MoE (transformers' Qwen2MoeConfig): every other layer, from the first, below ``max_window_layers``
    when ``use_sliding_window``."""
    limit = _get(config, "max_window_layers", n)
    limit = n if limit is None else int(limit)
    on = _effective_window(config) is not None
    return ["sliding_attention" if on and (i + 1) % 2 and i < limit else "full_attention" for i in range(n)]


def spec_from_config(hf_config) -> tuple[DecoderSpec, Family]:
    config = load_config(hf_config)
    family = family_for(config if not isinstance(config, _DictConfig) else config._raw)
    return family.spec(config), family


def family_of(spec: DecoderSpec) -> Family:
    return FAMILIES[spec.family]
