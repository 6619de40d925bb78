"""GPU smoke checks of router replay (issue 35 item 6), run by scripts/gpu_smoke.sh. Written on
CPU, dry-run on gloo there (--cpu), never run on a GPU.

    torchrun --nproc-per-node N scripts/gpu_checks/replay.py        (N = 1, 2 or 4 GPUs; NCCL; ep = N)
    torchrun --nproc-per-node 2 scripts/gpu_checks/replay.py --cpu  (a dry run on gloo: checks this script only)

Checks, one line each (PASS / FAIL, measured, limit), for a tiny Qwen3-MoE and DeepSeek-V3 on the GPU, fp32
(TF32 off) and bf16, at tp 1, ep = dp = N (each rank its own rows, padded left and right):
  R1. fp32 logits with random replayed experts (different from the router's own) against transformers on the same
      GPU with its routers forced to the same experts (the rank's rows): max |diff| at real tokens <= 1e-4
  R2. the returned choices: the given experts at real tokens, -1 at padding (exact)
  R3. round trip: forward(return_routed_experts=True), then forward(routed_experts=those): bit-identical logits,
      fp32 and bf16 (the grouped GEMM path on CUDA bf16)
  R4. forward_backward with replay (bf16, 2 microbatches): finite loss, and every MoE router's gradient finite and
      non-zero (the combine weights carry the router's gradient)
Exits 0 when all pass.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

from gpu_common import Checks, shared_tmp, start


def forced_routing(model, given, mask):
    """transformers' MoE routers (``mlp.gate``) return ``given`` [B, S, L, k] at real tokens, the router's
    probabilities of those experts as weights (Qwen3-MoE: softmax gathered, renormalised; DeepSeek-V3: sigmoid
    gathered, normalised, scaled). Returns a function that restores the routers."""
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    originals = [g.forward for g in gates]

    def make(j, gate, original):
        def forward(hidden_states):
            h = hidden_states.reshape(-1, gate.weight.shape[1])
            logits, w, experts = original(hidden_states)
            real = mask.reshape(-1).bool()[:, None]
            experts = torch.where(real, given[:, :, j].reshape(-1, given.shape[-1]), experts)
            if hasattr(gate, "e_score_correction_bias"):
                logits = F.linear(h.float(), gate.weight.float())
                w = logits.sigmoid().gather(1, experts)
                if gate.norm_topk_prob:
                    w = w / (w.sum(-1, keepdim=True) + 1e-20)
                w = w * gate.routed_scaling_factor
            else:
                logits = F.linear(h, gate.weight)
                w = torch.softmax(logits, dtype=torch.float, dim=-1).gather(1, experts)
                if gate.norm_topk_prob:
                    w = w / w.sum(-1, keepdim=True)
                w = w.to(logits.dtype)
            return logits, w, experts
        return forward
    for j, (g, o) in enumerate(zip(gates, originals)):
        g.forward = make(j, g, o)

    def restore():
        for g, o in zip(gates, originals):
            g.forward = o
    return restore


def configs():
    import transformers
    qwen = transformers.Qwen3MoeConfig(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                                       max_position_embeddings=64)
    ds = transformers.DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                                       kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                                       n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
                                       moe_intermediate_size=32, n_shared_experts=1, intermediate_size=96,
                                       num_hidden_layers=3, first_k_dense_replace=1, vocab_size=101,
                                       max_position_embeddings=64)
    for c in (qwen, ds):
        c._attn_implementation = "eager"
    return {"qwen3-moe": qwen, "deepseek-v3": ds}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (--cpu runs the script on gloo)")
        return 1
    import parallm
    from parallm import verify
    from parallm.parallel.state import current_dims

    world, rank, device = start(args.cpu, 29541)
    report = Checks(rank)
    parallm.init_parallel(ep=world, backend="gloo" if args.cpu else None)
    lay = current_dims()
    tmp = shared_tmp("parallm-replay-")
    for i, (name, cfg) in enumerate(configs().items()):
        ckpt = os.path.join(tmp, name)
        if rank == 0:
            model = verify.make_hf_model(cfg, seed=3 + i)
            model.save_pretrained(ckpt)
        torch.distributed.barrier()
        model = verify.make_hf_model(cfg, seed=3 + i).to(device)   # the same weights on every rank
        g = torch.Generator().manual_seed(7)
        b, s = 4 * world, 24
        ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
        mask = torch.ones_like(ids)
        for r in range(b):
            n = int(torch.randint(4, s + 1, (1,), generator=g))
            if r % 2:
                mask[r, :s - n] = 0
            else:
                mask[r, n:] = 0
        layers = sum(hasattr(layer.mlp, "gate") for layer in model.model.layers)
        k, num_experts = cfg.num_experts_per_tok, getattr(cfg, "num_experts", None) or cfg.n_routed_experts
        given = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(b * s * layers)])
        given = given.view(b, s, layers, k)
        mine = slice(4 * lay.dp_rank, 4 * lay.dp_rank + 4)
        ids_m, mask_m, given_m = (t[mine].to(device) for t in (ids, mask, given))
        real = mask_m.bool()
        for dtype in (torch.float32, torch.bfloat16):
            chunks = parallm.build_model(ckpt, dtype=dtype)
            parallm.load_hf_weights(chunks, ckpt)
            with torch.no_grad():
                out, routed = parallm.forward(chunks, ids_m, mask_m, routed_experts=given_m,
                                              return_routed_experts=True)
                plain, own = parallm.forward(chunks, ids_m, mask_m, return_routed_experts=True)
                again = parallm.forward(chunks, ids_m, mask_m, routed_experts=own)
            tag = f"{name} {str(dtype).replace('torch.', '')}"
            if dtype == torch.float32:
                restore = forced_routing(model, given_m, mask_m)
                try:
                    with torch.no_grad():
                        ref = model(input_ids=ids_m, attention_mask=mask_m,
                                    position_ids=parallm.default_position_ids(mask_m)).logits.float()
                finally:
                    restore()
                report(f"R1 {tag} replayed logits vs transformers forced", (out - ref).abs()[real].max().item(), 1e-4)
            report(f"R2 {tag} returned choices = given at real tokens, -1 at padding", 0, 0,
                   ok=torch.equal(routed[real], given_m[real]) and bool((routed[~real] == -1).all()))
            report(f"R3 {tag} round trip bit-identical", (again - plain).abs().max().item(), 0.0)
            if dtype == torch.bfloat16:
                def loss_fn(logits, mb_ids, mb_mask):
                    lp = logits[:, :-1].log_softmax(-1).gather(-1, mb_ids[:, 1:, None]).squeeze(-1)
                    m = (mb_mask[:, 1:] * mb_mask[:, :-1]).float()
                    return -(lp * m).sum(), m.sum()
                loss = parallm.forward_backward(chunks, ids_m, mask_m, loss_fn=loss_fn, num_microbatches=2,
                                                routed_experts=given_m)
                parallm.finalize_grads(chunks)
                from parallm.model.params import grad_of
                norms = [grad_of(layer.mlp.router.weight).float().norm().item() for c in chunks for layer in c.layers
                         if hasattr(layer.mlp, "router")]
                report(f"R4 {tag} forward_backward with replay: finite loss, router gradients finite and non-zero",
                       min(norms), 0.0, ok=bool(torch.isfinite(loss)) and all(0 < n < float("inf") for n in norms))
            del chunks
    parallm.destroy_parallel()
    return report.finish("router-replay")


if __name__ == "__main__":
    sys.exit(main())
