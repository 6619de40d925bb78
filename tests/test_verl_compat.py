"""parallm.compat.verl driven the way verl drives it: parallel_state initialised by the caller, models built per
virtual stage with pre/post_process, the state dict on rank 0 only, hidden states passed between stages by the
caller, vocab-parallel logits on the last stage."""

import pytest
import torch

import helpers


def rank_verl(rank, world, ckpt, ref_logits, ref_sd, ids, mask):
    import torch.distributed as dist
    import transformers
    from megatron.core import ModelParallelConfig
    from megatron.core import parallel_state as ps

    import parallm
    from parallm.compat import verl

    config = transformers.AutoConfig.from_pretrained(ckpt)
    state = helpers_state(ckpt) if rank == 0 else None
    results = {}

    # -- PP classes: tp=2, pp=2 (caller initialises Megatron itself) ------------------------------------------
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    mcfg = ModelParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                               params_dtype=torch.float32, pipeline_dtype=torch.float32)
    model = verl.ParallelQwen2ForCausalLMRmPadPP(config, mcfg, ps.is_pipeline_first_stage(),
                                                  ps.is_pipeline_last_stage(),
                                                  share_embeddings_and_output_weights=config.tie_word_embeddings)
    verl.get_weight_loader("Qwen2ForCausalLM")(state, [model], config, torch.float32,
                                               tie_word_embeddings=config.tie_word_embeddings)
    pp_ranks = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    pos = parallm.default_position_ids(mask)
    if ps.is_pipeline_first_stage():
        hidden = model(input_ids=ids, attention_mask=mask, position_ids=pos)
        # RmPad: the packed token stream [nnz, 1, H] goes to the next stage
        assert hidden.shape == (int(mask.sum()), 1, config.hidden_size)
        dist.send(hidden.contiguous(), dst=pp_ranks[1])
    else:
        hidden = torch.empty(int(mask.sum()), 1, config.hidden_size)
        dist.recv(hidden, src=pp_ranks[0])
        model.set_input_tensor([hidden])
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        tp = ps.get_tensor_model_parallel_world_size()
        assert logits.shape[-1] == model.padded_vocab_size // tp
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, -1)
        # vocab 99 over tp 2 is padded to 100: the padded column must get probability exactly 0
        assert full.shape[-1] == 100
        pad_prob = full.softmax(-1)[mask.bool()][..., config.vocab_size:].abs().max().item()
        assert pad_prob == 0.0, (pad_prob, full[..., config.vocab_size:].flatten()[:5])
        results["pp_logits"] = helpers.max_diff_real(full[..., :config.vocab_size], ref_logits, mask)
    merged = verl.get_weight_saver("Qwen2ForCausalLM")([model], config, torch.float32)
    if rank == 0:
        assert merged.keys() == ref_sd.keys()
        assert all(torch.equal(merged[k], ref_sd[k]) for k in ref_sd)
    ps.destroy_model_parallel()

    # -- non-PP classes: tp=4 --------------------------------------------------------------------------------
    ps.initialize_model_parallel(tensor_model_parallel_size=4)
    mcfg = ModelParallelConfig(tensor_model_parallel_size=4, params_dtype=torch.float32)
    lm = verl.ParallelQwen2ForCausalLMRmPad(config, mcfg)
    verl.load_state_dict_to_megatron_qwen2(state, [lm], config, torch.float32)
    out = lm(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert out.shape == ref_logits.shape
    assert torch.all(out[mask == 0] == 0)  # RmPad: zeros at padded positions
    results["rmpad_logits"] = helpers.max_diff_real(out, ref_logits, mask)
    base = verl.ParallelQwen2Model(config, mcfg)
    verl.load_state_dict_to_megatron_qwen2(state, [base], config, torch.float32)
    hidden = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    assert hidden.shape == (*ids.shape, config.hidden_size)
    ps.destroy_model_parallel()
    try:
        verl.get_weight_loader("GPT2LMHeadModel")
    except ValueError as e:
        assert "Qwen2ForCausalLM" in str(e)
    else:
        raise AssertionError("unknown architecture accepted")
    return results


def helpers_state(ckpt):
    from safetensors.torch import load_file
    import glob
    sd = {}
    for f in sorted(glob.glob(f"{ckpt}/*.safetensors")):
        sd.update(load_file(f))
    return sd


@pytest.mark.timeout(300)
def test_verl_surface(tmp_path):
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=2, tie_word_embeddings=True, num_key_value_heads=1,
                              vocab_size=99)
    model = helpers.make_hf_model(cfg, seed=5)
    ckpt = helpers.save_checkpoint(model, str(tmp_path / "q"))
    ids, mask = helpers.padded_batch(cfg.vocab_size)
    ref = helpers.hf_logits(model, ids, mask)
    res = helpers.run_ranks(rank_verl, 4, ckpt, ref, helpers.hf_state_dict(model), ids, mask)
    pp = [r["pp_logits"] for r in res if "pp_logits" in r]
    assert len(pp) == 2 and max(pp) < 2e-5
    assert max(r["rmpad_logits"] for r in res) < 2e-5
    print(f"\nverl PP logits diff {max(pp):.2e}, RmPad {max(r['rmpad_logits'] for r in res):.2e}")
