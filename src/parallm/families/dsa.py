"""DeepSeek Sparse Attention families: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``, ``deepseek_v32``) and GLM-5
(``GlmMoeDsaForCausalLM``, ``glm_moe_dsa``): config -> :class:`~parallm.model.spec.DecoderSpec`.

Both are DeepSeek-V3 (:mod:`parallm.families.deepseek_v3`: multi-head latent attention with a q LoRA, YaRN or
default RoPE, interleaved in the attention, the sigmoid group-limited MoE with shared experts, dense MLP layers
where ``mlp_layer_types`` says ``"dense"`` (default: the first ``first_k_dense_replace``), MTP layers carried)
plus a lightning indexer per layer (:class:`~parallm.model.spec.DSASpec`, :mod:`parallm.model.layers.indexer`):
``index_n_heads`` heads of ``index_head_dim``, ``index_topk`` keys per query; RoPE in the indexer interleaved for
GLM-5, rotate_half for DeepSeek-V3.2. GLM-5's ``indexer_types`` (``"full"`` / ``"shared"``, or derived as
transformers derives it from ``index_topk_pattern`` / ``index_topk_freq`` and ``index_skip_topk_offset``) marks
the layers that reuse the previous full layer's selection instead of running an indexer.

The weight table: DeepSeek-V3's, plus per layer with an indexer ``self_attn.indexer.{wq_b, wk, k_norm,
weights_proj}`` (replicated over TP, frozen: ``trained=False``; ``weights_proj`` kept in fp32 as transformers
keeps it). FP8 block-quantised releases dequantise on load like DeepSeek-V3's, the indexer's tensors included
(any float8 weight with its ``weight_scale_inv``).
"""

from __future__ import annotations

from dataclasses import replace

from ..model.layers.indexer import INDEXER_WEIGHTS
from ..model.spec import DecoderSpec, DSASpec
from ..model.table import Row
from .deepseek_v3 import DEEPSEEK_DEFAULTS, DEEPSEEK_V3_TABLE, MTP_ROWS, deepseek_v3_spec
from .registry import Family, register

# transformers' GlmMoeDsaConfig defaults for keys a config.json may leave out
GLM5_DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=3,
                     norm_topk_prob=True, n_shared_experts=1, num_nextn_predict_layers=1)
INDEX_DEFAULTS = {"deepseek_v32": dict(index_topk=2048, index_head_dim=128, index_n_heads=64),
                  "glm_moe_dsa": dict(index_topk=2048, index_head_dim=128, index_n_heads=32)}


def _get(config, key, default=None):
    value = config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)
    return default if value is None else value


def indexer_types(config) -> list[str]:
    """GLM-5's per-layer indexer kinds: ``indexer_types`` when the config has them, else transformers' rule:
    ``index_topk_pattern`` ("F" full / "S" shared per layer), else layer ``i`` is full when
    ``max(i - offset + 1, 0) % freq == 0`` (``index_topk_freq`` default 1, ``index_skip_topk_offset`` 2)."""
    n = int(config.num_hidden_layers)
    types = _get(config, "indexer_types")
    if types is None:
        pattern = _get(config, "index_topk_pattern")
        if pattern is not None:
            types = [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) \
                else list(pattern)
        else:
            freq = max(int(_get(config, "index_topk_freq", 1)), 1)
            offset = int(_get(config, "index_skip_topk_offset", 2))
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    types = list(types)
    if len(types) != n or any(t not in ("full", "shared") for t in types):
        raise ValueError(f"indexer_types must hold 'full' or 'shared' for each of the {n} layers, got {types}")
    return types


def _mlp_layers(config, moe, n: int):
    """The MoE spec with its routed layers from ``mlp_layer_types`` when the config gives them."""
    types = _get(config, "mlp_layer_types")
    if moe is None or types is None:
        return moe
    if len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"mlp_layer_types must hold 'dense' or 'sparse' for each of the {n} layers, got {types}")
    return replace(moe, layers=tuple(i for i, t in enumerate(types) if t == "sparse"))


def dsa_spec(config, *, family: str, model_types: tuple[str, ...], defaults: dict, interleave: bool,
             shared: bool) -> DecoderSpec:
    types = _get(config, "mlp_layer_types")
    if types:   # the first routed layer is where mlp_layer_types says (first_k_dense_replace may be left out)
        defaults = dict(defaults, first_k_dense_replace=next((i for i, t in enumerate(types) if t == "sparse"),
                                                             len(types)))
    spec = deepseek_v3_spec(config, family=family, model_types=model_types, defaults=defaults)
    if spec.mla.q_lora_rank is None:
        raise ValueError(f"{family} needs q_lora_rank (the indexer reads the q LoRA latent)")
    d = INDEX_DEFAULTS[family]
    types = indexer_types(config) if shared else ["full"] * spec.num_layers
    dsa = DSASpec(n_heads=int(_get(config, "index_n_heads", d["index_n_heads"])),
                  head_dim=int(_get(config, "index_head_dim", d["index_head_dim"])),
                  topk=int(_get(config, "index_topk", d["index_topk"])), rope_dim=spec.mla.qk_rope_head_dim,
                  rope_interleave=interleave, shared=tuple(i for i, t in enumerate(types) if t == "shared"))
    # transformers' DSA attention rotates the MLA rope part interleaved whatever rope_interleave says
    return replace(spec, mla=replace(spec.mla, rope_interleave=True), dsa=dsa,
                   moe=_mlp_layers(config, spec.moe, spec.num_layers))


H = "hidden_size"
INDEXER_ROWS = tuple(
    Row(f"layers.{{l}}.self_attention.indexer.{local}", ("model.layers.{i}.self_attn.indexer." + hf,), "copy",
        "layer", (shape,), when=("indexer_layer",), trained=False, keep_fp32=hf == "weights_proj.weight")
    for hf, (local, shape) in INDEXER_WEIGHTS.items())


def _with_indexer(table: tuple[Row, ...]) -> tuple[Row, ...]:
    """DeepSeek-V3's table with the indexer rows after the layer's attention rows."""
    out, placed = [], False
    for r in table:
        if placed is False and r.stage == "layer" and ".self_attention." not in r.local \
                and any(".self_attention." in x.local for x in out):
            out.extend(INDEXER_ROWS)
            placed = True
        out.append(r)
    if not placed:
        raise RuntimeError("internal error: no attention rows to put the indexer rows after")
    return tuple(out)


DSA_TABLE = _with_indexer(tuple(r for r in DEEPSEEK_V3_TABLE if r not in MTP_ROWS)) + MTP_ROWS

DEEPSEEK_V32 = register(Family(
    name="deepseek_v32",
    model_types=("deepseek_v32",),
    architectures=("DeepseekV32ForCausalLM", "DeepseekV32ForSequenceClassification", "DeepseekV32Model"),
    spec=lambda config: dsa_spec(config, family="deepseek_v32", model_types=("deepseek_v32",),
                                 defaults=DEEPSEEK_DEFAULTS, interleave=False, shared=False),
    table=DSA_TABLE,
    causal_architecture="DeepseekV32ForCausalLM",
    value_architecture="DeepseekV32ForSequenceClassification",
))

GLM_MOE_DSA = register(Family(
    name="glm_moe_dsa",
    model_types=("glm_moe_dsa",),
    architectures=("GlmMoeDsaForCausalLM", "GlmMoeDsaForSequenceClassification", "GlmMoeDsaModel"),
    spec=lambda config: dsa_spec(config, family="glm_moe_dsa", model_types=("glm_moe_dsa",),
                                 defaults=GLM5_DEFAULTS, interleave=True, shared=True),
    table=DSA_TABLE,
    causal_architecture="GlmMoeDsaForCausalLM",
    value_architecture="GlmMoeDsaForSequenceClassification",
))
