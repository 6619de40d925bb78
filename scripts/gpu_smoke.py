"""GPU smoke test: parity with transformers on CUDA + NCCL for what the CPU suite checks on gloo.

    torchrun --nproc-per-node N scripts/gpu_smoke.py          (N = 1, 2 or 4 GPUs; or)
    bash scripts/gpu_smoke.sh
    torchrun --nproc-per-node 4 scripts/gpu_smoke.py --cpu    (a dry run of this script on gloo / CPU)

Checks, each one line (PASS / FAIL, the measured value, the limit):
  1. fp32 logits at tp x pp (plain and packed + sequence parallel); bf16 packed logits, relative
  2. vocab-parallel log-probs and entropy (temperature 0.7) against log_softmax of transformers' logits
  3. export_hf_tensors: every tensor bit-exact (to every rank, to rank 0 only, cast to bf16 on the sender)
  4. one training step: forward_backward (2 microbatches), finalize_grads, parallm's AdamW, against
     transformers + torch.optim.AdamW: the loss and every updated weight
  5. a training checkpoint (model + optimizer) saved and loaded into a fresh model: weights bit-exact, and one more
     step on both bit-exact
  6. a mixture-of-experts model (Qwen3-MoE, 8 experts, top 2) at ep = world (all-to-all dispatch): fp32 logits
  7. that model: one AdamW step with ZeRO at ep = world, a training checkpoint, loaded at ep = 1: weights bit-exact
  8. determinism: two identical MoE forward + backward passes give bit-identical outputs and gradients
  8a. kernel choices: no CPU kernel on a CUDA device (device 0 included); torch._grouped_mm's empty-group check
      (an expert no token chose gets exactly zero gradient; outputs and gradients equal to the loop), bf16, fp32
  8b. YaRN RoPE (a Qwen2 long-context config, factor 4): fp32 logits against transformers
  9. pp = 2 (2 or more GPUs): a training step whose stage-boundary messages are 64 MiB each (hidden 4096 x 4096
     tokens fp32, far above NCCL's point-to-point buffers: an exchange that needs buffering deadlocks here),
     loss against transformers
 10. throughput (INFO lines, one figure each): a 1B-shaped LLaMA training step (packed, flash-attn when installed,
     sdpa otherwise; fp32 and bf16) per GPU: tokens/s and model FLOPs utilisation against the chip's peak, next to
     transformers' same step (forward, backward, torch AdamW) on the same GPU
Exits 0 when all pass. Not part of the CPU test suite. With --cpu the sizes of checks 9 and 10 are cut down
(a dry run of the script's logic, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU (gloo): checks this script, not the GPU")
    args = ap.parse_args()

    import importlib

    import parallm
    R = importlib.import_module("parallm.verify.reference")   # the module (parallm.verify.reference is a function)

    if not torch.cuda.is_available() and not args.cpu:
        print("no CUDA device: nothing to check (--cpu runs the script on gloo)")
        return 1
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if not args.cpu else torch.device("cpu")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    tp = 2 if world % 2 == 0 else 1
    pp = 2 if world % 4 == 0 else 1
    parallm.init_parallel(tp=tp, pp=pp)  # nccl when CUDA is available
    rank = dist.get_rank()
    ok = True

    def report(name, value, limit):
        nonlocal ok
        good = value <= limit
        ok &= good
        if rank == 0:
            print(f"{'PASS' if good else 'FAIL'} {name}: {value:.3e} (limit {limit:.0e})", flush=True)

    def info(text):
        if rank == 0:
            print(f"INFO {text}", flush=True)

    box = [tempfile.mkdtemp(prefix="parallm-gpu-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    ckpt = os.path.join(box[0], "m")
    cfg = R.tiny_config("qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                        num_key_value_heads=2, vocab_size=1001, tie_word_embeddings=True)
    if rank == 0:
        R.make_hf_model(cfg, seed=0).save_pretrained(ckpt)
    dist.barrier()
    hf, _ = R.load_transformers(ckpt, task="causal_lm", device=device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (4, 64), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    mask[2, -12:] = 0
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    real = mask.bool()

    # 1. logits
    for packed in (False, True):
        chunks = parallm.build_model(ckpt, packed=packed, sequence_parallel=packed and tp > 1)
        parallm.load_hf_weights(chunks, ckpt)
        with torch.no_grad():
            out = parallm.forward(chunks, ids, mask)
        report(f"fp32 logits tp={tp} pp={pp} packed={packed}", (out - ref)[real].abs().max().item(), 1e-3)
        info(f"attention backend (fp32, packed={packed}): {chunks[0].attn_impl}")
    chunks = parallm.build_model(ckpt, packed=True, dtype=torch.bfloat16)
    parallm.load_hf_weights(chunks, ckpt)
    with torch.no_grad():
        out = parallm.forward(chunks, ids, mask)
    rel = ((out - ref)[real].abs().max() / ref[real].abs().max()).item()
    report("bf16 packed logits, relative to fp32 transformers", rel, 5e-2)
    info(f"attention backend (bf16, packed): {chunks[0].attn_impl}")
    del chunks, out

    # 2. log-probs and entropy, vocab-parallel
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    with torch.no_grad():
        stats = parallm.forward(chunks, ids, mask, output="logprobs+entropy", temperature=0.7, token_chunk=37)
    logp = (ref / 0.7).log_softmax(-1)
    want_lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    want_ent = -(logp.exp() * logp).sum(-1)
    report("log-probs (T=0.7, chunks of 37 tokens)", (stats.logprobs[:, :-1] - want_lp)[real[:, :-1]].abs().max().item(),
           1e-3)
    report("entropy (T=0.7)", (stats.entropy - want_ent)[real].abs().max().item(), 1e-3)

    # 3. export stream
    want = R.hf_state(hf)
    for what, kw in (("to every rank", {}), ("dst_ranks=[0]", dict(dst_ranks=[0])),
                     ("bf16 on the sender, 1 MB buckets", dict(dtype=torch.bfloat16, bucket_bytes="1MB"))):
        names, worst = [], 0.0
        for name, t in parallm.export_hf_tensors(chunks, **kw):
            names.append(name)
            w = want[name].to(t.dtype)
            worst = max(worst, float("inf") if not torch.equal(t.cpu(), w) else 0.0)
        receives = "dst_ranks" not in kw or rank == 0
        complete = sorted(names) == sorted(want) if receives else names == []
        report(f"export {what}: tensors not bit-exact or missing", 0.0 if complete and worst == 0 else 1.0, 0)

    # 4. one training step against transformers + torch AdamW
    # eps 1e-3: Adam's first step is lr * g / (|g| + eps), which for |g| near 0 turns last-bit gradient differences
    # into differences of order lr; a large eps bounds that amplification at lr / eps (here 1)
    hp = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-3, weight_decay=0.1)
    opt = parallm.build_optimizer(chunks, **hp)

    def step(model_chunks, optimizer):
        loss = parallm.forward_backward(model_chunks, ids, mask, loss_fn=R.causal_lm_loss, num_microbatches=2)
        parallm.finalize_grads(model_chunks)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    loss = step(chunks, opt)
    hf.train()
    decay = [p for n, p in hf.named_parameters() if p.dim() > 1]
    no_decay = [p for n, p in hf.named_parameters() if p.dim() <= 1]
    hf_opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], **hp)
    ref_loss = 0.0
    for half in (slice(0, 2), slice(2, 4)):     # the mean over the 2 microbatches, as forward_backward computes it
        lg = hf(input_ids=ids[half], attention_mask=mask[half], position_ids=pos[half]).logits
        part = R.causal_lm_loss(lg, ids[half], mask[half]) / 2
        part.backward()
        ref_loss += part.item()
    hf_opt.step()
    report("training step: loss vs transformers", abs(loss - ref_loss), 1e-4)
    got = {k: v.cpu() for k, v in (parallm.save_hf_weights(chunks) or {}).items()}
    if rank == 0:
        _, d, problems = R.compare_states(got, R.hf_state(hf))
        info(f"after the AdamW step: {problems or 'every tensor bit-exact'}")
    else:
        d = 0.0
    d = torch.tensor([d], device=device)
    dist.broadcast(d, src=0)
    report("training step: updated weights vs transformers + torch AdamW", d.item(), 2e-6)

    # 5. training checkpoint round trip, then one more step on both
    path = os.path.join(box[0], "train-ckpt")
    parallm.save_checkpoint(path, chunks, opt, step=1, overwrite=True)
    fresh = parallm.build_model(ckpt)
    fresh_opt = parallm.build_optimizer(fresh, **hp)
    parallm.load_checkpoint(path, fresh, fresh_opt)
    a, b = parallm.save_hf_weights(chunks), parallm.save_hf_weights(fresh)
    same = torch.tensor([float(rank != 0 or R.compare_states(a, b)[0])], device=device)
    step(chunks, opt)
    step(fresh, fresh_opt)
    a, b = parallm.save_hf_weights(chunks), parallm.save_hf_weights(fresh)
    same *= float(rank != 0 or R.compare_states(a, b)[0])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    report("training checkpoint: loaded weights and the next step not bit-exact", 1.0 - same.item(), 0)
    del chunks, fresh, opt, fresh_opt, hf, hf_opt

    # 6. mixture of experts at ep = world
    parallm.destroy_parallel()
    parallm.init_parallel(tp=1, pp=1, ep=world)
    def logits_check(name, cfg, seed, label):
        """Save ``cfg``'s model (rank 0), load it in parallm at the current layout: fp32 logits against
        transformers on the device. Returns the checkpoint and the loaded chunks."""
        ckpt = os.path.join(box[0], name)
        if rank == 0:
            R.make_hf_model(cfg, seed=seed).save_pretrained(ckpt)
        dist.barrier()
        hf, _ = R.load_transformers(ckpt, task="causal_lm", device=device)
        with torch.no_grad():
            ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        del hf
        loaded = parallm.build_model(ckpt)
        parallm.load_hf_weights(loaded, ckpt)
        with torch.no_grad():
            out = parallm.forward(loaded, ids, mask)
        report(label, (out - ref)[real].abs().max().item(), 1e-3)
        return ckpt, loaded

    moe_cfg = R.tiny_config("qwen3_moe", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, vocab_size=1001, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64, norm_topk_prob=True)
    moe_ckpt, chunks = logits_check("moe", moe_cfg, 2, f"MoE (8 experts, top 2) fp32 logits at ep={world}")

    # 7. MoE training with ZeRO at ep = world: one step, a training checkpoint, loaded at ep = 1
    opt = parallm.build_optimizer(chunks, **hp, shard_over_dp=True)
    step(chunks, opt)
    path = os.path.join(box[0], "moe-train-ckpt")
    parallm.save_checkpoint(path, chunks, opt, step=1, overwrite=True)
    a = parallm.save_hf_weights(chunks)
    del chunks, opt
    parallm.destroy_parallel()
    parallm.init_parallel(tp=1, pp=1)
    chunks = parallm.build_model(moe_ckpt)
    opt = parallm.build_optimizer(chunks, **hp)
    parallm.load_checkpoint(path, chunks, opt)
    b = parallm.save_hf_weights(chunks)
    same = torch.tensor([float(rank != 0 or R.compare_states(a, b)[0])], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    report(f"MoE training checkpoint (ZeRO, ep={world}) loaded at ep=1: weights not bit-exact", 1.0 - same.item(), 0)

    # 8. determinism: the same MoE step twice, bit for bit (no atomic adds in the expert combine)
    def moe_pass():
        for p in chunks[0].parameters():
            p.grad = None
        parallm.forward_backward(chunks, ids, mask, loss_fn=R.causal_lm_loss, num_microbatches=2)
        return [p.grad.clone() for p in chunks[0].parameters() if p.grad is not None]
    first, second = moe_pass(), moe_pass()
    differ = sum(not torch.equal(a, b) for a, b in zip(first, second)) + abs(len(first) - len(second))
    report("MoE: gradients of two identical passes not bit-identical (tensors)", float(differ), 0)

    # 8a. kernel choices on the device (every rank agreed at build): CUDA device 0 is CUDA, not the CPU's kernels;
    # torch._grouped_mm gives an expert that no token chose exactly zero gradient (PyTorch reports non-zero ones
    # on SM100), else parallm uses the loop
    from parallm.model.kernels import kernel_choices
    from parallm.model.layers.moe import empty_group_problem
    choices = kernel_choices(chunks)
    info(f"kernels chosen on {device}: {choices}")
    cpu_kernels = [k for k, v in choices.items() if "cpu" in v] if device.type == "cuda" else []
    report(f"CPU kernels chosen on a CUDA device ({cpu_kernels or 'none'})", float(len(cpu_kernels)), 0)
    for dtype in (torch.bfloat16, torch.float32):
        problem = empty_group_problem(device, dtype)
        info(f"torch._grouped_mm {dtype}: {problem or 'empty groups get zero gradient, equal to the loop'}")
        report(f"torch._grouped_mm {dtype} check (1 = failed; parallm then uses the loop)", float(bool(problem)), 0)
    del chunks, opt, first, second
    parallm.destroy_parallel()

    # 8b. YaRN RoPE (a Qwen2 long-context config) on the device: fp32 logits against transformers
    parallm.init_parallel(tp=1, pp=1)
    yarn_cfg = R.tiny_config("qwen2", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, vocab_size=1001,
                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                              "original_max_position_embeddings": 16})
    _, chunks = logits_check("yarn", yarn_cfg, 3, "YaRN (Qwen2, factor 4) fp32 logits")
    del chunks
    parallm.destroy_parallel()

    # 9. pp = 2 with 64 MiB stage-boundary messages
    if world >= 2:
        hidden, tokens = (1024, 1024) if args.cpu else (4096, 4096)
        parallm.init_parallel(tp=1, pp=2)
        big_ckpt = os.path.join(box[0], "big")
        big_cfg = R.tiny_config("llama", hidden_size=hidden, intermediate_size=1024, num_hidden_layers=2,
                                num_attention_heads=hidden // 128, num_key_value_heads=hidden // 128, head_dim=128,
                                vocab_size=512)
        if rank == 0:
            R.make_hf_model(big_cfg, seed=3).save_pretrained(big_ckpt)
        dist.barrier()
        big_ids = torch.randint(0, 512, (2, tokens), generator=g).to(device)
        big_mask = torch.ones_like(big_ids)
        chunks = parallm.build_model(big_ckpt)
        parallm.load_hf_weights(chunks, big_ckpt)
        info(f"pp=2 message: {tokens * hidden * 4 / 2 ** 20:.0f} MiB per activation / gradient")
        t0 = time.perf_counter()
        loss = parallm.forward_backward(chunks, big_ids, big_mask, loss_fn=R.causal_lm_loss, num_microbatches=2)
        info(f"pp=2 step with big messages: {time.perf_counter() - t0:.2f} s")
        del chunks
        hf_big, _ = R.load_transformers(big_ckpt, task="causal_lm", device=device)
        with torch.no_grad():
            ref_loss = sum(R.causal_lm_loss(hf_big(input_ids=big_ids[i:i + 1]).logits, big_ids[i:i + 1],
                                            big_mask[i:i + 1]).item() for i in range(2)) / 2
        report("pp=2 step with 64 MiB messages: loss vs transformers", abs(loss.item() - ref_loss), 1e-4)
        del hf_big
        parallm.destroy_parallel()
    else:
        info("pp=2 step with 64 MiB messages: needs 2 GPUs (NCCL refuses two ranks on one device); not run")

    # 10. throughput of a 1B-shaped LLaMA step (every rank its own step: dp = world)
    parallm.init_parallel(tp=1, pp=1)
    throughput(parallm, R, device, rank, box[0], info, cpu=args.cpu)
    parallm.destroy_parallel()
    return 0 if ok else 1


PEAK_TFLOPS = {   # dense, without sparsity: (fp32 without tensor cores, bf16 tensor cores)
    "H200": (67.0, 989.0), "H100": (67.0, 989.0), "A100": (19.5, 312.0), "L40S": (91.6, 362.0),
}


def _peak(dtype) -> float | None:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for key, (fp32, bf16) in PEAK_TFLOPS.items():
        if key in name:
            return fp32 if dtype == torch.float32 else bf16
    return None


def throughput(parallm, R, device, rank, workdir, info, *, cpu: bool) -> None:
    """tokens/s and model FLOPs utilisation of a training step, parallm next to transformers (same model, same
    tokens, same AdamW), one figure per INFO line. Model FLOPs per token: 6 x (matmul parameters) + 6 x layers x
    hidden x sequence (causal attention scores and values); the embedding lookup is not a matmul."""
    import importlib.util
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, head_dim=64, vocab_size=128256)
    batch, seq = 4, 2048
    if cpu:
        shape.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=1000)
        batch, seq = 2, 128
    cfg = R.tiny_config("llama", **shape)
    path = os.path.join(workdir, "llama-1b")
    if rank == 0:
        R.make_hf_model(cfg, seed=4).save_pretrained(path)
    dist.barrier()
    h, L = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    matmul = L * (h * (h + 2 * kv) + h * h + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size
    flops = batch * seq * (6 * matmul + 6 * L * h * seq)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(device)
    mask = torch.ones_like(ids)
    flash = importlib.util.find_spec("flash_attn") is not None

    def timed(fn, reps=3):
        fn()                                          # warm-up (allocations, kernels)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps

    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        chunks = parallm.build_model(path, packed=True, dtype=dtype)
        parallm.load_hf_weights(chunks, path)
        opt = parallm.build_optimizer(chunks, lr=1e-5)

        def ours():
            parallm.forward_backward(chunks, ids, mask, loss_fn=R.causal_lm_loss)
            parallm.finalize_grads(chunks)
            opt.step()
            opt.zero_grad()
        t_ours = timed(ours)
        backend = chunks[0].attn_impl
        chunks = opt = None                           # free the model before transformers' is built
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation="flash_attention_2" if flash and dtype != torch.float32 else "sdpa"
        ).to(device)
        hf.train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-5)

        def theirs():
            R.causal_lm_loss(hf(input_ids=ids).logits, ids, mask).backward()
            hf_opt.step()
            hf_opt.zero_grad()
        t_hf = timed(theirs)
        hf = hf_opt = None
        peak = _peak(dtype)
        for who, t, extra in (("parallm", t_ours, f", attention {backend}"),
                              ("transformers", t_hf, f", attention {'flash_attention_2' if flash and dtype != torch.float32 else 'sdpa'}")):
            mfu = f"{flops / t / 1e12 / peak:.3f}" if peak else "n/a (peak unknown)"
            info(f"throughput {name} {who}: {batch * seq / t:.0f} tokens/s, {flops / t / 1e12:.1f} TFLOP/s, "
                 f"MFU {mfu}{extra}")
        info(f"throughput {name}: parallm step time / transformers step time = {t_ours / t_hf:.3f}")


if __name__ == "__main__":
    sys.exit(main())
