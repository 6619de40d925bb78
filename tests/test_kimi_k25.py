"""Kimi-K2.5 / K2.6 (``KimiK25ForConditionalGeneration``) with compressed-tensors INT4 experts, against
transformers 5.25's ``Kimi_K25ForConditionalGeneration`` in fp32 (docs/families.md).

The checkpoint is built here as the released ones are laid out: the DeepSeek-V3 language model under
``language_model.model.*`` / ``language_model.lm_head.weight`` (a tiny DeepseekV3 model's Hub tensors, every
weight non-trivial, the selection bias random), the MoonViT tower and projector in their released names
(``vision_tower.encoder.blocks.{i}.wqkv`` ...: random tensors of the shapes parallm derives from
``vision_config``; transformers' own conversion mapping loads them with no key missing or unexpected), and
every routed expert quantised by compressed-tensors' ``pack-quantized`` definition, written out below (int4
values, eight per int32 word, value ``j`` at bits ``4j``, stored as ``value + 8``; a bf16 scale per group of
columns; asymmetric zero points packed the same way along rows; ``weight_shape``). The reference
dequantisation is written here from that definition too; transformers runs on a directory holding it (fp32).
Cases (one spawn of 4 ranks):

* Kimi's scheme (symmetric, group 32, ``quantization_config`` in ``text_config``) at tp2·dp2 padded: logits, the
  dequantised weights bit for bit (``save_hf_weights``: every language-model tensor equal to the reference
  dequantisation, every vision tensor equal to the checkpoint's bytes), a broadcast load equal to the slice load,
  a directory save re-loaded (tensors identical; transformers loads it too, in the parent);
* an asymmetric scheme (zero points, group 16, config at the top level) at tp2·ep2 packed + sequence parallel:
  log-probs against transformers' ``log_softmax``;
* pp2·ep2 (2 microbatches): one SGD step against the same step in transformers: loss, output after, every
  language-model weight after (experts compared through transformers' stacked tensors), the tower unchanged.
"""

from __future__ import annotations

import copy
import json
import os
import re

import pytest
import torch

import helpers
from test_deepseek import set_selection_bias
from test_deepseek_parts import deepseek_config

from parallm.verify.reference import causal_lm_loss, hf_output  # noqa: E402

LR = 0.5
WORLD = 4
EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
              num_hidden_layers=2, hidden_size=16, intermediate_size=24, merge_kernel_size=[2, 2])
# Kimi-K2.5's ignore list (and the tower's), the experts targeted as Linear modules
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
          "re:vision_tower.*", "re:mm_projector.*"]


# -- compressed-tensors pack-quantized, from its definition --------------------------------------------------

def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] ``[rows, cols]`` -> int32 ``[rows, ceil(cols / 8)]``: value ``j`` of each group of 8
    at bits ``4j`` as the nibble ``value + 8`` (compressed-tensors' ``pack_to_int32``, padding nibbles 0)."""
    rows, cols = values.shape
    nib = (values.to(torch.int64) + 8)
    nib = torch.nn.functional.pad(nib, (0, -cols % 8))
    words = torch.zeros(rows, nib.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        words |= nib[:, j::8] << (4 * j)
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)     # the 32 bits as a signed int32


def unpack_rows(words: torch.Tensor, cols: int, *, order=range(8)) -> torch.Tensor:
    """The inverse of :func:`pack_rows` (``order``: which nibble holds value ``j``; reversed for a break)."""
    out = torch.empty(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    w = words.to(torch.int64) & 0xFFFFFFFF
    for j, at in enumerate(order):
        out[:, j::8] = ((w >> (4 * at)) & 0xF) - 8
    return out[:, :cols]


def quantize(w: torch.Tensor, group: int, symmetric: bool) -> dict:
    """compressed-tensors' INT4 group quantization of ``w`` ``[rows, cols]``: bf16 scales (amax / 7 symmetric;
    (max - min) / 15 with an int zero point otherwise), values ``clamp(round(w / s + z), -8, 7)``; the packed
    tensors as a checkpoint stores them."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    if symmetric:
        scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).to(torch.bfloat16)
        zero = torch.zeros(rows, cols // group)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-6).to(torch.bfloat16)
        zero = (-8 - torch.round(lo / scale.float())).clamp(-8, 7)
    q = torch.round(g / scale.float()[..., None] + zero[..., None]).clamp(-8, 7).reshape(rows, cols)
    out = {"weight_packed": pack_rows(q), "weight_scale": scale,
           "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}
    if not symmetric:
        assert zero.abs().sum() > 0
        out["weight_zero_point"] = pack_rows(zero.t()).t().contiguous()
    return out


def dequantize(parts: dict, group: int, *, zero=True, order=range(8)) -> torch.Tensor:
    """The reference: ``(q - z) * s`` in the scale's dtype (bf16), per compressed-tensors' ``dequantize``."""
    rows, cols = parts["weight_shape"].tolist()
    q = unpack_rows(parts["weight_packed"], cols, order=order).to(torch.bfloat16)
    if zero and "weight_zero_point" in parts:
        z = unpack_rows(parts["weight_zero_point"].t(), rows).t()
        q = q - z.repeat_interleave(group, 1).to(torch.bfloat16)
    return q * parts["weight_scale"].repeat_interleave(group, 1)


def quant_config(group: int, symmetric: bool) -> dict:
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                          "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                      "group_size": group, "symmetric": symmetric,
                                                      "dynamic": False, "actorder": None}}},
            "ignore": IGNORE, "kv_cache_scheme": None}


# -- the checkpoint ---------------------------------------------------------------------------------------------

def kimi_checkpoint(tmp, seed: int, *, group: int, symmetric: bool, in_text: bool):
    """(INT4 dir, dequantised dir, the dequantised wrapper state dict, the wrapper config dict)."""
    from parallm.families.kimi_k25 import vision_tensors
    text_cfg = deepseek_config()
    model = helpers.make_hf_model(text_cfg, seed=seed)
    set_selection_bias(model, seed=seed + 1)
    hub = helpers.hub_state_dict(model, str(tmp / f"hub{seed}"))
    text = dict(text_cfg.to_dict(), model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": text, "vision_config": VISION, "projection_hidden_size": 16,
              "tie_word_embeddings": False}
    g = torch.Generator().manual_seed(seed + 2)
    state = {"language_model." + k: v for k, v in hub.items()}
    state.update({k: torch.randn(s, generator=g) for k, s in vision_tensors(config, text_cfg.hidden_size)})
    quantized, deq = {}, {}
    for name, t in state.items():
        if EXPERT.match(name):
            parts = quantize(t, group, symmetric)
            quantized.update({name[:-len("weight")] + k: v for k, v in parts.items()})
            deq[name] = dequantize(parts, group).float()
        else:
            quantized[name] = deq[name] = t
    deq_dir = helpers.write_ckpt(str(tmp / f"deq{seed}"), deq, config)
    qc = quant_config(group, symmetric)
    qconfig = json.loads(json.dumps(config))
    if in_text:
        qconfig["text_config"]["quantization_config"] = qc
    else:
        qconfig["quantization_config"] = qc
    int4_dir = helpers.write_ckpt(str(tmp / f"int4_{seed}"), quantized, qconfig)
    return int4_dir, deq_dir, deq, quantized


def load_reference(path: str):
    """transformers' Kimi_K25ForConditionalGeneration of a checkpoint in the released names: nothing missing or
    unexpected (the names parallm reads and writes are the ones transformers' conversion mapping takes)."""
    from transformers import Kimi_K25ForConditionalGeneration
    model, info = Kimi_K25ForConditionalGeneration.from_pretrained(path, output_loading_info=True,
                                                                    attn_implementation="eager",
                                                                    dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.float().eval()


def reference_step(model, ids, mask, pieces):
    model = copy.deepcopy(model)
    model.zero_grad()
    size = ids.shape[0] // pieces
    loss = torch.stack([causal_lm_loss(hf_output(model, ids[i:i + size], mask[i:i + size]), ids[i:i + size],
                                       mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask)
    return loss.item(), wrapper_state(model), after


def wrapper_state(model) -> dict:
    """transformers' language-model tensors in the released names (stacked experts split per expert)."""
    out = {}
    for k, v in model.state_dict().items():
        if not k.startswith(("model.language_model.", "lm_head.")):
            continue
        name = ("language_model.model." + k[len("model.language_model."):] if k.startswith("model.")
                else "language_model." + k)
        m = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = v.detach().clone()
            continue
        for e in range(v.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{m.group(1)}.{e}.down_proj.weight"] = v[e].detach().clone()
            else:
                half = v.shape[1] // 2
                out[f"{m.group(1)}.{e}.gate_proj.weight"] = v[e, :half].detach().clone()
                out[f"{m.group(1)}.{e}.up_proj.weight"] = v[e, half:].detach().clone()
    return out


# name, scheme (group, symmetric, config in text_config), layout, build kwargs, options
CASES = [
    ("kimi scheme (sym, group 32) tp2 dp2 padded, save round trip", (32, True, True),
     dict(tp=2, pp=1, ep=1, nmb=1), {}, dict(save=True)),
    ("asymmetric group 16 tp2 ep2 packed+SP logprobs", (16, False, False),
     dict(tp=2, pp=1, ep=2, nmb=1), {"packed": True, "sequence_parallel": True}, dict(logprobs=True)),
    ("kimi scheme pp2 ep2 mb2 SGD step", (32, True, True),
     dict(tp=1, pp=2, ep=2, nmb=2), {"layers_per_stage": [1, 2]}, dict(step=True)),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, (group, sym, in_text), layout, build, opts) in enumerate(CASES):
        int4, deq_dir, deq, quantized = kimi_checkpoint(tmp_path, 40 + 10 * i, group=group, symmetric=sym,
                                                        in_text=in_text)
        ref_model = load_reference(deq_dir)
        ids, mask = helpers.padded_batch(101, seed=i, batch=8, seq=9)
        with torch.no_grad():
            ref = hf_output(ref_model, ids, mask)
        case = dict(name=name, ckpt=int4, deq=deq, ids=ids, mask=mask, build=build, ref=ref, opts=opts,
                    vision={k: v for k, v in quantized.items() if not k.startswith("language_model.")},
                    out=str(tmp_path / f"saved{i}"), **layout)
        if opts.get("logprobs"):
            lp = ref[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            case["ref_logprobs"] = torch.cat([lp, torch.zeros(ids.shape[0], 1)], dim=1)
        if opts.get("step"):
            dp = WORLD // (layout["tp"] * layout["pp"])
            case["ref_loss"], case["ref_new"], case["ref_after"] = reference_step(ref_model, ids, mask,
                                                                                  dp * layout["nmb"])
        cases.append(case)
    return cases


def _built(case, path, mode="slice"):
    import parallm
    chunks = parallm.build_model(path, **case["build"])
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, path, mode=mode)
    return chunks


def rank_cases(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], ep=case["ep"])
        lay, ids, mask, opts = current_dims(), case["ids"], case["mask"], case["opts"]
        chunks = _built(case, case["ckpt"])
        got = parallm.forward(chunks, ids, mask)
        res = dict(fwd=helpers.max_diff_real(got, case["ref"], mask))
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:       # the dequantised weights bit for bit, the tower's bytes as the checkpoint holds them
            helpers.assert_same_state(sd, case["deq"])
            assert all(torch.equal(sd[k], v) for k, v in case["vision"].items())
        if opts.get("logprobs"):
            lp = parallm.forward(chunks, ids, mask, output="logprobs")
            keep = (mask[:, 1:] * mask[:, :-1]).bool()
            res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][:, :-1][keep]).abs().max().item()
        if opts.get("save"):
            other = _built(case, case["ckpt"], mode="broadcast")
            assert torch.equal(parallm.forward(other, ids, mask), got), case["name"]
            parallm.save_hf_weights(chunks, case["out"])
            again = _built(case, case["out"])
            assert torch.equal(parallm.forward(again, ids, mask), got), case["name"]
            sd2 = parallm.save_hf_weights(again)
            if rank == 0:
                helpers.assert_same_state(sd2, sd)
            del other, again
        if opts.get("step"):
            res.update(_step(chunks, case, lay, rank))
        out.append(res)
        parallm.destroy_parallel()
    return out


def _step(chunks, case, lay, rank) -> dict:
    import parallm
    ids, mask = case["ids"], case["mask"]
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=causal_lm_loss, num_microbatches=case["nmb"])
    parallm.finalize_grads(chunks)
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                if p.requires_grad:
                    p -= LR * p.grad
    res = dict(loss=abs(loss.item() - case["ref_loss"]),
               after=helpers.max_diff_real(parallm.forward(chunks, ids, mask), case["ref_after"], mask))
    new = parallm.save_hf_weights(chunks)
    if rank == 0:
        ref = case["ref_new"]
        lm = {k: v for k, v in new.items() if k.startswith("language_model.")}
        assert lm.keys() == ref.keys(), sorted(set(lm) ^ set(ref))[:6]
        res["weights"] = max((lm[k] - ref[k]).abs().max().item() for k in ref)
        assert all(torch.equal(new[k], v) for k, v in case["vision"].items())     # the tower never trains
    return res


@pytest.mark.timeout(600)
def test_kimi_k25_int4_parity_round_trip_and_step(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases, timeout=580)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd = max(r["fwd"] for r in per_rank)
        lp = max(r.get("logprobs", 0.0) for r in per_rank)
        loss, after = max(r.get("loss", 0.0) for r in per_rank), max(r.get("after", 0.0) for r in per_rank)
        wdiff = per_rank[0].get("weights", 0.0)
        print(f"{case['name']:<55} fwd {fwd:.1e} logprobs {lp:.1e} loss {loss:.1e} weights {wdiff:.1e} "
              f"after {after:.1e}")
        assert fwd < 2e-5 and lp < 2e-5, case["name"]
        assert loss < 2e-5 and wdiff < 2e-5 and after < 5e-5, case["name"]
    saved = cases[0]["out"]      # parallm's save: the wrapper's names, loadable by transformers, no INT4 left
    with open(os.path.join(saved, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and "quantization_config" not in cfg["text_config"]
    with torch.no_grad():
        again = hf_output(load_reference(saved), cases[0]["ids"], cases[0]["mask"])
    assert torch.equal(again, cases[0]["ref"])
