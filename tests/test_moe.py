"""Mixture of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers in fp32, under expert parallelism.

One spawn of 4 ranks runs every case of CASES in turn (init_parallel(tp, pp, ep=...) per case). Per case:

* slice load (every parameter pre-filled with NaN, so a skipped expert shows) -> ``forward`` logits / values vs
  transformers at real positions < 2e-5;
* ``save_hf_weights`` on rank 0 == the files transformers' ``save_pretrained`` wrote (per-expert Hub names,
  bit-exact, same key set);
* a broadcast load of the same layout gives identical outputs;
* one SGD step (``forward_backward`` + ``finalize_grads`` + ``p -= lr * p.grad``) vs the same step on the
  transformers model (loss, saved weights after the step in Hub names, outputs after the step), with the
  load-balancing loss in the objective when the config sets ``output_router_logits``;
* every expert parameter has a gradient after the backward, before ``finalize_grads`` (which would fill a missing
  one with zeros): a tensor, never None.

A second spawn checks, before ``finalize_grads``, that experts no token chose took part in the backward with an
exactly-zero gradient (and chosen ones got a non-zero one).
"""

from __future__ import annotations

import copy

import pytest
import torch

import helpers

LR = 0.5
WORLD = 4


# the harness's losses: the same functions the CLI's verify and the dense tests use
from parallm.verify.reference import causal_lm_loss as ce_loss  # noqa: E402
from parallm.verify.reference import value_loss  # noqa: E402


def hf_forward(model, ids, mask, task):
    """(what parallm.forward returns, the per-MoE-layer router logits)."""
    import parallm
    pos = parallm.default_position_ids(mask)
    if task == "value":
        out = model.model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
        return model.score(out.last_hidden_state).squeeze(-1).float(), out.router_logits
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    return out.logits.float(), out.router_logits


def per_layer_balance_loss(router_logits, config, mask) -> torch.Tensor:
    """The reference load-balancing term: transformers' own ``load_balancing_loss_func`` applied to each MoE
    layer alone, summed over layers (what parallm documents it computes)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return sum(load_balancing_loss_func((lg,), experts, config.num_experts_per_tok, mask) for lg in router_logits)


def reference_step(model, ids, mask, pieces, task, tmp):
    """Mean over equal batch pieces of (task loss + coef * balance loss when on); SGD step; returns (loss, Hub
    state dict after, output after)."""
    model = copy.deepcopy(model)
    model.zero_grad()
    cfg = model.config
    coef = cfg.router_aux_loss_coef if cfg.output_router_logits else 0.0
    loss_fn = value_loss if task == "value" else ce_loss
    size = ids.shape[0] // pieces
    losses = []
    for i in range(0, ids.shape[0], size):
        out, router = hf_forward(model, ids[i:i + size], mask[i:i + size], task)
        loss = loss_fn(out, ids[i:i + size], mask[i:i + size])
        if coef:
            loss = loss + coef * per_layer_balance_loss(router, cfg, mask[i:i + size])
        losses.append(loss)
    loss = torch.stack(losses).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
        after, _ = hf_forward(model, ids, mask, task)
    return loss.item(), helpers.hub_state_dict(model, tmp), after


# name, family, config overrides, layout (tp, pp, [vpp,] ep, nmb), build kwargs
CASES = [
    ("qwen3-moe tp1 ep4 dp4 8 experts mlp_only[1] step1", "qwen3_moe",
     dict(num_hidden_layers=2, num_experts=8, mlp_only_layers=[1]), dict(tp=1, pp=1, ep=4, nmb=1), {}),
    ("qwen3-moe tp1 ep2 dp4 (edp 2) sparse_step 2 no-norm", "qwen3_moe",
     dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, attention_bias=True),
     dict(tp=1, pp=1, ep=2, nmb=2), {}),
    ("qwen3-moe tp2 ep2 nkv1 aux-loss", "qwen3_moe",
     dict(num_hidden_layers=2, num_key_value_heads=1, output_router_logits=True, router_aux_loss_coef=0.3),
     dict(tp=2, pp=1, ep=2, nmb=1), {}),
    ("qwen2-moe tp1 pp2 ep2 shared expert tied mb2 aux", "qwen2_moe",
     dict(num_hidden_layers=4, tie_word_embeddings=True, mlp_only_layers=[2], output_router_logits=True,
          router_aux_loss_coef=0.2),
     dict(tp=1, pp=2, ep=2, nmb=2), {}),
    ("qwen3-moe pp2 vpp2 ep2 mb2 tied", "qwen3_moe", dict(num_hidden_layers=4, tie_word_embeddings=True),
     dict(tp=1, pp=2, vpp=2, ep=2, nmb=2), {}),
    ("mixtral tp2 pp2 ep1", "mixtral", dict(num_hidden_layers=4, vocab_size=99), dict(tp=2, pp=2, ep=1, nmb=1), {}),
    ("qwen3-moe packed+SP tp2 ep2 aux", "qwen3_moe",
     dict(num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.3),
     dict(tp=2, pp=1, ep=2, nmb=1), {"packed": True, "sequence_parallel": True}),
    ("qwen3-moe tp2 ep2 aux-loss recompute mb2", "qwen3_moe",
     dict(num_hidden_layers=2, output_router_logits=True, router_aux_loss_coef=0.3),
     dict(tp=2, pp=1, ep=2, nmb=2), {"recompute": "full"}),
    ("qwen2-moe value tp2 ep2 packed+SP", "qwen2_moe", dict(num_hidden_layers=2),
     dict(tp=2, pp=1, ep=2, nmb=1), {"task": "value", "packed": True, "sequence_parallel": True}),
    ("mixtral value tp1 ep4", "mixtral", dict(num_hidden_layers=2), dict(tp=1, pp=1, ep=4, nmb=1),
     {"task": "value"}),
]


def make_cases(tmp_path, specs):
    cases = []
    for i, (name, family, overrides, layout, build) in enumerate(specs):
        task = build.get("task", "causal_lm")
        cfg = helpers.tiny_config(family, **overrides)
        model = helpers.make_hf_model(cfg, seed=30 + i, task=task)
        ckpt = str(tmp_path / f"m{i}")
        ckpt_sd = helpers.hub_state_dict(model, ckpt)
        if i % 2 == 0:  # also a sharded checkpoint with an index
            helpers.save_checkpoint(model, ckpt, max_shard_size="60KB")
        ids, mask = helpers.padded_batch(cfg.vocab_size, seed=i, batch=8, seq=9)
        dp = WORLD // (layout["tp"] * layout["pp"])
        loss, new_sd, after = reference_step(model, ids, mask, dp * layout["nmb"], task, str(tmp_path / f"s{i}"))
        with torch.no_grad():
            ref, _ = hf_forward(model, ids, mask, task)
        cases.append(dict(name=name, ckpt=ckpt, ids=ids, mask=mask, build=build, task=task, ref=ref,
                          ref_sd=ckpt_sd, ref_loss=loss, ref_new_sd=new_sd, ref_after=after, **layout))
    return cases


def rank_cases(rank, world, cases):
    import parallm
    from parallm.model.placement import placement_of
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case.get("vpp"), ep=case["ep"])
        lay = current_dims()
        assert (lay.ep, lay.edp) == (case["ep"], lay.dp // case["ep"])
        chunks = parallm.build_model(case["ckpt"], **case["build"])
        _check_attributes(chunks, lay)
        helpers.nan_fill(chunks)
        parallm.load_hf_weights(chunks, case["ckpt"], mode="slice")
        ids, mask = case["ids"], case["mask"]
        got = parallm.forward(chunks, ids, mask)
        fwd = helpers.max_diff_real(got, case["ref"], mask)
        if lay.pp > 1 and lay.ep > 1:
            # replicas of different batch sizes (5 and 3) exchange tokens in every MoE layer: by default they
            # agree on one microbatch count (uneven microbatches of the 5); given counts that differ are refused
            sl = slice(0, 5) if lay.dp_rank == 0 else slice(5, 8)
            part = parallm.forward(chunks, ids[sl], mask[sl])
            fwd = max(fwd, helpers.max_diff_real(part, case["ref"][sl], mask[sl]))
            with pytest.raises(ValueError, match="same num_microbatches"):
                parallm.forward(chunks, ids[sl], mask[sl], num_microbatches=1 + lay.dp_rank)
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            helpers.assert_same_state(sd, case["ref_sd"])
        else:
            assert sd == {}
        chunks_b = parallm.build_model(case["ckpt"], **case["build"])
        helpers.nan_fill(chunks_b)
        parallm.load_hf_weights(chunks_b, case["ckpt"], mode="broadcast")
        assert torch.equal(parallm.forward(chunks_b, ids, mask), got), case["name"]
        del chunks_b
        per = ids.shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        loss_fn = value_loss if case["task"] == "value" else ce_loss
        loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=loss_fn, num_microbatches=case["nmb"])
        # before finalize_grads, which fills a missing gradient with zeros: the backward itself reached every expert
        experts = [(n, p) for c in chunks for n, p in c.named_parameters() if placement_of(p).expert is not None]
        assert experts and all(p.grad is not None for _, p in experts), case["name"]
        parallm.finalize_grads(chunks)
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p -= LR * p.grad
        after = parallm.forward(chunks, ids, mask)
        new_sd = parallm.save_hf_weights(chunks)
        wdiff = None
        if rank == 0:
            ref_new = case["ref_new_sd"]
            assert new_sd.keys() == ref_new.keys(), sorted(set(new_sd) ^ set(ref_new))
            wdiff = max((new_sd[k] - ref_new[k]).abs().max().item() for k in ref_new)
        out.append(dict(fwd=fwd, loss=abs(loss.item() - case["ref_loss"]), weights=wdiff,
                        after=helpers.max_diff_real(after, case["ref_after"], mask)))
        parallm.destroy_parallel()
    return out


def _check_attributes(chunks, lay):
    """megatron-core's marks: the stacked expert weights (this rank's experts along dim 0) ``allreduce=False``
    under ep > 1 (True at ep = 1) and TP-split like a dense MLP within each expert; the router and the shared
    expert's gate replicated with ``sequence_parallel`` set as norms. At most 8 parameter tensors per MoE layer."""
    from parallm.model.placement import placement_of
    for c in chunks:
        per_layer = {}
        for name, p in c.named_parameters():
            pl = placement_of(p)
            layer = name.split(".")[1] if name.startswith("layers.") else None
            if name.endswith(("mlp.experts.linear_fc1.weight", "mlp.experts.linear_fc2.weight")):
                assert pl.expert == lay.expert_range(c.spec.moe.num_experts) and p.shape[0] == len(pl.expert), name
                assert p.allreduce is (lay.ep == 1), name
                assert p.tensor_model_parallel and p.partition_dim == (1 if "fc1" in name else 2), name
            else:
                assert pl.expert is None, name
            if ".mlp." in name:
                per_layer[layer] = per_layer.get(layer, 0) + 1
            if name.endswith(("router.weight", "gate_weight")):
                assert p.sequence_parallel is c.sequence_parallel and not p.tensor_model_parallel, name
                assert pl.tp_sum is c.sequence_parallel, name
        assert max(per_layer.values()) <= 8, per_layer


@pytest.mark.timeout(900)
def test_moe_parity_round_trip_and_sgd_step(tmp_path):
    cases = make_cases(tmp_path, CASES)
    results = helpers.run_ranks(rank_cases, WORLD, cases, timeout=880)
    print()
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        fwd, loss = max(r["fwd"] for r in per_rank), max(r["loss"] for r in per_rank)
        after, wdiff = max(r["after"] for r in per_rank), per_rank[0]["weights"]
        print(f"{case['name']:<52} fwd {fwd:.1e} loss {loss:.1e} weights {wdiff:.1e} after {after:.1e}")
        assert fwd < 2e-5, case["name"]
        assert loss < 2e-5, case["name"]
        assert wdiff < 2e-5, case["name"]
        assert after < 5e-5, case["name"]


# -- every expert of every layer, once: load / export / save at many layouts ---------------------------------

COVERAGE_CONFIG = dict(num_hidden_layers=4, num_experts=8, mlp_only_layers=[1])   # layers 0, 2, 3 route
LAYOUTS_4 = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 1), (2, 1, 2), (1, 2, 1), (1, 2, 2), (2, 2, 1)]
LAYOUTS_8 = [(2, 1, 4), (1, 2, 4), (2, 2, 2)]      # (tp, pp, ep)


def _expert_names(names, experts):
    """HF names of routed-expert tensors among ``names``, and the subset that belongs to ``experts``."""
    import re
    pattern = re.compile(r"\.mlp\.experts\.(\d+)\.")
    routed = {n for n in names if pattern.search(n)}
    return routed, {n for n in routed if int(pattern.search(n).group(1)) in experts}


def rank_coverage(rank, world, ckpt, layouts, ref_sd, ids, mask, ref_logits, out_root):
    import collections
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    import parallm
    from parallm.checkpoint import hf_dir
    from parallm.parallel.state import current_dims
    reads = []
    original_read = hf_dir.SliceSource.read

    def recording_read(self, dim, start, stop):
        reads.append(self.name)
        return original_read(self, dim, start, stop)

    hf_dir.SliceSource.read = recording_read
    received = []
    original_recv = dist.recv

    def counting_recv(tensor, *args, **kwargs):
        out = original_recv(tensor, *args, **kwargs)
        if tensor.numel() > 1:
            received.append(tensor.numel())
        return out

    dist.recv = counting_recv
    report = []
    for tp, pp, ep in layouts:
        parallm.init_parallel(tp=tp, pp=pp, ep=ep)
        lay = current_dims()
        where = f"tp={tp} pp={pp} ep={ep} rank {rank}"
        chunks = parallm.build_model(ckpt)
        mine = lay.expert_range(8)
        # slice load reads exactly this rank's experts (all of them, no other)
        reads.clear()
        parallm.load_hf_weights(chunks, ckpt, mode="slice")
        read_experts, _ = _expert_names(set(reads), mine)
        local_names = {n for c in chunks for n in _hf_names_of(c, lay)}
        routed_local, _ = _expert_names(local_names, mine)
        assert read_experts == routed_local and _expert_names(routed_local, mine)[1] == routed_local, where
        assert routed_local, where
        logits = parallm.forward(chunks, ids, mask)
        assert helpers.max_diff_real(logits, ref_logits, mask) < 2e-5, where
        # broadcast load: each rank receives its own shards only (rank 0 reads, sends nothing to itself)
        chunks_b = parallm.build_model(ckpt)
        received.clear()
        parallm.load_hf_weights(chunks_b, ckpt, mode="broadcast")
        own = sum(p.numel() for c in chunks_b for p in c.parameters())
        assert sum(received) == (0 if rank == 0 else own), (where, sum(received), own)
        assert torch.equal(parallm.forward(chunks_b, ids, mask), logits), where
        del chunks_b
        # export stream: every tensor once, on every rank, equal to the checkpoint
        names = []
        for name, t in parallm.export_hf_tensors(chunks):
            names.append(name)
            assert torch.equal(t, ref_sd[name]), (where, name)
        dup = [n for n, k in collections.Counter(names).items() if k > 1]
        assert not dup and set(names) == set(ref_sd), (where, dup, sorted(set(ref_sd) ^ set(names))[:5])
        # dict save on rank 0
        sd = parallm.save_hf_weights(chunks)
        if rank == 0:
            assert sd.keys() == ref_sd.keys() and all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd), where
        # parallel directory save (several files)
        out = os.path.join(out_root, f"tp{tp}-pp{pp}-ep{ep}")
        parallm.save_hf_weights(chunks, out, max_shard_size="60KB")
        if rank == 0:
            files = [f for f in sorted(os.listdir(out)) if f.endswith(".safetensors")]
            seen = collections.Counter()
            merged = {}
            for f in files:
                part = load_file(os.path.join(out, f))
                seen.update(part.keys())
                merged.update(part)
            assert len(files) > 1 and all(k == 1 for k in seen.values()), where
            assert merged.keys() == ref_sd.keys() and all(torch.equal(merged[k], ref_sd[k]) for k in ref_sd), where
        report.append((tp, pp, ep, len(routed_local), len(names)))
    hf_dir.SliceSource.read = original_read
    dist.recv = original_recv
    return report


def _hf_names_of(chunk, lay):
    """HF names of the tensors a chunk holds (from the same table the loader reads)."""
    from parallm.families import family_of
    from parallm.model.table import chunk_entries
    spec = chunk.spec
    entries = chunk_entries(family_of(spec).table, spec, task=chunk.task, pp=lay.pp, pre_process=chunk.pre_process,
                            post_process=chunk.post_process, layers=chunk.layer_range,
                            experts=lay.expert_range(spec.moe.num_experts))
    return [n for e in entries for n in e.hf]


@pytest.fixture(scope="module")
def coverage_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_coverage")
    cfg = helpers.tiny_config("qwen2_moe", **COVERAGE_CONFIG)
    model = helpers.make_hf_model(cfg, seed=5)
    ckpt = str(root / "ckpt")
    ref_sd = helpers.hub_state_dict(model, ckpt)
    helpers.save_checkpoint(model, ckpt, max_shard_size="60KB")
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=3, batch=3, seq=6)
    return ckpt, ref_sd, ids, mask, helpers.hf_logits(model, ids, mask), root


def _check_coverage(report, layouts, ref_sd):
    experts_total = sum(1 for n in ref_sd if ".mlp.experts." in n)   # 3 MoE layers x 8 experts x 3 tensors
    assert experts_total == 3 * 8 * 3
    for (tp, pp, ep), row in zip(layouts, report[0]):
        assert row[:3] == (tp, pp, ep) and row[4] == len(ref_sd), row


@pytest.mark.timeout(600)
def test_every_expert_once_at_every_layout_world4(coverage_model):
    ckpt, ref_sd, ids, mask, ref_logits, root = coverage_model
    report = helpers.run_ranks(rank_coverage, 4, ckpt, LAYOUTS_4, ref_sd, ids, mask, ref_logits, str(root / "w4"),
                               timeout=580)
    _check_coverage(report, LAYOUTS_4, ref_sd)


@pytest.mark.timeout(600)
def test_every_expert_once_at_ep4_with_tp_or_pp_world8(coverage_model):
    ckpt, ref_sd, ids, mask, ref_logits, root = coverage_model
    report = helpers.run_ranks(rank_coverage, 8, ckpt, LAYOUTS_8, ref_sd, ids, mask, ref_logits, str(root / "w8"),
                               timeout=580)
    _check_coverage(report, LAYOUTS_8, ref_sd)


# -- errors on every rank; zero gradients for experts nobody chose ---------------------------------------------

def rank_errors(rank, world, ckpt_e6, ckpt_missing, ckpt_e16, batches, chosen):
    import parallm
    from parallm.errors import CheckpointError
    from parallm.model.placement import placement_of
    from parallm.parallel.state import current_dims
    out = {}
    with pytest.raises(ValueError) as e:
        parallm.init_parallel(tp=1, pp=1, ep=3)
    out["ep_dp"] = str(e.value)
    parallm.init_parallel(tp=1, pp=1, ep=4)
    with pytest.raises(ValueError) as e:
        parallm.build_model(ckpt_e6)
    out["experts_ep"] = str(e.value)
    parallm.init_parallel(tp=2, pp=1, ep=2)
    for mode in ("slice", "broadcast"):
        chunks = parallm.build_model(ckpt_missing)
        with pytest.raises(CheckpointError) as e:
            parallm.load_hf_weights(chunks, ckpt_missing, mode=mode)
        out[f"missing_{mode}"] = str(e.value)
    # zero gradients: 16 experts over ep=4, one token per rank
    parallm.init_parallel(tp=1, pp=1, ep=4)
    lay = current_dims()
    chunks = parallm.build_model(ckpt_e16)
    parallm.load_hf_weights(chunks, ckpt_e16)
    ids = batches[lay.dp_rank]
    parallm.forward_backward(chunks, ids, torch.ones_like(ids), loss_fn=lambda o, i, m: o.pow(2).mean())
    # checked before finalize_grads (which fills a missing gradient with zeros): an expert no token chose still
    # ran (on an empty batch) in the backward, so it has a gradient, and that gradient is exactly zero
    zero, nonzero = [], []
    for c in chunks:
        for layer in c.layers:
            for p in layer.mlp.experts.parameters():   # stacked: [local expert, ...]
                assert placement_of(p).expert == lay.expert_range(16)
                assert p.grad is not None, layer.layer_number
                for x, e in enumerate(lay.expert_range(16)):
                    unchosen = e not in chosen[layer.layer_number]
                    (zero if unchosen else nonzero).append(bool((p.grad[x] == 0).all()) == unchosen)
    out["grads"] = (zero, nonzero)
    parallm.finalize_grads(chunks)
    nmb = 2 if rank == 0 else 1
    with pytest.raises(ValueError) as e:
        parallm.forward_backward(chunks, ids.repeat(nmb, 1), torch.ones_like(ids.repeat(nmb, 1)),
                                 loss_fn=lambda o, i, m: o.pow(2).mean(), num_microbatches=nmb)
    out["nmb"] = str(e.value)
    return out


@pytest.mark.timeout(400)
def test_moe_errors_on_every_rank_and_zero_grads_for_unchosen_experts(tmp_path):
    import os

    from safetensors.torch import load_file, save_file
    six = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", num_experts=6), seed=1)
    ckpt_e6 = helpers.save_checkpoint(six, str(tmp_path / "e6"))
    ckpt_missing = helpers.save_checkpoint(helpers.make_hf_model(helpers.tiny_config("mixtral"), seed=2),
                                           str(tmp_path / "missing"))
    path = os.path.join(ckpt_missing, "model.safetensors")
    state = load_file(path)
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    del state[gone]
    save_file(state, path, metadata={"format": "pt"})
    cfg16 = helpers.tiny_config("qwen3_moe", num_experts=16)
    model16 = helpers.make_hf_model(cfg16, seed=3)
    ckpt_e16 = helpers.save_checkpoint(model16, str(tmp_path / "e16"))
    batches = [torch.tensor([[7 + 13 * r]]) for r in range(WORLD)]
    with torch.no_grad():   # which experts the 4 tokens choose in each layer, by transformers
        routers = [model16(input_ids=b, output_router_logits=True).router_logits for b in batches]
    chosen = {layer: {int(e) for r in routers for e in r[layer].topk(2, dim=-1).indices.flatten()}
              for layer in range(cfg16.num_hidden_layers)}
    assert all(0 < len(c) < 16 for c in chosen.values()), chosen
    results = helpers.run_ranks(rank_errors, WORLD, ckpt_e6, ckpt_missing, ckpt_e16, batches, chosen)
    for r in results:
        assert "ep=3 does not divide the data-parallel size dp=4" in r["ep_dp"], r["ep_dp"]
        assert "num_experts=6 is not divisible by ep=4" in r["experts_ep"], r["experts_ep"]
        for mode in ("slice", "broadcast"):
            assert gone in r[f"missing_{mode}"] and "missing" in r[f"missing_{mode}"], r[f"missing_{mode}"]
        assert "same num_microbatches; got [2, 1, 1, 1]" in r["nmb"], r["nmb"]
        zero, nonzero = r["grads"]
        assert zero and nonzero and all(zero) and all(nonzero), r["grads"]


# -- parallm.verify (the harness behind `parallm verify --ep`) on a MoE checkpoint --------------------------------

def rank_verify(rank, world, check):
    from parallm import verify
    return verify.check_layout(check)


@pytest.mark.timeout(300)
def test_verify_harness_passes_a_moe_checkpoint_under_expert_parallelism(tmp_path):
    from parallm import verify
    model = helpers.make_hf_model(helpers.tiny_config("qwen2_moe", num_hidden_layers=2), seed=4)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    check = verify.Check(ckpt, str(tmp_path / "saved"), tp=2, ep=2, label="qwen2-moe")
    row = helpers.run_ranks(rank_verify, WORLD, check)[0]
    assert row["layout"] == "tp2 dp2 ep2", row["layout"]
    assert row["ok"] and row["roundtrip"] and row["reload"], row


# -- fused checkpoints: transformers 5's in-memory layout loads too ------------------------------------------------

FUSED_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def rank_fused(rank, world, cases):
    """Each case: the in-memory state dict saved as safetensors (fused names) -> slice load, a state dict on rank 0
    only -> broadcast load; logits vs transformers, saved Hub tensors bit-exact; each rank reads only its own
    experts' slabs of the fused tensors."""
    import parallm
    from parallm.checkpoint import hf_dir
    from parallm.parallel.state import current_dims
    reads = []
    original = hf_dir.SliceSource.read

    def recording(self, dim, start, stop):
        reads.append((self.name, dim, start, stop))
        return original(self, dim, start, stop)

    hf_dir.SliceSource.read = recording
    out = []
    try:
        for case in cases:
            parallm.init_parallel(tp=2, ep=2)
            lay = current_dims()
            chunks = parallm.build_model(case["fused"])
            helpers.nan_fill(chunks)
            reads.clear()
            parallm.load_hf_weights(chunks, case["fused"], mode="slice")
            stacked = {(n, s) for n, d, s, e in reads if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
            assert stacked and {s for _, s in stacked} == set(lay.expert_range(case["experts"])), sorted(stacked)
            logits = parallm.forward(chunks, case["ids"], case["mask"])
            sd = parallm.save_hf_weights(chunks)
            if rank == 0:
                helpers.assert_same_state(sd, case["hub"])
            chunks_b = parallm.build_model(case["fused"])
            helpers.nan_fill(chunks_b)
            parallm.load_hf_weights(chunks_b, case["memory"] if rank == 0 else None, mode="broadcast")
            assert torch.equal(parallm.forward(chunks_b, case["ids"], case["mask"]), logits), case["family"]
            out.append(helpers.max_diff_real(logits, case["ref"], case["mask"]))
            parallm.destroy_parallel()
    finally:
        hf_dir.SliceSource.read = original
    return out


@pytest.mark.timeout(300)
def test_fused_checkpoints_load_at_tp2_ep2(tmp_path):
    """A checkpoint (or state dict) in transformers 5's in-memory MoE layout (mlp.experts.gate_up_proj [E, 2I, H],
    mlp.experts.down_proj [E, H, I], Mixtral's router as mlp.gate) loads by slice and broadcast like the Hub's
    per-expert tensors."""
    from safetensors.torch import save_file
    cases = []
    for i, family in enumerate(FUSED_FAMILIES):
        cfg = helpers.tiny_config(family)
        model = helpers.make_hf_model(cfg, seed=40 + i)
        memory = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        assert any(k.endswith("experts.gate_up_proj") for k in memory)
        hub = helpers.hub_state_dict(model, str(tmp_path / f"hub{i}"))
        fused = tmp_path / f"fused{i}"
        model.config.save_pretrained(fused)
        save_file(memory, str(fused / "model.safetensors"), metadata={"format": "pt"})
        ids, mask = helpers.padded_batch(cfg.vocab_size, seed=i, batch=4, seq=7)
        cases.append(dict(family=family, fused=str(fused), memory=memory, hub=hub, ids=ids, mask=mask,
                          experts=4, ref=helpers.hf_logits(model, ids, mask)))
    results = helpers.run_ranks(rank_fused, 4, cases)
    for i, case in enumerate(cases):
        worst = max(r[i] for r in results)
        assert worst < 2e-5, (case["family"], worst)


def test_a_fused_tensor_of_the_wrong_shape_is_named(tmp_path):
    """No process group: the loader's check names the fused tensor and both shapes."""
    from parallm.checkpoint.load_checks import check_checkpoint
    from parallm.errors import CheckpointError
    from parallm.families import spec_from_config
    from parallm.model.table import expected_hf_shapes, fused_layout
    model = helpers.make_hf_model(helpers.tiny_config("qwen3_moe"), seed=1)
    spec, family = spec_from_config(model.config)
    present = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = expected_hf_shapes(family.table, spec, task="causal_lm", pp=1)
    fused = fused_layout(family.table, spec, task="causal_lm", pp=1)
    _, _, parts = check_checkpoint(present, spec, "causal_lm", expected, strict=True, where="sd", fused=fused)
    assert set(parts) == {n for n in expected if ".experts." in n}
    bad = "model.layers.1.mlp.experts.down_proj"
    present[bad] = (4, 64, 16)
    with pytest.raises(CheckpointError, match=rf"{bad}: checkpoint \(4, 64, 16\) vs model \(4, 64, 32\)"):
        check_checkpoint(present, spec, "causal_lm", expected, strict=True, where="sd", fused=fused)


# -- the dispatch: each TP rank sends its share, one host read per layer ------------------------------------------

SYNC_OPS = ("nonzero", "bincount", "_local_scalar_dense", "masked_select", "unique", "_unique", "_unique2")


def _count_host_reads(fn):
    """Run ``fn()``; count the calls that read device values on the host: Tensor.tolist / item / __bool__ /
    __int__ / numpy / cpu, and aten ops that do so inside (nonzero, bincount, unique, masked_select,
    repeat_interleave without output_size). Returns (result, {what: count})."""
    from torch.utils._python_dispatch import TorchDispatchMode
    counts = {}
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__", "__int__", "numpy",
                                                                  "cpu")}

    def counting(name):
        def wrapper(self, *a, **k):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](self, *a, **k)
        return wrapper

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.__name__.split(".")[0]
            if name in SYNC_OPS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                    and isinstance(args[0], torch.Tensor) and len(args) < 3):
                counts[name] = counts.get(name, 0) + 1
            return func(*args, **kwargs)

    for name in originals:
        setattr(torch.Tensor, name, counting(name))
    try:
        with Ops():
            result = fn()
    finally:
        for name, f in originals.items():
            setattr(torch.Tensor, name, f)
    return result, counts


def rank_dispatch(rank, world, ckpt, layouts):
    import torch.distributed as dist

    import parallm
    from parallm.parallel.experts import share_sizes
    from parallm.parallel.state import current_dims
    sent = []
    original = dist.all_to_all_single

    def recording(out, inp, out_splits=None, in_splits=None, **kw):
        if inp.dim() == 2:                 # rows (the counts exchange is 1-D)
            sent.append(inp.shape[0])
        return original(out, inp, out_splits, in_splits, **kw)

    dist.all_to_all_single = recording
    report = []
    try:
        for tp, ep, sp in layouts:
            parallm.init_parallel(tp=tp, ep=ep)
            lay = current_dims()
            chunks = parallm.build_model(ckpt, packed=sp, sequence_parallel=sp)
            parallm.load_hf_weights(chunks, ckpt)
            block = chunks[0].layers[0].mlp
            tokens = 12                                    # per data-parallel replica
            g = torch.Generator().manual_seed(lay.dp_rank)  # the same replica on every TP rank
            x = torch.randn(tokens, 1, block.hidden, generator=g)
            if sp:
                x = x.narrow(0, lay.tp_rank * tokens // tp, tokens // tp)   # this rank's sequence-parallel share
            x.requires_grad_(True)
            sent.clear()
            out, forward = _count_host_reads(lambda: block(x))
            rows_sent = sent[:1] + [len(sent)]     # the dispatch's rows, and all-to-alls in all (there and back)
            _, backward = _count_host_reads(lambda: (out * torch.linspace(-1, 1, block.hidden)).sum().backward())
            mine = (tokens // tp if sp else share_sizes(tokens, tp)[lay.tp_rank]) if tp > 1 else tokens
            report.append(dict(layout=(tp, ep, sp), shares=block.shares, forward=forward, backward=backward,
                               rows_sent=rows_sent, expected=[mine * block.top_k, 2] if ep > 1 else [0],
                               grad=x.grad is not None and bool(torch.isfinite(x.grad).all())))
            parallm.destroy_parallel()
    finally:
        dist.all_to_all_single = original
    return report


@pytest.mark.timeout(300)
def test_dispatch_sends_each_tp_ranks_share_with_one_host_read_per_layer(tmp_path):
    """At ep > 1 under TP each TP rank all-to-alls only its share of the slots (the TP group together sends every
    slot once: tokens x k, not tp x that), with and without sequence parallelism; at every layout a MoE layer's
    forward reads device values on the host once (the dispatch's sizes: one ``tolist``) and its backward never."""
    model = helpers.make_hf_model(helpers.tiny_config("qwen3_moe", num_experts=8), seed=6)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "m"))
    layouts = [(2, 2, False), (2, 2, True), (2, 1, False), (2, 1, True), (1, 4, False)]
    results = helpers.run_ranks(rank_dispatch, 4, ckpt, layouts)
    for per_rank in zip(*results):
        for r in per_rank:
            assert r["rows_sent"] == r["expected"], r
            assert r["shares"] == (r["layout"][0] > 1 and r["layout"][1] > 1), r
            assert r["forward"] == {"tolist": 1}, r
            assert r["backward"] == {}, r
            assert r["grad"], r


def test_inspect_describes_experts_kernel_and_memory_per_expert_rank(tmp_path):
    """`parallm inspect` (no process group) on a Qwen2-MoE checkpoint: experts, top-k, parameter tensors per MoE
    layer, the expert kernel build_model would choose here (the same function), per-rank parameters at --ep 2
    smaller by half the routed experts; a fused (in-memory layout) checkpoint passes the check with a note."""
    from safetensors.torch import save_file

    from parallm import inspect_checkpoint
    from parallm.cli.inspect import render
    from parallm.model.layers.moe import expert_kernel
    model = helpers.make_hf_model(helpers.tiny_config("qwen2_moe"), seed=2)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "hub"))
    one = inspect_checkpoint(ckpt, tp=1, dp=2)
    two = inspect_checkpoint(ckpt, tp=1, dp=2, ep=2)
    moe = one["moe"]
    assert (moe["experts"], moe["top_k"], moe["layers"], moe["tensors_per_layer"]) == (4, 2, 2, 6), moe
    assert moe["kernel"] == expert_kernel("cpu", torch.float32, (64, 64, 32)) == "grouped_mm", moe
    routed = 2 * 4 * 3 * 64 * 32            # layers x experts x (gate, up, down) x H x I
    assert one["layout"]["stages"][0]["params"] - two["layout"]["stages"][0]["params"] == routed // 2
    text = render(two)
    assert "torch._grouped_mm on cpu" in text and "(ep 2)" in text and "6 parameter tensors per MoE layer" in text
    fused = tmp_path / "fused"
    model.config.save_pretrained(fused)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(fused / "model.safetensors"))
    report = inspect_checkpoint(str(fused))
    assert report["problem"] is None and any("fused MoE tensors" in n for n in report["notes"]), report["notes"]
