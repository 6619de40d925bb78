"""DeepSeek-V4's attention rows of the weight table (parallm.families.deepseek_v4_attention): every attention
tensor transformers' ``save_pretrained`` writes for a tiny ``DeepseekV4ForCausalLM`` (sliding, CSA and HCA layers)
is named by exactly one row on exactly its layers, with its shape; the rows' local names are the layer's
parameters (frozen exactly where ``trained=False``); a load through the rows' layouts (tp 1 and 2) and the merge
back are bit exact."""

from __future__ import annotations

import torch
import v4_attention_cases as cases


def _hub(tmp_path):
    """(config, the saved checkpoint's attention tensors, each layer's in-memory attention state under parallm's
    local names)."""
    from safetensors.torch import load_file
    from transformers import DeepseekV4ForCausalLM

    from parallm.verify.reference import randomize_weights
    cfg = cases.hf_config()
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(cfg)
    randomize_weights(model, 2)
    model.save_pretrained(tmp_path)
    state = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    modules = [{cases.RENAMES.get(k, k): v.detach().clone() for k, v in layer.self_attn.state_dict().items()}
               for layer in model.model.layers]
    return cfg, {k: v for k, v in state.items() if ".attn." in k}, modules


def test_rows_cover_the_checkpoint(tmp_path, world_of_one):
    """Names, shapes, conditions, local names, frozen parameters; a tp-1 load through the rows equals the
    transformers module's own state (the name mapping is right, not only the shapes); tp-2 shards merge back bit
    for bit."""
    from parallm.families.deepseek_v4_attention import V4_ATTENTION_ROWS
    from parallm.model.decoder import make_config
    from parallm.model.layers.v4_attention import V4Attention
    from parallm.model.sharding import make_layout
    from parallm.model.table import resolve_shape
    cfg, hub, modules = _hub(tmp_path)
    spec = cases.parallm_spec(cfg)
    config = make_config(tp=1, pp=1, vpp=None, dtype=torch.float32, sequence_parallel=False)
    seen = {}
    for layer, kind in enumerate(spec.v4.layer_kinds):
        rows = [r for r in V4_ATTENTION_ROWS if r.applies_to_layer(spec, layer)]
        names = {r.hf[0].format(i=layer): r for r in rows}
        assert len(names) == len(rows)
        for name, r in names.items():
            assert name in hub, (kind, name)
            assert tuple(hub[name].shape) == resolve_shape(r.shapes[0], spec), (name, hub[name].shape)
        seen.update(names)
        attn = V4Attention(spec, config, 1, layer_number=layer)
        params = dict(attn.named_parameters())
        bf16 = make_config(tp=1, pp=1, vpp=None, dtype=torch.bfloat16, sequence_parallel=False)
        for n, p in V4Attention(spec, bf16, 1, layer_number=layer).named_parameters():
            row = next(r for r in rows if r.local.endswith("self_attention." + n))
            assert (p.dtype == torch.float32) == row.keep_fp32, n
        assert sorted(params) == sorted(r.local.split("self_attention.")[1] for r in rows), kind
        for name, r in names.items():
            local = r.local.split("self_attention.")[1]
            shard = make_layout(r.kind, spec, 0).shard([hub[name]], 0, 1)
            assert torch.equal(shard, modules[layer][local]), (name, local)
            assert params[local].requires_grad == r.trained, local
            assert tuple(params[local].shape) == tuple(shard.shape), local
            parts = [make_layout(r.kind, spec, 0).shard([hub[name]], k, 2) for k in range(2)]
            assert torch.equal(make_layout(r.kind, spec, 0).merge(parts)[0], hub[name]), name
    assert sorted(seen) == sorted(hub)
