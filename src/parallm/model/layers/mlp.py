"""The gated MLP on megatron-core's parallel linears: the dense decoder layer's MLP and Qwen2-MoE's shared
expert (which adds a gate of its own in :mod:`parallm.model.layers.moe`)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...parallel.megatron_import import import_megatron
from ..spec import DecoderSpec

mtp = import_megatron().tensor_parallel


# the gate's activation of the gated MLP, by the config's hidden_act
GATE_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def no_init(_weight):  # parameters are filled by the loader (or by init_weights)
    return None


class MLP(nn.Module):
    """``down(silu(gate x) * up x)``: gate and up fused in a column-parallel ``linear_fc1`` (``[gate_r; up_r]`` per
    TP rank), down row-parallel; ``hidden_act="relu2"`` (Nemotron-H): ``down(relu(up x)^2)``, ungated,
    ``linear_fc1`` up alone; ``hidden_act="gelu_pytorch_tanh"`` (Gemma): ``down(gelu_tanh(gate x) * up x)``,
torch's tanh-approximated GELU as transformers' ``GELUTanh``. ``width`` (default: the spec's intermediate size) and ``bias`` (default: the spec's
    ``mlp_bias``). ``limit`` (DeepSeek-V4's shared expert, transformers' ``DeepseekV4MLP``): the gate clamped
    above at ``limit`` and up to ``[-limit, limit]`` before ``silu(gate) * up``."""

    def __init__(self, spec: DecoderSpec, config, *, width: int | None = None, bias: bool | None = None,
                 limit: float | None = None):
        super().__init__()
        self.limit = limit
        if limit is not None and spec.hidden_act != "silu":
            raise ValueError(f"the clamped gated MLP (limit={limit}) is a SiLU MLP, not hidden_act="
                             f"{spec.hidden_act!r}")
        width = spec.intermediate_size if width is None else width
        bias = spec.mlp_bias if bias is None else bias
        # relu2 (Nemotron-H): no gate, ``down(relu(up x)^2)``, linear_fc1 is up alone
        self.gated = spec.hidden_act != "relu2"
        self.act = GATE_ACTIVATIONS.get(spec.hidden_act, F.silu)
        self.linear_fc1 = mtp.ColumnParallelLinear(spec.hidden_size, (2 if self.gated else 1) * width, config=config,
                                                   init_method=no_init, bias=bias, gather_output=False)
        self.linear_fc2 = mtp.RowParallelLinear(width, spec.hidden_size, config=config, init_method=no_init,
                                                bias=bias, input_is_parallel=True, skip_bias_add=False)

    def forward(self, x):
        h, _ = self.linear_fc1(x)
        if not self.gated:
            h, _ = self.linear_fc2(torch.square(F.relu(h)))
            return h
        gate, up = h.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        h, _ = self.linear_fc2(self.act(gate) * up)
        return h
