"""DeepSeek-V4 training checkpoints across layouts (docs/families.md, "DeepSeek-V4: training checkpoints").

One spawn of 4 ranks, the tiny V4 of tests/test_deepseek_v4.py (sliding / CSA / HCA layers, hash and routed MoE
layers, 2 hyper-connection streams): at tp2·ep2 one token-mean AdamW step, a training checkpoint (model +
optimizer), a second step (the uninterrupted run); then at pp2·ep2 (the streams crossing the stage boundary, the
experts on other ranks) the checkpoint loaded into a model never loaded from HF, saved again, and the second step
taken. Checked: both checkpoints hold the same tensors bit for bit (model, AdamW's moments and step counters),
the int64 ``tid2eid`` tables stored as int64 and equal to the HF checkpoint's (no optimizer state: frozen), the
resumed model's HF weights equal the saved model's bit for bit, and the step after the resume equals the
uninterrupted step (another layout: fp32 reduction order only). The same in bf16: the tensors transformers keeps
in fp32 (hyper-connections, norms, sinks, the correction bias) are stored fp32 and survive, the rest bf16 with
fp32 master weights.
"""

from __future__ import annotations

import os

import pytest
import torch

import helpers
from test_deepseek_v4 import SEQ, V4, cut_gap, make_model, right_padded_batch, v4_config

WORLD = 4
LR, EPS = 1e-3, 1e-3
# one AdamW step at another layout: gradients differ by fp32 reduction order (<~5e-7), the update by <~ dg / eps
TOL = LR * 5e-7 / EPS * 3


def _token_mean(out, ids, mask):
    lp = out[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp.gather(-1, ids[:, 1:, None]).squeeze(-1) * m).sum(), m.sum()


def _step(parallm, chunks, opt, ids, mask):
    from parallm.parallel.state import current_dims
    lay = current_dims()
    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=_token_mean, num_microbatches=2)
    parallm.finalize_grads(chunks)
    opt.step()
    opt.zero_grad()


def _run(parallm, ckpt, batches, root, dtype, tag):
    out = {}
    parallm.init_parallel(tp=2, ep=2)
    chunks = parallm.build_model(ckpt, dtype=dtype)
    parallm.load_hf_weights(chunks, ckpt)
    opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS, weight_decay=0.1)
    _step(parallm, chunks, opt, *batches[0])
    parallm.save_checkpoint(os.path.join(root, f"{tag}-tp2ep2"), chunks, opt, step=1)
    out["at_save"] = parallm.save_hf_weights(chunks)
    _step(parallm, chunks, opt, *batches[1])
    out["uninterrupted"] = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()

    parallm.init_parallel(pp=2, ep=2)
    chunks = parallm.build_model(ckpt, dtype=dtype)
    helpers.nan_fill(chunks)
    opt = parallm.build_optimizer(chunks, lr=123.0, eps=EPS, weight_decay=0.1)
    assert parallm.load_checkpoint(os.path.join(root, f"{tag}-tp2ep2"), chunks, opt)["step"] == 1
    assert all(g["lr"] == LR for g in opt.param_groups)
    parallm.save_checkpoint(os.path.join(root, f"{tag}-pp2ep2"), chunks, opt, step=1)
    out["resumed"] = parallm.save_hf_weights(chunks)
    _step(parallm, chunks, opt, *batches[1])
    out["after_resume"] = parallm.save_hf_weights(chunks)
    parallm.destroy_parallel()
    return out


def rank_resume(rank, world, ckpt, batches, root):
    import parallm
    res = {tag: _run(parallm, ckpt, batches, root, dtype, tag)
           for tag, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))}
    return res if rank == 0 else None


def _batches():
    for seed in range(40, 60):
        model = make_model(v4_config(), seed=seed)
        ids, mask = right_padded_batch(V4["vocab_size"], batch=8, seq=SEQ, seed=seed)
        ids2, mask2 = right_padded_batch(V4["vocab_size"], batch=8, seq=SEQ, seed=seed + 500)
        if min(cut_gap(model, ids, mask), cut_gap(model, ids2, mask2)) > 1e-4:   # no near-tie at the indexer's cut
            return model, [(ids, mask), (ids2, mask2)]
    raise AssertionError("no seed without a near-tie in the indexer's top-k")


def _check_same_checkpoints(root, tag, hub):
    from parallm.checkpoint.training import read_tensors
    saved, again = read_tensors(os.path.join(root, f"{tag}-tp2ep2")), read_tensors(os.path.join(root, f"{tag}-pp2ep2"))
    assert saved.keys() == again.keys(), sorted(set(saved) ^ set(again))
    bad = [k for k in saved if saved[k].dtype != again[k].dtype or not torch.equal(saved[k], again[k])]
    assert not bad, (tag, bad[:5])
    tables = [k for k in saved if k.endswith("tid2eid")]
    assert tables and all(k.startswith("model/") for k in tables), tables          # frozen: no optimizer state
    for k in tables:
        assert saved[k].dtype == torch.int64 and torch.equal(saved[k], hub[k[len("model/"):]]), k
    assert any(k.startswith("optim/exp_avg/") and k.endswith("hc_attn_fn") for k in saved)
    return saved


@pytest.mark.timeout(900)
def test_v4_training_checkpoint_tp2ep2_to_pp2ep2(tmp_path):
    model, batches = _batches()
    ckpt = str(tmp_path / "hf")
    hub = helpers.hub_state_dict(model, ckpt)
    root = str(tmp_path / "train")
    res = helpers.run_ranks(rank_resume, WORLD, ckpt, batches, root, timeout=880)[0]
    for tag in ("fp32", "bf16"):
        r = res[tag]
        stored = _check_same_checkpoints(root, tag, hub)
        helpers.assert_same_state(r["resumed"], r["at_save"])
        moved = max((r["at_save"][k].float() - hub[k].float()).abs().max().item() for k in hub)
        assert moved > 1e-4, "the AdamW step moved nothing"
        ref, got = r["uninterrupted"], r["after_resume"]
        worst = max(((got[k].float() - ref[k].float()).abs().max().item(), k) for k in ref)
        print(f"{tag}: {len(stored)} stored tensors bit-exact at pp2·ep2; step after resume vs uninterrupted "
              f"{worst[0]:.2e} ({worst[1]}); first step moved the weights by up to {moved:.2e}")
        if tag == "fp32":
            assert worst[0] < TOL, worst
        else:
            # bf16 weights: the step updates fp32 master weights, so the rounding of the stored bf16 copy is the
            # bound (one bf16 ulp of the weight's magnitude)
            fp32 = sorted(k for k, v in stored.items() if k.startswith("model/") and v.dtype == torch.float32)
            for name in ("hc_attn_fn", "hc_ffn_scale", "attn_norm.weight", "model.norm.weight", "attn.attn_sink",
                         "gate.bias", "model.hc_head.hc_fn"):
                assert any(k.endswith(name) for k in fp32), (name, fp32)
            assert stored["model/model.layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
            assert stored["optim/master/model.layers.1.attn.wq_a.weight"].dtype == torch.float32
            bad = [k for k in ref if ref[k].dtype != got[k].dtype or
                   (got[k].float() - ref[k].float()).abs().max() > 2 ** -7 * ref[k].float().abs().max() + 1e-6]
            assert not bad, bad[:5]
