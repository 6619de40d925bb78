"""vLLM as the rollout engine of an RL loop.

    from parallm.integrations import vllm as pv

    # an engine in the trainer's process (one tensor-parallel rank), on one rank
    llm = pv.launch(model_dir, rank=0, dtype="float32")   # collective; a vllm.LLM on rank 0, None elsewhere
    stats = pv.push_weights(chunks, llm, rank=0)           # collective; {"bytes", "seconds", "gbps", ...}
    stats = pv.push_adapter(chunks, llm, rank=0)           # LoRA: the adapter (engine with enable_lora=True;
    llm.generate(..., lora_request=stats["lora_request"])  # merged weights otherwise), see docs/lora.md

    # engines in other processes: `vllm serve` servers (URLs) or vllm.LLM objects with worker processes
    conn = pv.connect(["http://host:8000", "http://host:8001"], backend="parallm_shm")   # collective
    stats = pv.push_weights(chunks, conn)                  # collective; one stream fanned out to every engine

vLLM is imported by this package only (``import parallm`` never imports it; importing this package does not
either: each function imports it when called). One concern per module: :mod:`.inprocess` (``launch``: an engine
in the trainer's process), :mod:`.push` (``push_weights``), :mod:`.source` (a vLLM ``WeightSource`` over the
export stream, for vLLM's own trainer-side backends), :mod:`.backends` (parallm's worker-side weight-transfer
backends ``parallm_shm`` and ``parallm_gloo``, registered in vLLM through the ``vllm.general_plugins`` entry
point), :mod:`.serve` (``serve``: a ``vllm serve`` engine in processes of its own, under :mod:`._watchdog`),
:mod:`.client` (``connect``), :mod:`.engines` (the engines' control calls and threads), :mod:`.transport` (the
shared-memory file, the gloo rendezvous, the per-connection secret), :mod:`.remote` (the push into engines in
other processes), :mod:`.fixes` (what the engine's model must look like; vLLM-CPU's reload fixes). See
docs/rl.md.
"""

from .client import Connection, EngineFailed, connect
from .inprocess import GPU_MEMORY_SHARE, KV_CACHE_BYTES, gpu_memory_default, launch
from .lora import push_adapter
from .push import push_weights
from .serve import Server, serve
from .source import export_source

__all__ = ["GPU_MEMORY_SHARE", "KV_CACHE_BYTES", "Connection", "EngineFailed", "Server", "connect",
           "export_source", "gpu_memory_default", "launch", "push_adapter", "push_weights", "serve"]
