"""parallm.compat.verl driven the way verl drives it, every public class compared with transformers.

One 4-rank spawn. The caller initialises Megatron's parallel_state itself; the state dict is on rank 0 only;
models are built per virtual stage with pre/post_process; hidden states are handed between stages by the
caller (``set_input_tensor``), with their shape sent first as Megatron's schedules do for variable lengths.
Per family (LLaMA untied with attention biases; Qwen2 tied, one KV head, vocab 99 so the vocabulary is padded):

* tp=4 (pp=1): ``Model`` and ``ForCausalLM`` (padded path), ``ModelRmPad``, ``ForCausalLMRmPad`` and
  ``ForValueRmPad`` (packed; sequence parallel for Qwen2);
* tp=2, pp=2: ``ModelRmPadPP``, ``ForCausalLMRmPadPP``, ``ForValueRmPadPP`` (LLaMA also with vpp=2 and
  sequence parallelism); the vocab-parallel logits are gathered over tp by the test.

References (fp32, real positions, < 2e-5): ``Model`` classes vs transformers' final-normed hidden states
(``model.model(...).last_hidden_state``), ``ForCausalLM`` classes vs its logits, ``ForValue`` classes vs
``*ForSequenceClassification``'s per-token scores (``score`` applied to every position, before pooling). The
saver gives back the state dict bit for bit for the PP classes.
"""

import pytest
import torch

import helpers

TOL = 2e-5

FAMILIES = {
    # family: (config overrides, sequence parallel for the non-PP RmPad classes, (pp, vpp, SP) for PP classes)
    "Llama": ("llama", dict(num_hidden_layers=4, attention_bias=True), False, (2, 2, True)),
    "Qwen2": ("qwen2", dict(num_hidden_layers=4, tie_word_embeddings=True, num_key_value_heads=1, vocab_size=99),
              True, (2, None, False)),
}


def _mcfg(tp, pp, sp):
    from megatron.core import ModelParallelConfig
    return ModelParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=sp,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32)


def _diff(out, ref, mask):
    return helpers.max_diff_real(out, ref, mask)


def _non_pp(verl, case, rank, res):
    """tp=4: the five non-PP classes of one family."""
    from megatron.core import parallel_state as ps
    fam, ids, mask = case["family"], case["ids"], case["mask"]
    pos = case["pos"]
    causal_sd = case["causal_sd"] if rank == 0 else None
    value_sd = case["value_sd"] if rank == 0 else None
    load = verl.get_weight_loader(f"{fam}ForCausalLM")
    load_value = verl.get_weight_loader(f"{fam}ForSequenceClassification")
    for kind, sp in (("Model", False), ("ForCausalLM", False), ("ModelRmPad", case["sp"]),
                     ("ForCausalLMRmPad", case["sp"]), ("ForValueRmPad", case["sp"])):
        cls = getattr(verl, f"Parallel{fam}{kind}")
        model = cls(case["config"] if "Value" not in kind else case["value_config"], _mcfg(4, 1, sp))
        assert model.sequence_parallel == (sp and ps.get_tensor_model_parallel_world_size() > 1)
        if "Value" in kind:
            load_value(value_sd, [model], case["value_config"], torch.float32, is_value_model=True)
        else:
            load(causal_sd, [model], case["config"], torch.float32)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        if kind.startswith("Model"):
            got, ref = out.last_hidden_state, case["ref_hidden"]
        elif "Value" in kind:
            got, ref = out.logits, case["ref_values"]
        else:
            got, ref = out.logits, case["ref_logits"]
        assert got.shape == ref.shape, (kind, got.shape, ref.shape)
        if "RmPad" in kind:
            assert torch.all(got[mask == 0] == 0), kind  # verl's pad_input: zeros at padded positions
        res[f"{fam}{kind}"] = _diff(got, ref, mask)


def _send(t, dst):
    import torch.distributed as dist
    dist.send(torch.tensor(t.shape, dtype=torch.long), dst=dst)
    dist.send(t.contiguous(), dst=dst)


def _recv(src, ndim=3):
    import torch.distributed as dist
    shape = torch.empty(ndim, dtype=torch.long)
    dist.recv(shape, src=src)
    t = torch.empty(*shape.tolist())
    dist.recv(t, src=src)
    return t


def _pp(verl, case, rank, res):
    """tp=2, pp=2 (vpp as the family says): the three PP classes, activations passed by hand."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    fam, ids, mask, pos = case["family"], case["ids"], case["mask"], case["pos"]
    pp, vpp, sp = case["pp_layout"]
    stage = ps.get_pipeline_model_parallel_rank()
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    tied = case["config"].tie_word_embeddings
    value_src = case["value_sd_verl"]   # LLaMA: verl's value checkpoint (head as lm_head.weight [1, H])
    for kind, arch, config, sd, ref_sd in (
            ("ModelRmPadPP", "ForCausalLM", case["config"], case["causal_sd"], case["hidden_sd"]),
            ("ForCausalLMRmPadPP", "ForCausalLM", case["config"], case["causal_sd"], case["causal_sd"]),
            ("ForValueRmPadPP", "ForSequenceClassification", case["value_config"],
             value_src if value_src is not None else case["value_sd"], case["value_sd"])):
        cls = getattr(verl, f"Parallel{fam}{kind}")
        chunks = []
        for v in range(vpp or 1):  # verl's get_model: set the virtual rank, then build that chunk
            if vpp:
                ps.set_virtual_pipeline_model_parallel_rank(v)
            pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)
            post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v)
            if kind == "ModelRmPadPP":
                chunks.append(cls(config, _mcfg(2, pp, sp), pre, post))
            else:
                chunks.append(cls(config, _mcfg(2, pp, sp), pre, post,
                                  share_embeddings_and_output_weights=tied and kind == "ForCausalLMRmPadPP"))
        if vpp:
            ps.set_virtual_pipeline_model_parallel_rank(0)
        verl.get_weight_loader(f"{fam}{arch}")(sd if rank == 0 else None, chunks, config, torch.float32,
                                               is_value_model="Value" in kind, tie_word_embeddings=tied)
        # the schedule: stage 0 chunk 0 -> stage 1 chunk 0 -> stage 0 chunk 1 -> stage 1 chunk 1
        out = None
        for v, chunk in enumerate(chunks):
            if not chunk.pre_process:
                chunk.set_input_tensor([_recv(pp_ranks[stage - 1] if stage > 0 else pp_ranks[-1])])
            y = chunk(input_ids=ids, attention_mask=mask, position_ids=pos)
            if chunk.post_process:
                out = y
            else:
                # the packed stream [T, 1, H] ([T/tp, 1, H] under sequence parallelism, T padded to tp)
                tokens = int(mask.sum())
                if sp:
                    tokens = -(-tokens // 2)
                assert y.shape == (tokens, 1, config.hidden_size), (kind, y.shape, tokens)
                _send(y, pp_ranks[(stage + 1) % pp])
        merged = verl.get_weight_saver(f"{fam}{arch}")(chunks, config, torch.float32,
                                                       is_value_model="Value" in kind)
        if rank == 0:
            assert merged.keys() == ref_sd.keys(), (kind, sorted(set(merged) ^ set(ref_sd)))
            unequal = [k for k in ref_sd if not torch.equal(merged[k], ref_sd[k])]
            assert not unequal, (kind, unequal)
        else:
            assert merged == {}, kind
        if out is None:
            continue
        if kind == "ModelRmPadPP":
            got, ref = out.last_hidden_state, case["ref_hidden"]
        elif kind == "ForValueRmPadPP":
            got, ref = out.logits, case["ref_values"]
        else:
            logits = out.logits  # vocab-parallel [B, S, Vpad/tp]: the caller gathers it
            tp = ps.get_tensor_model_parallel_world_size()
            padded = chunks[-1].padded_vocab_size
            assert logits.shape == (*ids.shape, padded // tp), logits.shape
            parts = [torch.empty_like(logits) for _ in range(tp)]
            dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
            full = torch.cat(parts, -1)
            vocab = config.vocab_size
            if padded > vocab:  # the padding columns get probability exactly 0
                pad_prob = full.softmax(-1)[mask.bool()][..., vocab:].abs().max().item()
                assert pad_prob == 0.0, (kind, pad_prob)
            res[f"{fam}{kind}/padded_vocab"] = padded
            got, ref = full[..., :vocab], case["ref_logits"]
        assert got.shape == ref.shape, (kind, got.shape, ref.shape)
        assert torch.all(got[mask == 0] == 0), kind
        res[f"{fam}{kind}"] = _diff(got, ref, mask)


def rank_verl(rank, world, cases):
    from megatron.core import parallel_state as ps

    from parallm.compat import verl
    res = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=4, distributed_timeout_minutes=3)
    for case in cases:
        _non_pp(verl, case, rank, res)
    ps.destroy_model_parallel()
    for case in cases:
        pp, vpp, _ = case["pp_layout"]
        ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=pp,
                                     virtual_pipeline_model_parallel_size=vpp, distributed_timeout_minutes=3)
        try:  # a non-PP class under pp > 1 is refused
            verl.ParallelLlamaForCausalLM(case["config"], _mcfg(2, pp, False))
        except ValueError as e:
            assert "PP classes" in str(e), str(e)
        else:
            raise AssertionError("a non-PP class was built under pp > 1")
        if not case["config"].tie_word_embeddings:  # sharing asked for an untied config is refused
            try:
                getattr(verl, f"Parallel{case['family']}ForCausalLMRmPadPP")(
                    case["config"], _mcfg(2, pp, False), True, True, share_embeddings_and_output_weights=True)
            except ValueError as e:
                assert "tie_word_embeddings=False" in str(e), str(e)
            else:
                raise AssertionError("share_embeddings_and_output_weights=True accepted for an untied config")
        _pp(verl, case, rank, res)
        ps.destroy_model_parallel()
    try:
        verl.get_weight_loader("GPT2LMHeadModel")
    except ValueError as e:
        assert "Qwen2ForCausalLM" in str(e)
    else:
        raise AssertionError("unknown architecture accepted")
    return res


def _case(fam, seed):
    import parallm
    family, overrides, sp, pp_layout = FAMILIES[fam]
    cfg = helpers.tiny_config(family, **overrides)
    causal = helpers.make_hf_model(cfg, seed=seed)
    value_cfg = helpers.tiny_config(family, **overrides)
    value = helpers.make_hf_model(value_cfg, task="value", seed=seed + 1)
    ids, mask = helpers.padded_batch(cfg.vocab_size, seed=seed)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        ref_logits = causal(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        ref_hidden = causal.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        # *ForSequenceClassification's per-token scores: its `score` on every position, before pooling
        ref_values = value.score(value.model(input_ids=ids, attention_mask=mask,
                                             position_ids=pos).last_hidden_state).squeeze(-1)
    causal_sd = helpers.hf_state_dict(causal)
    value_sd = helpers.hf_state_dict(value)
    value_sd_verl = None
    if fam == "Llama":
        value_sd_verl = {("lm_head.weight" if k == "score.weight" else k): v for k, v in value_sd.items()}
    return dict(family=fam, config=cfg, value_config=value_cfg, ids=ids, mask=mask, pos=pos, sp=sp,
                pp_layout=pp_layout, ref_logits=ref_logits, ref_hidden=ref_hidden, ref_values=ref_values,
                causal_sd=causal_sd, value_sd=value_sd, value_sd_verl=value_sd_verl,
                hidden_sd={k: v for k, v in causal_sd.items() if k != "lm_head.weight"})


KINDS = ("Model", "ForCausalLM", "ModelRmPad", "ForCausalLMRmPad", "ForValueRmPad", "ModelRmPadPP",
         "ForCausalLMRmPadPP", "ForValueRmPadPP")


@pytest.mark.timeout(400)
def test_every_verl_class_against_transformers():
    from parallm.compat import verl
    public = sorted(n for n in verl.__all__ if n.startswith("Parallel"))
    assert public == sorted(f"Parallel{f}{k}" for f in FAMILIES for k in KINDS)
    cases = [_case(fam, seed=5 + 10 * i) for i, fam in enumerate(FAMILIES)]
    res = helpers.run_ranks(rank_verl, 4, cases)
    print()
    failures = []
    for fam in FAMILIES:
        for kind in KINDS:
            key = f"{fam}{kind}"
            diffs = [r[key] for r in res if key in r]
            # non-PP classes: every rank has the output; PP classes: the last stage's two tp ranks
            want = 4 if not kind.endswith("PP") else 2
            worst = max(diffs) if diffs else float("nan")
            print(f"Parallel{key:<26} ranks {len(diffs)} max |parallm - transformers| {worst:.2e}")
            if len(diffs) != want or not worst < TOL:
                failures.append(f"Parallel{key}: {len(diffs)} ranks (want {want}), max diff {worst:.3g}")
    assert [r["Qwen2ForCausalLMRmPadPP/padded_vocab"] for r in res if "Qwen2ForCausalLMRmPadPP/padded_vocab" in r] \
        == [100, 100]
    assert not failures, "\n".join(failures)
