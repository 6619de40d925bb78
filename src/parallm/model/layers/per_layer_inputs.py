"""Gemma 4's per-layer input embeddings (``hidden_size_per_layer_input`` P > 0, ``spec.per_layer_input_size``),
as transformers 5.25's ``Gemma4TextModel`` computes them.

The first pipeline stage computes every layer's input once per batch (:class:`PerLayerInputs`): the token ids'
rows of ``embed_tokens_per_layer`` (vocab-parallel, width ``L * P``, times ``sqrt(P)`` cast to the weights' dtype),
and ``per_layer_model_projection`` of the scaled token embeddings times ``H ** -0.5``, viewed ``[.., L, P]`` and
RMS-normed over P (``per_layer_projection_norm``); their sum times ``2 ** -0.5``, ``[.., L * P]`` (layer ``i``'s
input: columns ``[i P, (i + 1) P)``). Each layer (:class:`PerLayerInput`), after its MLP's residual add and before
its layer scalar: ``x + norm(proj(act(gate(x)) * input_i))``.

The projection, the norms, the gates and the projections are replicated over TP (``copy`` rows): each rank computes
them on the rows of the activations it holds (this rank's share under sequence parallelism, whence ``tp_sum="sp"``).
Under pipeline parallelism the inputs travel with the hidden state across every stage boundary
(:func:`join` / :func:`split`: ``[.., H + L * P]``), so later stages need neither the token embeddings nor the
ids, and the gradient reaches the first stage's embeddings through the same wire.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.megatron_import import import_megatron
from ..spec import DecoderSpec
from .mlp import no_init
from .norms import norm_class

mtp = import_megatron().tensor_parallel


def _act(spec: DecoderSpec):
    if spec.hidden_act == "gelu_pytorch_tanh":
        return lambda h: F.gelu(h, approximate="tanh")
    if spec.hidden_act == "silu":
        return F.silu
    raise ValueError(f"per-layer inputs with hidden_act={spec.hidden_act!r} are not supported (gelu_pytorch_tanh, "
                     "silu)")


class PerLayerInputs(nn.Module):
    """The first stage's ``embed_tokens_per_layer`` (``embedding``), ``per_layer_model_projection``
    (``projection``) and ``per_layer_projection_norm`` (``norm``)."""

    def __init__(self, spec: DecoderSpec, config, padded_vocab: int, device=None):
        super().__init__()
        self.spec = spec
        width = spec.per_layer_input_width
        self.embedding = mtp.VocabParallelEmbedding(padded_vocab, width, init_method=no_init, config=config,
                                                    reduce_scatter_embeddings=bool(config.sequence_parallel))
        self.projection = nn.Linear(spec.hidden_size, width, bias=False, dtype=config.params_dtype, device=device)
        self.norm = norm_class(spec)(spec.per_layer_input_size, spec.rms_norm_eps, config.params_dtype, device)

    def forward(self, embeds: torch.Tensor, ids: torch.Tensor, *, transpose: bool, no_grad_at_pad) -> torch.Tensor:
        """``embeds``: the scaled token embeddings (the activations' rows, ``[S, B, H]`` / ``[T (/ tp), 1, H]``);
        ``ids``: the token ids the embedding looked up (``[B, S]`` / ``[1, T]``); ``transpose``: the lookup comes
        back batch-first (no sequence parallelism). Returns every layer's input, ``[.., L * P]``."""
        spec = self.spec
        p = spec.per_layer_input_size
        tok = self.embedding(ids)
        if transpose:
            tok = tok.transpose(0, 1).contiguous()
        tok = no_grad_at_pad(tok, ids)
        tok = tok * torch.tensor(p ** 0.5, dtype=torch.float32, device=tok.device).to(tok.dtype)
        proj = self.projection(embeds) * spec.hidden_size ** -0.5
        proj = self.norm(proj.view(*proj.shape[:-1], spec.num_layers, p))
        return ((proj + tok.view_as(proj)) * 2.0 ** -0.5).flatten(-2)


class PerLayerInput(nn.Module):
    """One layer's ``per_layer_input_gate`` (``gate``), ``per_layer_projection`` (``proj``) and
    ``post_per_layer_input_norm`` (``norm``)."""

    def __init__(self, spec: DecoderSpec, config, layer: int, device=None):
        super().__init__()
        p, dtype = spec.per_layer_input_size, config.params_dtype
        self.columns = slice(layer * p, (layer + 1) * p)
        self.act = _act(spec)
        self.gate = nn.Linear(spec.hidden_size, p, bias=False, dtype=dtype, device=device)
        self.proj = nn.Linear(p, spec.hidden_size, bias=False, dtype=dtype, device=device)
        self.norm = norm_class(spec)(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """``x`` plus this layer's per-layer term; ``inputs``: every layer's, ``[.., L * P]``."""
        return x + self.norm(self.proj(self.act(self.gate(x)) * inputs[..., self.columns]))


def join(x: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor:
    """What crosses a pipeline-stage boundary: the hidden state and the per-layer inputs side by side."""
    return x if inputs is None else torch.cat([x, inputs], dim=-1)


def split(wire: torch.Tensor, spec: DecoderSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`join`'s inverse on the receiving stage: ``(hidden state, per-layer inputs or None)``."""
    if not spec.per_layer_input_size:
        return wire, None
    x, inputs = wire.split([spec.stream_width, spec.per_layer_input_width], dim=-1)
    return x, inputs
