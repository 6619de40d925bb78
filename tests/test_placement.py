"""Each parameter's placement: megatron-core's own attributes, and Megatron's grad-norm rule on parallm's chunks.

megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` / ``allreduce`` /
``shared`` / ``shared_embedding`` on its layers' parameters, and its optimizer, grad clipping and checkpointing
read them. Here the same model is built twice in one spawn, once by parallm and once as megatron-core's own
GPTModel (local layer spec, same sizes, same layout), and every parameter's attributes are compared. Then
Megatron's norm rule (``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``, summed over the
model-parallel group) is evaluated on parallm's gradients and compared with the unsharded transformers model's
grad norm.
"""

import pytest
import torch

import helpers
from parallm.verify.reference import causal_lm_loss as ce_loss

ATTRS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1, "allreduce": True,
         "sequence_parallel": False, "shared": False, "shared_embedding": False}

# parallm chunk parameter name -> megatron GPTModel parameter name (local layer spec)
NAME_MAP = (
    ("embedding.weight", "embedding.word_embeddings.weight"),
    ("final_norm.weight", "decoder.final_layernorm.weight"),
    ("output_layer.weight", "output_layer.weight"),
    (".post_attention_layernorm.", ".pre_mlp_layernorm."),
    (".self_attention.q_norm.", ".self_attention.q_layernorm."),
    (".self_attention.k_norm.", ".self_attention.k_layernorm."),
)


def _megatron_name(name: str) -> str:
    for a, b in NAME_MAP:
        if name == a:
            return b
    for a, b in NAME_MAP[3:]:
        name = name.replace(a, b)
    return "decoder." + name if name.startswith("layers.") else name


def _megatron_chunks(spec, vocab_padded, tied, lay):
    """megatron-core's GPTModel for the same layout: one per virtual stage, with its own initialisation (which is
    what sets the attributes). ``Tensor.cuda`` is made the identity while building: GPTModel moves the tied
    embedding copy to CUDA before syncing it, which a CPU build cannot do."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    cfg = TransformerConfig(
        num_layers=spec.num_layers, hidden_size=spec.hidden_size, num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads, kv_channels=spec.head_dim, ffn_hidden_size=spec.intermediate_size,
        gated_linear_unit=True, add_bias_linear=False, normalization="RMSNorm", qk_layernorm=spec.qk_norm,
        use_cpu_initialization=True, perform_initialization=True, params_dtype=torch.float32,
        pipeline_dtype=torch.float32, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
        virtual_pipeline_model_parallel_size=lay.vpp if lay.vpp > 1 else None, bf16=False)
    layer_spec = get_gpt_layer_local_spec(qk_layernorm=spec.qk_norm, normalization="RMSNorm")
    saved_cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        models = []
        for v in range(lay.vpp):
            if lay.vpp > 1:
                ps.set_virtual_pipeline_model_parallel_rank(v)
            models.append(GPTModel(cfg, layer_spec, vocab_size=vocab_padded, max_sequence_length=64,
                                   pre_process=lay.is_first_stage(v), post_process=lay.is_last_stage(v),
                                   share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                                   vp_stage=v if lay.vpp > 1 else None))
    finally:
        torch.Tensor.cuda = saved_cuda
        if lay.vpp > 1:
            ps.set_virtual_pipeline_model_parallel_rank(0)
    return models


def _attrs(p):
    return {a: getattr(p, a, default) for a, default in ATTRS.items()}


def _megatron_norm(chunks):
    """Megatron's clip_grad_norm rule on parallm's gradients: params that are not shared and not TP duplicates,
    squared norms summed over the model-parallel group."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared
    total = torch.zeros(())
    for c in chunks:
        for p in c.parameters():
            if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
                total += p.grad.double().pow(2).sum().float()
    torch.distributed.all_reduce(total, group=ps.get_model_parallel_group())
    return total.sqrt().item()




def _rank(rank, world, cases):
    import parallm
    from parallm.parallel.state import current_dims
    out = []
    for case in cases:
        parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case["vpp"])
        lay = current_dims()
        chunks = parallm.build_model(case["ckpt"])
        spec = chunks[0].spec
        mismatches = []
        if case["compare_attrs"]:
            megatron = _megatron_chunks(spec, chunks[0].padded_vocab_size, spec.tie_word_embeddings, lay)
            for ours, theirs in zip(chunks, megatron):
                theirs_params = dict(theirs.named_parameters())
                ours_params = dict(ours.named_parameters())
                assert len(ours_params) == len(theirs_params), (sorted(ours_params), sorted(theirs_params))
                for name, p in ours_params.items():
                    q = theirs_params[_megatron_name(name)]
                    assert p.shape == q.shape, (name, p.shape, q.shape)
                    if _attrs(p) != _attrs(q):
                        mismatches.append((name, _attrs(p), _attrs(q)))
        parallm.load_hf_weights(chunks, case["ckpt"])
        per = case["ids"].shape[0] // lay.dp
        sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
        parallm.forward_backward(chunks, case["ids"][sl], case["mask"][sl], loss_fn=ce_loss,
                                 num_microbatches=case["nmb"])
        parallm.finalize_grads(chunks)
        out.append(dict(name=case["name"], mismatches=mismatches, norm=_megatron_norm(chunks)))
        del chunks
        parallm.destroy_parallel()
    return out


def _reference_norm(model, ids, mask, pieces):
    model.zero_grad()
    size = ids.shape[0] // pieces
    pos = __import__("parallm").default_position_ids(mask)
    losses = [ce_loss(model(input_ids=ids[i:i + size], attention_mask=mask[i:i + size],
                            position_ids=pos[i:i + size]).logits, ids[i:i + size], mask[i:i + size])
              for i in range(0, ids.shape[0], size)]
    torch.stack(losses).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]  # a tied weight appears once
    return torch.linalg.vector_norm(torch.stack([g.double().norm() for g in grads])).item()


@pytest.mark.timeout(300)
def test_megatron_attributes_and_norm_rule(tmp_path):
    ids, mask = helpers.padded_batch(101, batch=4, seq=10)
    cases = []
    specs = [
        # name, family, overrides, tp, pp, vpp, compare megatron attributes
        ("llama tp2 dp2", "llama", {}, 2, 1, None, True),
        ("qwen3 tied tp2 pp2 (qk-norm)", "qwen3", dict(tie_word_embeddings=True, head_dim=16), 2, 2, None, True),
        ("llama tied pp2 vpp2 dp2", "llama", dict(tie_word_embeddings=True, num_hidden_layers=4), 1, 2, 2, True),
    ]
    refs = {}
    for name, family, overrides, tp, pp, vpp, attrs in specs:
        model = helpers.make_hf_model(helpers.tiny_config(family, **overrides))
        ckpt = helpers.save_checkpoint(model, str(tmp_path / name.replace(" ", "_")))
        dp = 4 // (tp * pp)
        # dp replicas each take batch/dp rows in nmb microbatches: the global loss is the mean of 2 pieces
        refs[name] = _reference_norm(model, ids, mask, pieces=2)
        cases.append(dict(name=name, ckpt=ckpt, tp=tp, pp=pp, vpp=vpp, nmb=2 // dp, ids=ids, mask=mask,
                          compare_attrs=attrs))
    results = helpers.run_ranks(_rank, 4, cases, timeout=280)
    for r in range(4):
        for res in results[r]:
            assert not res["mismatches"], (res["name"], res["mismatches"][:3])
            ref = refs[res["name"]]
            assert abs(res["norm"] - ref) <= 1e-5 * ref, (res["name"], res["norm"], ref)
    print({n: (refs[n], results[0][i]["norm"]) for i, n in enumerate(refs)})
