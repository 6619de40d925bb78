"""Family registry: HF config -> (DecoderSpec, weight table)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Callable

from ..model.rope import RopeSpec, rope_spec_from_hf_config
from ..model.spec import DecoderSpec
from ..model.yarn import rope_parameters, yarn_spec_from_params


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    spec: Callable[[object], DecoderSpec]
    table: tuple
    causal_architecture: str
    value_architecture: str


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


def family_for(config) -> Family:
    """The family of an HF config (object or config.json dict), or a ValueError listing what is supported."""
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
    written by transformers 4.x (``rope_theta`` / ``rope_scaling``) and 5.x (``rope_parameters``) both work.
    """
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


def refuse_sliding_layers(config, name: str) -> None:
    """Qwen2 / Qwen3 style: layers transformers would run with sliding-window attention are not supported."""
    types = getattr(config, "layer_types", None)
    if types:
        sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    elif getattr(config, "use_sliding_window", False):
        sliding = list(range(getattr(config, "max_window_layers", 0) or 0, int(config.num_hidden_layers)))
    else:
        sliding = []
    if sliding:
        raise ValueError(f"{name} with sliding-window attention on layers {sliding[:8]} is not supported "
                         "(use_sliding_window=True with max_window_layers < num_hidden_layers); parallm runs full "
                         "causal attention")


def spec_from_config(hf_config) -> tuple[DecoderSpec, Family]:
    config = load_config(hf_config)
    family = family_for(config if not isinstance(config, _DictConfig) else config._raw)
    return family.spec(config), family


def family_of(spec: DecoderSpec) -> Family:
    return FAMILIES[spec.family]
