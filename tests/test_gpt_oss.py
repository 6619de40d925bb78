"""gpt-oss end to end against transformers 5.25 in fp32 (docs/families.md), at every layout of issue 48.

One spawn of 4 ranks runs every case of CASES in turn (``init_parallel`` per case). The tiny model (hidden 64, 4
heads of 16, 2 KV heads, 4 experts top-2 of width 32, window 4 on the even layers, YaRN with ``truncate`` False)
has every weight non-trivial; its sinks are large (N(0.5, 1)) and its ``swiglu_limit`` small (0.3), and the
parent checks that both matter: transformers' own output moves by > 1e-2 without the sinks, and the clamp bites
on a good share of the experts' activations. Rows are 24 tokens (6 x the window; under cp2 each row's four
zigzag chunks hold 6 tokens, more than the window) in the four padding kinds (none, left, right, both). Per case:

* load (every parameter NaN first) -> ``forward`` vs transformers at real positions, and ``output="logprobs"``
  vs transformers' ``log_softmax``;
* ``save_hf_weights`` on rank 0 == the checkpoint's tensors (transformers' stacked expert tensors), bit for
  bit; ``export_hf_tensors`` yields every per-expert tensor (``mlp.experts.{e}.gate_up_proj`` ...) exactly
  once, each the slab of the stacked tensor, bit-exact, in ``export_metadata``'s order;
* one SGD step (``forward_backward`` + ``finalize_grads`` + ``p -= lr * grad``) vs the same step in
  transformers: the loss, the gradient norm (``clip_grad_norm_``: each element once), every weight after it
  (sinks, router and expert biases included), the output after;
* some cases also save a directory (transformers reloads it) and load in the other mode.
"""

from __future__ import annotations

import collections
import copy
import os

import pytest
import torch

import helpers
from test_gpt_oss_parts import gpt_oss_config, quantize_mxfp4

from parallm.verify.reference import causal_lm_loss, hf_output, value_loss  # noqa: E402

LR = 0.5
WORLD = 4
SEQ = 24


def strengthen_sinks(model, seed: int) -> None:
    """Sinks of the size trained gpt-oss models have (around the attention logits' own), so that a sink dropped
    or counted twice shows in the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.copy_(0.5 + torch.randn(p.shape, generator=g))


def sink_effect(model, ids, mask, task) -> float:
    """How far transformers' own output moves when every sink is -inf (dropped)."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in other.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.fill_(float("-inf"))
        return helpers.max_diff_real(hf_output(other, ids, mask, task=task), hf_output(model, ids, mask, task=task),
                                     mask)


def clamp_share(model, ids, mask, task) -> float:
    """The share of the experts' gate / up activations that the SwiGLU's clamp changes in transformers' forward
    (gate above the limit, up outside it), over every layer."""
    cls = type(model.model.layers[0].mlp.experts)
    original, seen = cls._apply_gate, []

    def counting(self, gate_up):
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        seen.append(((gate > self.limit).float().mean() + (up.abs() > self.limit).float().mean()).item() / 2)
        return original(self, gate_up)
    cls._apply_gate = counting
    try:
        with torch.no_grad():
            hf_output(model, ids, mask, task=task)
    finally:
        cls._apply_gate = original
    return sum(seen) / len(seen)


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over ``pieces`` equal slices of the batch of the task loss; SGD step; (loss, state dict after, output
    after)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    loss_fn = value_loss if task == "value" else causal_lm_loss
    size = ids.shape[0] // pieces
    loss = torch.stack([loss_fn(hf_output(model, ids[i:i + size], mask[i:i + size], task=task), ids[i:i + size],
                                mask[i:i + size]) for i in range(0, ids.shape[0], size)]).mean()
    loss.backward()
    norm = torch.stack([p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None]).sum().sqrt()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
        after = hf_output(model, ids, mask, task=task)
    return loss.item(), helpers.hub_state_dict(model, tmp), after, norm.item()


# -- MXFP4 ----------------------------------------------------------------------------------------------------------

def mxfp4_checkpoint(model, tmp, ckpt: str, *, declared: bool = True):
    """Write ``model``'s experts as MXFP4 to ``ckpt`` (biases, router, attention, embeddings unquantised, as
    OpenAI ships gpt-oss) and return (transformers' model of that checkpoint, dequantised by transformers on load,
    and its state dict): the reference of an MXFP4 load."""
    from transformers import AutoModelForCausalLM, Mxfp4Config
    hub = helpers.hub_state_dict(model, str(tmp / "hub"))
    out = {}
    for name, t in hub.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[name + "_blocks"], out[name + "_scales"] = quantize_mxfp4(t)
        else:
            out[name] = t
    config = model.config.to_dict()
    if declared:
        config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    helpers.write_ckpt(ckpt, out, config)
    if not declared:
        return None, None
    ref = AutoModelForCausalLM.from_pretrained(ckpt, quantization_config=Mxfp4Config(dequantize=True),
                                               dtype=torch.float32, attn_implementation="eager").float().eval()
    return ref, {k: v.detach().clone() for k, v in ref.state_dict().items()}


# name, config overrides, layout, build kwargs, options
CASES = [
    ("tp2 padded (left / right / both), logprobs, dir save + reload", {}, dict(tp=2), {},
     dict(save_dir=True)),
    ("tp2 ep2 packed+SP (8 documents)", {}, dict(tp=2, ep=2), {"packed": True, "sequence_parallel": True}, {}),
    ("pp2 recompute=full", {}, dict(pp=2), {"recompute": "full"}, {}),
    ("pp2 vpp2 (4 layers) dp2 ep2", dict(num_hidden_layers=4), dict(pp=2, vpp=2, ep=2), {}, {}),
    ("cp2 dp2 ep2 packed ring (window 4 < a CP piece's 6)", {}, dict(cp=2, ep=2), {"packed": True,
                                                                                      "cp_attn": "ring"}, {}),
    ("tp2 cp2 all-gather padded", {}, dict(tp=2, cp=2), {"cp_attn": "allgather"}, {}),
    ("tp4 (2 KV heads, each on 2 ranks; 1 sink per rank)", {}, dict(tp=4), {}, {}),
    ("value tp2 ep2, broadcast load", {}, dict(tp=2, ep=2), {"task": "value"}, dict(mode="broadcast")),
    ("MXFP4 experts tp2 ep2, bf16 dir save", {}, dict(tp=2, ep=2), {}, dict(mxfp4=True, save_dir=True)),
]


def make_cases(tmp_path):
    cases = []
    for i, (name, overrides, layout, build, opts) in enumerate(CASES):
        task = build.get("task", "causal_lm")
        cfg = gpt_oss_config(**overrides)
        model = helpers.make_hf_model(cfg, seed=60 + i, task=task)
        strengthen_sinks(model, seed=200 + i)
        ckpt = str(tmp_path / f"m{i}")
        if opts.get("mxfp4"):
            model, ckpt_sd = mxfp4_checkpoint(model, tmp_path / f"mx{i}", ckpt)
            mxfp4_checkpoint(model, tmp_path / f"mx-undeclared{i}", str(tmp_path / f"undeclared{i}"),
                             declared=False)
        else:
            ckpt_sd = helpers.hub_state_dict(model, ckpt)
        ids, mask = helpers.padded_batch(cfg.vocab_size, seed=i, batch=8, seq=SEQ)
        tp, pp, cp = layout.get("tp", 1), layout.get("pp", 1), layout.get("cp", 1)
        dp = WORLD // (tp * pp * cp)
        loss, new_sd, after, norm = reference_step(model, ids, mask, dp, task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref = hf_output(model, ids, mask, task=task)
        case = dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref, ref_sd=ckpt_sd,
                    ref_loss=loss, ref_norm=norm, ref_new_sd=new_sd, ref_after=after, opts=opts,
                    tmp=str(tmp_path / f"out{i}"),
                    sinks=sink_effect(model, ids, mask, task), clamp=clamp_share(model, ids, mask, task),
                    layout=dict(tp=tp, pp=pp, cp=cp, vpp=layout.get("vpp"), ep=layout.get("ep", 1)))
        if task == "causal_lm":
            lp = ref[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            case["ref_logprobs"] = torch.cat([lp, torch.zeros(ids.shape[0], 1)], dim=1)
        if opts.get("mxfp4"):
            case["undeclared"] = str(tmp_path / f"undeclared{i}")
        cases.append(case)
    return cases


def _load(chunks, ckpt, mode):
    import parallm
    helpers.nan_fill(chunks)
    parallm.load_hf_weights(chunks, ckpt, mode=mode)


def _stacked_slab(ref_sd: dict, name: str):
    """The per-expert name ``...mlp.experts.{e}.X`` -> slab e of ``...mlp.experts.X`` (None: not an expert's)."""
    head, sep, tail = name.partition(".mlp.experts.")
    if not sep or not tail.split(".")[0].isdigit():
        return None
    e, rest = tail.split(".", 1)
    return ref_sd[f"{head}.mlp.experts.{rest}"][int(e)]


def _export_check(chunks, case) -> int:
    import parallm
    names = []
    for name, t in parallm.export_hf_tensors(chunks):
        names.append(name)
        want = _stacked_slab(case["ref_sd"], name)
        want = case["ref_sd"][name] if want is None else want
        assert torch.equal(t, want), (case["name"], name)
    assert names == [m.name for m in parallm.export_metadata(chunks)], case["name"]     # what it says it yields
    dup = [n for n, k in collections.Counter(names).items() if k > 1]
    assert not dup, (case["name"], dup)
    stacked = {n for n in case["ref_sd"] if ".mlp.experts." in n}
    plain = set(case["ref_sd"]) - stacked
    assert plain <= set(names), (case["name"], sorted(plain - set(names))[:4])
    assert len(names) == len(plain) + sum(case["ref_sd"][n].shape[0] for n in stacked), case["name"]
    return len(names)


def rank_cases(rank, world, cases):
    import parallm
    from parallm.errors import CheckpointError
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        lay = case["layout"]
        parallm.init_parallel(tp=lay["tp"], pp=lay["pp"], vpp=lay["vpp"], cp=lay["cp"], ep=lay["ep"])
        dims = current_dims()
        opts, ids, mask, task = case["opts"], case["ids"], case["mask"], case["task"]
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        mode = opts.get("mode", "slice")
        _load(chunks, case["ckpt"], mode)
        got = parallm.forward(chunks, ids, mask)
        res = dict(fwd=helpers.max_diff_real(got, case["ref"], mask))
        if task == "causal_lm":
            lp = parallm.forward(chunks, ids, mask, output="logprobs")
            keep = (mask[:, 1:] * mask[:, :-1]).bool()
            res["logprobs"] = (lp[:, :-1][keep] - case["ref_logprobs"][:, :-1][keep]).abs().max().item()
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            helpers.assert_same_state(sd, case["ref_sd"])
        res["exported"] = _export_check(chunks, case)
        if mode == "broadcast" or opts.get("save_dir"):
            other = parallm.build_model(case["ckpt"], **case["build"])
            _load(other, case["ckpt"], "slice" if mode == "broadcast" else "broadcast")
            assert torch.equal(parallm.forward(other, ids, mask), got), case["name"]
            del other
        if "undeclared" in case:        # MXFP4 tensors in a checkpoint whose config does not declare them
            other = parallm.build_model(case["undeclared"], **case["build"])
            with pytest.raises(CheckpointError, match="no quantization_config with quant_method 'mxfp4'"):
                parallm.load_hf_weights(other, case["undeclared"])
            del other
        per = ids.shape[0] // dims.dp
        sl = slice(dims.dp_rank * per, (dims.dp_rank + 1) * per)
        loss_fn = value_loss if task == "value" else causal_lm_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn)
        parallm.finalize_grads(chunks)
        # every element once: the replicated down bias (TP rank 0 its owner), the sinks split with the heads
        norm = parallm.clip_grad_norm_(chunks, 1e9).item()
        res["norm"] = abs(norm - case["ref_norm"]) / case["ref_norm"]
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    if p.requires_grad:
                        p -= LR * p.grad
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            res["weights"] = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
            res["sinks_moved"] = min((new_sd[k] - case["ref_sd"][k]).abs().max().item() for k in ref_new
                                     if k.endswith("sinks"))
        if opts.get("save_dir"):
            dtype = torch.bfloat16 if opts.get("mxfp4") else None
            parallm.save_hf_weights(chunks, case["tmp"], dtype=dtype)
            if rank == 0:
                res["dir"] = _dir_check(case, new_sd, dtype)
        res.update(loss=abs(loss.item() - case["ref_loss"]), after=helpers.max_diff_real(after, case["ref_after"],
                                                                                          mask))
        out.append(res)
        parallm.destroy_parallel()
    return out


def _dir_check(case, new_sd, dtype) -> str:
    """The saved directory holds exactly ``new_sd`` (in ``dtype``) under transformers' names, no quantization
    config, and transformers loads it with nothing missing or unexpected."""
    import json

    from safetensors.torch import load_file

    from parallm.verify.reference import load_transformers
    files = {}
    for f in os.listdir(case["tmp"]):
        if f.endswith(".safetensors"):
            files.update(load_file(os.path.join(case["tmp"], f)))
    want = {k: v.to(dtype) if dtype else v for k, v in new_sd.items()}
    helpers.assert_same_state(files, want)
    with open(os.path.join(case["tmp"], "config.json")) as fh:
        assert "quantization_config" not in json.load(fh)
    _, info = load_transformers(case["tmp"], task=case["task"])
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return "ok"


@pytest.mark.timeout(900)
def test_gpt_oss_every_layout_against_transformers(tmp_path):
    cases = make_cases(tmp_path)
    results = helpers.run_ranks(rank_cases, WORLD, cases, timeout=880)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        lp = max(r.get("logprobs", 0.0) for r in per_rank)
        print(f"{case['name']:<58} sinks {case['sinks']:.1e} clamp {case['clamp']:.2f} fwd {fwd:.1e} "
              f"logprobs {lp:.1e} loss {loss:.1e} weights {wdiff:.1e} after {after:.1e}")
        assert case["sinks"] > 1e-2 and case["clamp"] > 0.05, case["name"]     # both matter in this model
        assert fwd < 2e-5 and lp < 2e-5, case["name"]
        assert loss < 2e-5 and wdiff < 2e-5 and after < 5e-5, case["name"]
        assert max(r["norm"] for r in per_rank) < 1e-5, case["name"]      # gradient norm, relative
        assert per_rank[0]["sinks_moved"] > 1e-4, case["name"]                  # the sinks trained
        if case["opts"].get("save_dir"):
            assert per_rank[0]["dir"] == "ok", case["name"]
