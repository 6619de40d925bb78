"""GPU smoke check of export_hf_tensors(out=...) (the hook parallm_shm's one-copy push uses), run by
scripts/gpu_smoke.sh with 2 GPUs (never run: no GPU was lent yet). No vLLM needed:

    torchrun --nproc-per-node 2 scripts/gpu_checks/export_out.py

  E1. A tied Qwen2 at tp2 on cuda:<local rank>; export_hf_tensors(dst_ranks=[0], bucket_bytes="256KB",
      out=into) where `into` hands out two CUDA buffers in turn (bucket k -> buffer k % 2) and the consumer reads
      every tensor on a side stream (made visible to the current stream before the next request): every yielded
      tensor is a view of one of the two buffers, and each equals copy=True's tensor bit for bit (torch.equal),
      compared after the consumer's side-stream clone. A missing fence (the stream rewriting a buffer the side
      stream still reads) shows as a mismatch.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))


def main():
    import parallm
    from parallm import verify
    rank = int(os.environ.get("RANK", "0"))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    parallm.init_parallel(tp=2)
    cfg = verify.tiny_config("qwen2", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                             tie_word_embeddings=True)
    d = tempfile.mkdtemp() if rank == 0 else None
    box = [d]
    dist.broadcast_object_list(box, src=0)
    d = box[0]
    if rank == 0:
        verify.make_hf_model(cfg, seed=0).save_pretrained(d, safe_serialization=True)
    dist.barrier()
    chunks = parallm.build_model(d)
    parallm.load_hf_weights(chunks, d)
    bufs = {}

    def into(k, numel):
        b = bufs.get(k % 2)
        if b is None or b.numel() < numel:
            bufs[k % 2] = b = torch.empty(numel, dtype=torch.float32, device="cuda")
        return b

    side = torch.cuda.Stream()
    got, inside = [], True
    for name, t in parallm.export_hf_tensors(chunks, bucket_bytes="256KB", dst_ranks=[0], out=into):
        inside &= any(t.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in bufs.values())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            got.append((name, t.clone()))
        torch.cuda.current_stream().wait_stream(side)
    ref = dict(parallm.export_hf_tensors(chunks, bucket_bytes="256KB", dst_ranks=[0], copy=True))
    if rank == 0:
        exact = len(got) == len(ref) and all(torch.equal(t, ref[n]) for n, t in got)
        ok = inside and exact
        print(f"{'PASS' if ok else 'FAIL'} E1 export_hf_tensors(out=) on CUDA: views of the buffers {inside}, "
              f"bit-exact {exact} ({len(got)} tensors)", flush=True)
    parallm.destroy_parallel()


if __name__ == "__main__":
    main()
