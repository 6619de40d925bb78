"""verl-compatible names over parallm's one implementation.

verl's Megatron backend names eight model classes per family and a loader / saver pair. Here each class is a
:class:`parallm.model.decoder.DecoderChunk` with verl's constructor and verl's keyword-only forward, so the
same object also works with ``parallm.load_hf_weights`` / ``save_hf_weights`` / ``finalize_grads``.

Class families (``{F}`` = ``Llama`` or ``Qwen2``)::

    Parallel{F}Model                 (config, megatron_config)  -> .last_hidden_state [B, S, H]
    Parallel{F}ForCausalLM           (config, megatron_config)  -> .logits [B, S, V] (TP-gathered)
    Parallel{F}ModelRmPad            (config, megatron_config)  -> .last_hidden_state [B, S, H]
    Parallel{F}ForCausalLMRmPad      (config, megatron_config)  -> .logits [B, S, V]
    Parallel{F}ForValueRmPad         (config, megatron_config)  -> .logits [B, S] (values)
    Parallel{F}ModelRmPadPP          (config, megatron_config, pre_process, post_process)
    Parallel{F}ForCausalLMRmPadPP    (config, megatron_config, pre_process, post_process,
                                      share_embeddings_and_output_weights=False)
                                     -> last stage: .logits vocab-parallel [B, S, Vpad/tp]; other stages: the
                                        packed hidden states [T, 1, H] ([T/tp, 1, H] under sequence
                                        parallelism) for the caller's schedule to send
    Parallel{F}ForValueRmPadPP       (same)  -> last stage: .logits [B, S]

Differences from verl, on purpose:

* Tied embeddings follow the HF config (``tie_word_embeddings``); verl's LLaMA asserted them away and its Qwen2
  PP classes trained the last stage's head copy from a random init, never loaded from the embedding. Passing ``share_embeddings_and_output_weights=True`` for an
  untied config is an error.
* Vocab-parallel logits of the PP classes carry the vocabulary padding (when ``V % tp != 0``) as columns filled
  with the dtype's lowest value at real positions, so a softmax / cross entropy gives them probability exactly 0
  (padded positions are all zeros; mask them as usual).
* A model whose weights were never loaded (``load_state_dict_to_megatron_*``, ``parallm.load_hf_weights`` or
  ``parallm.load_checkpoint``; ``parallm.mark_loaded`` after filling the parameters another way) refuses
  ``forward`` with an error naming the fix: its parameters are uninitialised memory.
* RmPad classes run packed (remove-padding, varlen attention, sequence parallel when megatron_config says so)
  and return zeros at padded positions (verl's pad_input convention).
"""

from __future__ import annotations

import warnings

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ..api import default_position_ids
from ..checkpoint.loader import load_hf_weights
from ..checkpoint.saver import save_hf_weights
from ..families import spec_from_config
from ..model.decoder import DecoderChunk, prepare_config
from ..model.loaded import require_loaded
from ..parallel.comm import gather_last_dim
from ..parallel.state import _import_parallel_state, as_chunks, current_dims, kv_replica_group


def _chunk_kwargs(config, megatron_config, task, pre_process, post_process):
    """The chunk verl's constructor describes: virtual stage from parallel_state (Megatron's get_model sets it
    before building each chunk), dtype and sequence parallelism from verl's megatron_config."""
    ps = _import_parallel_state()
    spec, family = spec_from_config(config)
    dims = current_dims()
    mp_config = prepare_config(spec, dims, task=task,
                               dtype=getattr(megatron_config, "params_dtype", None) or torch.float32,
                               sequence_parallel=bool(getattr(megatron_config, "sequence_parallel", False)))
    vpp_rank = (ps.get_virtual_pipeline_model_parallel_rank() or 0) if dims.vpp > 1 else 0
    layers = dims.stage_layers(spec.num_layers, vpp_rank)
    return spec, mp_config, dict(pre_process=pre_process, post_process=post_process, layers=layers,
                                 vpp_rank=vpp_rank, table=family.table, dims=dims)


class _VerlBase(DecoderChunk):
    _task = "causal_lm"
    _pipeline = False
    _rmpad = False

    def __init__(self, config, megatron_config, pre_process=None, post_process=None,
                 share_embeddings_and_output_weights=None):
        if not self._pipeline:
            if current_dims().pp != 1:
                raise ValueError(f"{type(self).__name__} runs without pipeline parallelism; with pp > 1 use "
                                 f"the *PP classes")
            pre_process, post_process = True, True
        spec, mp_config, kw = _chunk_kwargs(config, megatron_config, self._task, bool(pre_process),
                                            bool(post_process))
        if share_embeddings_and_output_weights and not spec.tie_word_embeddings:
            raise ValueError("share_embeddings_and_output_weights=True but the config has tie_word_embeddings="
                             "False")
        if share_embeddings_and_output_weights is False and spec.tie_word_embeddings and self._task == "causal_lm":
            warnings.warn("config.tie_word_embeddings=True: parallm ties the output layer to the embedding "
                          "(share_embeddings_and_output_weights=False is ignored)", stacklevel=2)
        super().__init__(spec, mp_config, task=self._task, packed=self._rmpad, **kw)
        self.hf_config = config
        self.megatron_config = megatron_config
        for nkv in spec.kv_head_counts:
            kv_replica_group(nkv)

    def forward(self, *, input_ids, attention_mask=None, position_ids=None):
        require_loaded(self, f"{type(self).__name__}.forward")   # local: every rank's chunks share the state
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = default_position_ids(attention_mask)
        out = self.compute(input_ids, position_ids, attention_mask)
        if not self.post_process:
            return out  # packed hidden states [T, 1, H] ([T/tp, 1, H] with SP) for the next stage
        if self._task == "hidden":
            return BaseModelOutputWithPast(last_hidden_state=out.transpose(0, 1))
        if self._task == "value":
            return CausalLMOutputWithPast(logits=out.transpose(0, 1).float())
        logits = out.transpose(0, 1).float()  # [B, S, Vpad/tp]; RmPad: zeros at padded positions
        if not self._pipeline:
            logits = gather_last_dim(logits, self.dims.tp_group)[..., :self.spec.vocab_size]
        return CausalLMOutputWithPast(logits=logits)


def _make(name, task, pipeline, rmpad):
    return type(name, (_VerlBase,), {"_task": task, "_pipeline": pipeline, "_rmpad": rmpad,
                                      "__doc__": f"verl-compatible {name} (see parallm.compat.verl)."})


_KINDS = [
    ("Model", "hidden", False, False),
    ("ForCausalLM", "causal_lm", False, False),
    ("ModelRmPad", "hidden", False, True),
    ("ForCausalLMRmPad", "causal_lm", False, True),
    ("ForValueRmPad", "value", False, True),
    ("ModelRmPadPP", "hidden", True, True),
    ("ForCausalLMRmPadPP", "causal_lm", True, True),
    ("ForValueRmPadPP", "value", True, True),
]

for _family in ("Llama", "Qwen2"):
    for _suffix, _task, _pp, _rmpad in _KINDS:
        _name = f"Parallel{_family}{_suffix}"
        globals()[_name] = _make(_name, _task, _pp, _rmpad)


# -- loader / saver with verl's signatures --------------------------------------------------------------------

def _unwrap(models):
    """verl passes Megatron-wrapped models (DDP, Float16Module): follow ``.module`` down to the chunk."""
    out = []
    for m in as_chunks(models):
        while not isinstance(m, DecoderChunk) and hasattr(m, "module"):
            m = m.module
        if not isinstance(m, DecoderChunk):
            raise TypeError(f"expected parallm / parallm.compat.verl models, got {type(m).__name__}")
        out.append(m)
    return out


def _value_state_dict(state_dict):
    """verl's value checkpoints keep the value head as lm_head.weight [1, H]; parallm reads score.weight."""
    if state_dict and "score.weight" not in state_dict and "lm_head.weight" in state_dict \
            and state_dict["lm_head.weight"].shape[0] == 1:
        state_dict = dict(state_dict)
        state_dict["score.weight"] = state_dict.pop("lm_head.weight")
    return state_dict


def _load(state_dict, wrapped_models, config, params_dtype, is_value_model=False, tie_word_embeddings=False):
    """Fill the models from an HF state dict held on global rank 0 (other ranks may pass None or {}) or on
    every rank. ``params_dtype`` / ``tie_word_embeddings`` are accepted for verl compatibility: the models'
    dtype and the HF config decide."""
    chunks = _unwrap(wrapped_models)
    if is_value_model:
        state_dict = _value_state_dict(state_dict)
    load_hf_weights(chunks, state_dict if state_dict else None, mode="auto")


def _merge(wrapped_models, config, dtype, is_value_model=False, tie_word_embeddings=False):
    """The full HF state dict on global rank 0, {} elsewhere (value head as score.weight)."""
    return save_hf_weights(_unwrap(wrapped_models), dtype=dtype)


load_state_dict_to_megatron_llama = _load
load_state_dict_to_megatron_qwen2 = _load
merge_megatron_ckpt_llama = _merge
merge_megatron_ckpt_qwen2 = _merge

_LOADERS = {
    "LlamaForCausalLM": load_state_dict_to_megatron_llama,
    "LlamaForSequenceClassification": load_state_dict_to_megatron_llama,
    "Qwen2ForCausalLM": load_state_dict_to_megatron_qwen2,
    "Qwen2ForSequenceClassification": load_state_dict_to_megatron_qwen2,
}
_SAVERS = {
    "LlamaForCausalLM": merge_megatron_ckpt_llama,
    "LlamaForSequenceClassification": merge_megatron_ckpt_llama,
    "Qwen2ForCausalLM": merge_megatron_ckpt_qwen2,
    "Qwen2ForSequenceClassification": merge_megatron_ckpt_qwen2,
}


def get_weight_loader(arch: str):
    if arch not in _LOADERS:
        raise ValueError(f"Model architectures {arch} loader are not supported for now. "
                         f"Supported architectures: {sorted(_LOADERS)}")
    return _LOADERS[arch]


def get_weight_saver(arch: str):
    if arch not in _SAVERS:
        raise ValueError(f"Model architectures {arch} saver are not supported for now. "
                         f"Supported architectures: {sorted(_SAVERS)}")
    return _SAVERS[arch]


__all__ = [f"Parallel{f}{k[0]}" for f in ("Llama", "Qwen2") for k in _KINDS] + [
    "load_state_dict_to_megatron_llama", "load_state_dict_to_megatron_qwen2", "merge_megatron_ckpt_llama",
    "merge_megatron_ckpt_qwen2", "get_weight_loader", "get_weight_saver"]
