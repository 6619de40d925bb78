"""GPU smoke check of a push from a CUDA trainer into engines in other processes (issue 44 item 6: the remote push
hands the export stream host memory, the shared-memory slots or gloo's sender buffers, as ``out``; it used to
raise on the first bucket for a model on CUDA). Run by scripts/gpu_smoke.sh on every visible GPU (1, 2 or 4); no
vLLM needed: the engines are stand-ins that read each update as parallm's worker backends do
(``tests/vllm_engines.StandIn``). Written on a CPU-only machine, never run on a GPU:

    torchrun --nproc-per-node 2 scripts/gpu_checks/vllm_remote.py [--cpu]

  R1. A tied Qwen2 at tp = every rank on cuda:<local rank>, two stand-in engines through parallm_shm, 256 KB
      buckets (several: both slots reused): every tensor the stream yields to the fan-out lies in the
      shared-memory file (host memory), and what each engine read is bit-equal to save_hf_weights.
  R2. The same after an AdamW step, through parallm_gloo (the sender's buffers are host memory too).

``--cpu``: a dry run on gloo / CPU with the device-to-host copy forced (the logic tests/test_vllm_fanout.py runs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from gpu_common import Checks, shared_tmp, start  # noqa: E402


def _push(chunks, backend: str, checks: Checks, name: str) -> None:
    import parallm
    import vllm_engines as ve
    from parallm.integrations import vllm as pv
    from parallm.integrations.vllm import client, remote
    engines = [ve.StandIn("a"), ve.StandIn("b")]
    client._handles = lambda _, timeout: engines
    conn = pv.connect(["a", "b"], backend=backend, timeout=120)
    seen, add = [], remote._Fanout.add

    def watched(self, tensor_name, tensor):
        seen.append(tensor.device.type == "cpu" and any(
            b.data_ptr() <= tensor.data_ptr() < b.data_ptr() + b.numel() for b in self.buffers))
        return add(self, tensor_name, tensor)
    remote._Fanout.add = watched
    try:
        pv.push_weights(chunks, conn, bucket_bytes="256KB")
    finally:
        remote._Fanout.add = add
    state = {k: v.cpu() for k, v in parallm.save_hf_weights(chunks).items()}
    if torch.distributed.get_rank() == conn.sender:
        exact = [sorted(e.got) == sorted(state) and all(torch.equal(e.got[n], state[n]) for n in state)
                 for e in engines]
        checks(f"{name} tensors in the sender's host slots", f"{sum(seen)}/{len(seen)}", "all",
               ok=bool(seen) and all(seen))
        checks(f"{name} engines bit-equal to save_hf_weights", exact, [True, True], ok=exact == [True, True])
    conn.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU (the device-to-host copy forced)")
    args = ap.parse_args()
    world, rank, device = start(args.cpu, 29533)
    import parallm
    from parallm import verify
    from parallm.checkpoint import export_run as export
    if args.cpu:
        export._staged = lambda buf, dev: True
    parallm.init_parallel(tp=world, backend="gloo" if args.cpu else None)
    checks = Checks(rank)
    path = os.path.join(shared_tmp("parallm-gpu-remote-"), "ckpt")
    if rank == 0:
        cfg = verify.tiny_config("qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                 tie_word_embeddings=True)
        verify.make_hf_model(cfg, seed=0).save_pretrained(path, safe_serialization=True)
    torch.distributed.barrier()
    chunks = parallm.build_model(path)
    parallm.load_hf_weights(chunks, path)
    _push(chunks, "parallm_shm", checks, "R1 parallm_shm from " + device.type)
    opt = parallm.build_optimizer(chunks, lr=1e-2)
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    parallm.forward_backward(chunks, ids, loss_fn=lambda logits, ids, mask: logits.float().pow(2).mean())
    parallm.finalize_grads(chunks)
    opt.step()
    _push(chunks, "parallm_gloo", checks, "R2 parallm_gloo from " + device.type)
    parallm.destroy_parallel()
    return checks.finish("vllm_remote")


if __name__ == "__main__":
    sys.exit(main())
