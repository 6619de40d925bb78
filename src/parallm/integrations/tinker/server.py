"""One rank of the Tinker server: builds the model (once, at the layout given), then rank 0 serves HTTP and leads
the dispatcher while every other rank follows it (:mod:`.dispatch`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time

import torch

import parallm

from .checkpoints import CheckpointStore
from .dispatch import Leader, follow, new_control_group
from .http_app import start_http
from .operations import OperationsRoutes
from .preflight import TOKENIZER_FILES
from .parallm_sampler import ParallmSampler
from .sampling import SampleInputError
from .sampling_routes import SamplingRoutes
from .service import ServiceBase
from .trainer import Trainer
from .training_routes import TrainingRoutes

__all__ = ["Service", "run_rank"]

log = logging.getLogger("parallm.tinker")


class Service(TrainingRoutes, SamplingRoutes, OperationsRoutes, ServiceBase):
    """Everything rank 0 answers (the route methods of its four parts)."""


def _model_facts(model: str) -> tuple[str, dict]:
    from ...checkpoint.hf_dir import resolve_checkpoint
    directory = os.path.abspath(resolve_checkpoint(model))
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    return directory, {"vocab": int(text["vocab_size"]), "arch": (cfg.get("architectures") or ["?"])[0],
                       "model_type": cfg.get("model_type"),
                       "max_position": int(text.get("max_position_embeddings") or 4096),
                       "eos": cfg.get("eos_token_id", text.get("eos_token_id"))}


# The adapters' targets: PEFT's "all-linear" (every attention and MLP projection, routed experts included), except
# on families where "all-linear" reaches linears parallm does not adapt (Gemma 4's per-layer-input projections and
# router: model/layers/lora_gemma4.py; the MoE Gated DeltaNet models' and Qwen2-MoE's shared_expert_gate and
# Qwen3-Next's router: model/layers/lora_gdn.py), which get the attention and MLP projections (and the Gated DeltaNet's) by name (what
# Tinker's train_attn / train_mlp stand for).
ATTN_MLP = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QWEN3_5 = ATTN_MLP + ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
# (the Qwen3.5 / Qwen3.6 vision-language wrappers, qwen3_5 / qwen3_5_moe: "all-linear" would reach the vision tower)
BY_NAME = {"gemma4": ATTN_MLP, "gemma4_text": ATTN_MLP, "qwen2_moe": ATTN_MLP, "qwen3_5_moe_text": QWEN3_5,
           "qwen3_5_moe": QWEN3_5, "qwen3_5": QWEN3_5, "qwen3_next": ATTN_MLP + ("in_proj_qkvz", "in_proj_ba", "out_proj")}


def _lora_targets(args, facts):
    if facts.get("model_type") in BY_NAME:
        return BY_NAME[facts["model_type"]] + (("lm_head",) if args.lora_unembed == "train" else ())
    return ("all-linear", "lm_head") if args.lora_unembed == "train" else "all-linear"


def _build(args, directory, facts):
    parallm.init_parallel(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, timeout_s=args.timeout)
    lora = parallm.LoraConfig(args.lora_rank, args.lora_alpha, _lora_targets(args, facts))
    chunks = parallm.build_model(directory, lora=lora, dtype=getattr(torch, args.dtype))
    parallm.load_hf_weights(chunks, directory)
    opt = parallm.build_optimizer(chunks, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
    return chunks, opt


def _config(args, directory, facts, template, chunks) -> dict:
    names = {args.model, directory, args.model_name or args.model}
    has_tok = any(os.path.exists(os.path.join(directory, f)) for f in TOKENIZER_FILES)
    warn = None
    if args.lora_unembed == "skip":
        warn = ("parallm's Tinker server trains no LoRA adapter on the output head: train_unembed=True clients "
                "get the attention / MLP adapters only (--lora-unembed skip)")
    return {"model_name": args.model_name or args.model, "model_names": names, "vocab": facts["vocab"],
            "arch": facts["arch"], "max_context": min(facts["max_position"], args.max_context or 1 << 30),
            "tokenizer_id": directory if has_tok else (args.model_name or args.model), "lora_rank": args.lora_rank,
            "lora_alpha": args.lora_alpha, "lora_unembed": args.lora_unembed, "adapter_template": template,
            "session_warning": warn, "max_body": args.max_body_mb << 20, "max_sample_tokens": args.max_sample_tokens,
            "keep_sampler_snapshots": args.keep_sampler_snapshots, "stability_ttl_s": args.stability_ttl,
            "stability_max_tokens": args.stability_max_tokens,
            "num_experts": chunks[0].spec.moe.num_experts if chunks[0].spec.moe is not None else 1}


def _sampler(args, leader, directory, config, facts):
    kind = "vllm" if getattr(args, "engine_url", None) else args.sampler
    if kind == "auto":
        try:
            import vllm  # noqa: F401
            kind = "vllm"
        except ImportError:
            kind = "parallm"
    if kind == "none":
        return None
    if kind == "vllm":
        return _engines(args, directory, config, facts)
    eos = facts["eos"]
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    tokenizer = None
    if config["tokenizer_id"] == directory:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(directory)

    def run(item):
        done, box = threading.Event(), {}
        leader.submit(item, lambda ok, v, c: (box.update(ok=ok, v=v, c=c), done.set()))
        done.wait()
        if not box["ok"]:
            raise (SampleInputError if box["c"] == "user" else RuntimeError)(box["v"])
        return box["v"]
    return ParallmSampler(run, max_model_len=config["max_context"], eos=eos, tokenizer=tokenizer)


def _engines(args, directory, config, facts):
    """``--engines`` ``vllm serve`` engines (``--engine-tp`` workers each), started side by side, or the
    ``--engine-url`` engines started elsewhere (remote_engine.py), behind one router (:mod:`.router`)."""
    from .engine_adapters import HeadSupport, zero_adapter
    from .router import EngineRouter
    from .sampling import VllmSampler
    urls = getattr(args, "engine_url", None) or []
    if urls:               # snapshots go where those engines read them (created here: the zero adapter too)
        config["memory_root"] = tempfile.mkdtemp(prefix="parallm-tinker-snapshots-", dir=args.snapshot_dir)
    head, support = None, None
    if args.lora_unembed == "train":
        zero_dir = os.path.join(config.get("memory_root") or os.path.dirname(config["adapter_template"]),
                                "zero-engine")
        head = {"arch": facts["arch"], "zero_adapter": zero_adapter(config["adapter_template"], zero_dir)}
        support = HeadSupport(facts["arch"])                # asked once for every engine
    common = dict(lora_rank=args.lora_rank, max_model_len=config["max_context"], timeout=args.sampler_timeout,
                  head=head, head_support=support)
    if urls:
        engines = [VllmSampler(directory, url=u, **common,
                               probe=(config["adapter_template"], os.path.join(config["memory_root"], f"probe-{i}")))
                   for i, u in enumerate(urls)]
    else:
        engines = [VllmSampler(directory, tensor_parallel_size=getattr(args, "engine_tp", 1), **common)
                   for _ in range(getattr(args, "engines", 1))]
    full = None
    if getattr(args, "full_engine", False):
        full = VllmSampler(directory, lora_rank=0, max_model_len=config["max_context"], timeout=args.sampler_timeout,
                           tensor_parallel_size=getattr(args, "engine_tp", 1), pushed=True)
    return EngineRouter(engines, full_engine=full)


def _memory_root(args, sampler, config) -> str | None:
    """Where ephemeral LoRA snapshots go (sampling_routes.py): a private directory in /dev/shm (the temporary
    directory where there is none), or in ``--snapshot-dir`` for ``--engine-url`` engines (made by
    :func:`_engines`); None (the checkpoint directory, as before) for the parallm sampler across nodes, whose
    ranks on other nodes read the snapshot too."""
    from .router import EngineRouter
    if config.get("memory_root"):
        return config["memory_root"]
    if getattr(args, "nnodes", 1) > 1 and not isinstance(sampler, EngineRouter):
        return None
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="parallm-tinker-snapshots-", dir=shm)         # mode 0700


def _janitor(service, stop: threading.Event):
    ticks = 0
    while not stop.wait(5.0):
        ticks += 1
        try:
            service.skip_gaps()
            service.expire_sessions()
            service.stability.prune()
            if ticks % 6 == 0:
                service.expire_checkpoints()
        except Exception:  # noqa: BLE001 - keep the janitor alive
            log.exception("janitor")


def _write_ready(path: str, info: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)


def _announce(args, url: str, sampler) -> None:
    """The ready file: written once the server listens (``sampler_ready`` false while a vLLM engine starts),
    written again once the sampler is ready or failed (``sampler``: its state, as ``healthz`` reports it)."""
    info = {"url": url, "pid": os.getpid(), "time": time.time(),
            "sampler_pid": sampler.pid() if hasattr(sampler, "pid") else None,
            "sampler_url": (getattr(sampler, "url", None) or [None])[0],     # engine 0's; each takes its own key
            "engine_urls": getattr(sampler, "url", None), "engine_pids": sampler.pids() if hasattr(sampler, "pids")
            else None, "full_engine_url": getattr(getattr(sampler, "full_engine", None), "url", None),
            "sampler": sampler.state() if sampler is not None else "none"}
    info["sampler_ready"] = info["sampler"] in ("ready", "none")
    if args.ready_file:
        _write_ready(args.ready_file, info)
    if sampler is None or info["sampler_ready"]:
        return

    def wait():
        state = sampler.wait()
        print(f"parallm serve-tinker: sampler {state}", flush=True)
        if args.ready_file:
            _write_ready(args.ready_file, dict(info, sampler=state, sampler_ready=state == "ready",
                                               time=time.time()))
    threading.Thread(target=wait, name="tinker-sampler-ready", daemon=True).start()


def run_rank(args) -> int:
    """Every rank: build, then serve (rank 0) or follow. Returns the exit code."""
    directory, facts = _model_facts(args.model)
    chunks, opt = _build(args, directory, facts)
    store = CheckpointStore(args.checkpoint_dir)
    template = os.path.join(store.root, "_parallm_init", "template")
    parallm.save_hf_adapter(chunks, template, overwrite=True)
    group = new_control_group(args.timeout)
    trainer = Trainer(chunks, opt, group=group, max_rows=args.microbatch_rows, model_dir=directory,
                      dtype=getattr(torch, args.dtype))
    if torch.distributed.get_rank() != 0:
        follow(trainer.execute, group)
        parallm.destroy_parallel()
        return 0
    leader = Leader(trainer.execute, group, cobatch=args.cobatch)
    config = _config(args, directory, facts, template, chunks)
    sampler = _sampler(args, leader, directory, config, facts)
    config["memory_root"] = _memory_root(args, sampler, config)
    service = Service(leader=leader, config=config, checkpoints=store, sampler=sampler,
                      session_timeout_s=args.session_timeout)
    api_key = args.api_key or os.environ.get("PARALLM_TINKER_API_KEY")
    httpd = start_http(service, host=args.host, port=args.port, api_key=api_key, max_body=config["max_body"])
    url = f"http://{args.host}:{httpd.server_address[1]}"
    stop = threading.Event()
    threading.Thread(target=_janitor, args=(service, stop), daemon=True).start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: leader.stop())
    print(f"parallm serve-tinker: {config['model_name']} at tp={args.tp} pp={args.pp} on {url} "
          f"(sampler: {type(sampler).__name__ if sampler else 'none'})", flush=True)
    _announce(args, url, sampler)
    try:
        leader.run()
    finally:
        stop.set()
        httpd.shutdown()
        if sampler is not None:
            sampler.close()
        if config["memory_root"]:
            shutil.rmtree(config["memory_root"], ignore_errors=True)
    if leader.lost is None:
        parallm.destroy_parallel()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)            # a lost peer: gloo's teardown would wait for it
