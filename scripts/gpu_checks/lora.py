"""GPU smoke checks of LoRA (issue 39), run by scripts/gpu_smoke.sh. Written on CPU, dry-run on gloo there
(--cpu), never run on a GPU.

    torchrun --nproc-per-node N scripts/gpu_checks/lora.py        (N = 1, 2 or 4 GPUs; NCCL; tp = N)
    torchrun --nproc-per-node 2 scripts/gpu_checks/lora.py --cpu  (a dry run on gloo: checks this script only)

Checks, one line each (PASS / FAIL, measured, limit), for a tiny Qwen3 (r = 4 on every projection) and a tiny
Qwen3-MoE (routed experts' adapters: the grouped GEMM on CUDA) on the GPU, tp = N, against transformers + PEFT
on the same GPU (the same randomized adapter, loaded by parallm.load_hf_adapter):
  L1. fp32 (TF32 off) logits with adapters: max |diff| at real tokens <= 1e-4
  L2. logits under adapters_disabled equal the bare model's: <= 1e-4
  L3. one token-mean AdamW step (fp32): the factors after it against PEFT's after torch.optim.AdamW: <= 1e-5
      (the frozen base bit-identical afterwards)
  L4. export_hf_tensors(merged=True) against PEFT's merge_and_unload: <= 1e-5; its peak extra device memory
      below 0.75x the base's matrices (the originals are kept on the host; the export stream's own buffers and one
      fp32 delta at a time remain)
  L5. bf16: forward_backward with adapters gives a finite loss and finite, non-zero adapter gradients; the base
      holds no gradient
Exits 0 when all pass. Needs peft (pip install peft).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

from gpu_common import Checks, shared_tmp, start

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
R, ALPHA, LR, EPS = 4, 8, 1e-3, 1e-4


def configs(world: int):
    import transformers
    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=max(2, world), head_dim=16,
                  intermediate_size=96, num_hidden_layers=2, vocab_size=128, max_position_embeddings=64,
                  tie_word_embeddings=False)
    dense = transformers.Qwen3Config(**common)
    moe = transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    for c in (dense, moe):
        c._attn_implementation = "eager"
    return {"qwen3": dense, "qwen3-moe": moe}


def token_nll(logits, ids, mask):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    return -(lp.gather(-1, ids[:, 1:, None]).squeeze(-1) * m).sum(), m.sum()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (--cpu runs the script on gloo)")
        return 1
    import peft
    from peft import get_peft_model_state_dict

    import parallm
    from parallm import verify

    world, rank, device = start(args.cpu, 29543)
    report = Checks(rank)
    parallm.init_parallel(tp=world, backend="gloo" if args.cpu else None)
    tmp = shared_tmp("parallm-lora-check-")
    for i, (name, cfg) in enumerate(configs(world).items()):
        ckpt, adapter = os.path.join(tmp, name), os.path.join(tmp, name + "-adapter")
        base = verify.make_hf_model(cfg, seed=5 + i)                 # the same weights on every rank
        ref = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=R, lora_alpha=ALPHA,
                                                                         target_modules=list(TARGETS),
                                                                         lora_dropout=0.0))
        g = torch.Generator().manual_seed(11 + i)
        with torch.no_grad():
            for n, p in ref.named_parameters():
                if "lora_" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        if rank == 0:
            base.save_pretrained(ckpt)
            ref.save_pretrained(adapter)
        torch.distributed.barrier()
        ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
        mask = torch.ones_like(ids)
        mask[1, 11:] = 0
        mask[2, :5] = 0
        pos = parallm.default_position_ids(mask)
        ids_d, mask_d, pos_d = ids.to(device), mask.to(device), pos.to(device)
        real = mask_d.bool()
        base, ref = base.to(device), ref.to(device)
        with torch.no_grad():
            want = ref(input_ids=ids_d, attention_mask=mask_d, position_ids=pos_d).logits.float()
            with ref.disable_adapter():
                want_base = ref(input_ids=ids_d, attention_mask=mask_d, position_ids=pos_d).logits.float()
        chunks = parallm.build_model(ckpt, lora=parallm.LoraConfig(R, ALPHA, TARGETS))
        parallm.load_hf_weights(chunks, ckpt)
        parallm.load_hf_adapter(chunks, adapter)
        with torch.no_grad():
            got = parallm.forward(chunks, ids_d, mask_d, pos_d).float()
            with parallm.adapters_disabled(chunks):
                got_base = parallm.forward(chunks, ids_d, mask_d, pos_d).float()
        report(f"L1 {name} fp32 logits with adapters vs PEFT", (got - want).abs()[real].max().item(), 1e-4)
        report(f"L2 {name} adapters_disabled vs the bare model", (got_base - want_base).abs()[real].max().item(),
               1e-4)
        torch.cuda.reset_peak_memory_stats(device) if device.type == "cuda" else None
        start_mem = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        merged = {}
        for k, t in parallm.export_hf_tensors(chunks, merged=True):
            merged[k] = t.to("cpu", copy=True)         # host copies: only the merge itself is on the device
        if device.type == "cuda":
            adapted = sum(p.numel() * p.element_size() for c in chunks for n, p in c.named_parameters()
                          if not p.requires_grad and p.dim() >= 2)
            extra = torch.cuda.max_memory_allocated(device) - start_mem
            report(f"L4 {name} merged export's extra device memory / the base's weights (originals kept on "
                   f"the host)", extra / max(adapted, 1), 0.75)
        unloaded = copy.deepcopy(ref).merge_and_unload().state_dict()
        diff = max((merged[k].float() - unloaded[k].float().to(merged[k].device)).abs().max().item()
                   for k in merged if k in unloaded)
        report(f"L4 {name} merged export vs merge_and_unload", diff, 1e-5)
        frozen = {n: p.detach().clone() for c in chunks for n, p in c.named_parameters() if not p.requires_grad}
        opt = parallm.build_optimizer(chunks, lr=LR, eps=EPS)
        parallm.forward_backward(chunks, ids_d, mask_d, loss_fn=token_nll, position_ids=pos_d)
        parallm.finalize_grads(chunks)
        opt.step()
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, eps=EPS,
                                    weight_decay=0.0)
        loss_sum, count = token_nll(ref(input_ids=ids_d, attention_mask=mask_d, position_ids=pos_d).logits,
                                    ids_d, mask_d)
        (loss_sum / count).backward()
        ref_opt.step()
        after = {k: v.float() for k, v in parallm.export_adapter_tensors(chunks)}
        ref_after = {k: v.float() for k, v in get_peft_model_state_dict(ref).items()}
        diff = max((after[k] - ref_after[k].to(after[k].device)).abs().max().item() for k in ref_after)
        report(f"L3 {name} factors after one AdamW step vs PEFT", diff, 1e-5,
               ok=diff <= 1e-5 and set(after) == set(ref_after))
        still = all(torch.equal(p.detach(), frozen[n]) for c in chunks for n, p in c.named_parameters()
                    if not p.requires_grad)
        report(f"L3 {name} frozen base bit-identical after the step", 0, 0, ok=still)
        del chunks, opt
        chunks = parallm.build_model(ckpt, dtype=torch.bfloat16, lora=parallm.LoraConfig(R, ALPHA, TARGETS))
        parallm.load_hf_weights(chunks, ckpt)
        parallm.load_hf_adapter(chunks, adapter)
        loss = parallm.forward_backward(chunks, ids_d, mask_d, loss_fn=token_nll, position_ids=pos_d)
        parallm.finalize_grads(chunks)
        from parallm.model.params import grad_of
        norms = [grad_of(p).float().norm().item() for c in chunks for p in c.parameters() if p.requires_grad]
        base_grads = [p for c in chunks for p in c.parameters() if not p.requires_grad and p.grad is not None]
        report(f"L5 {name} bf16 forward_backward: finite loss, adapter grads finite and non-zero, none on the base",
               min(norms), 0.0, ok=bool(torch.isfinite(torch.as_tensor(loss))) and not base_grads
               and all(0 < n < float("inf") for n in norms))
        del chunks
    parallm.destroy_parallel()
    return report.finish("LoRA")


if __name__ == "__main__":
    sys.exit(main())
