"""Test helpers: tiny seeded transformers models with non-trivial weights, and a gloo rank launcher."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
import time
import traceback
from datetime import timedelta

import torch

SPAWN_TIMEOUT_S = float(os.environ.get("PARALLM_TEST_SPAWN_TIMEOUT_S", "240"))


# -- tiny HF models ------------------------------------------------------------------------------------------

def tiny_config(family: str, **overrides):
    import transformers
    base = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=101, max_position_embeddings=64, rms_norm_eps=1e-5,
                tie_word_embeddings=False, attn_implementation="eager")
    base.update(MOE_DEFAULTS.get(family, {}))
    base.update(overrides)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "mixtral": transformers.MixtralConfig}[family]
    return cls(**base)


# Mixture-of-experts families: 4 experts, top-2, experts narrower than the dense MLP (Mixtral's experts are
# intermediate_size wide; Qwen-MoE's dense layers use intermediate_size, experts moe_intermediate_size).
MOE_DEFAULTS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}


def hub_state_dict(model, path: str) -> dict[str, torch.Tensor]:
    """What ``save_pretrained`` writes, read back from the files (the Hub's names: per-expert tensors for
    transformers 5's fused MoE experts)."""
    from safetensors.torch import load_file
    model.save_pretrained(path, safe_serialization=True)
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


# Every weight non-trivial: norms around 1, biases non-zero, matrices ~N(0, 0.08) (the demo's own generator).
from parallm.cli_impl.demo import randomize_weights as randomize_  # noqa: E402


def write_config(path, config: dict) -> str:
    """A checkpoint directory holding only this config.json."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


def write_ckpt(path, state: dict, config: dict) -> str:
    """A single-file safetensors checkpoint of ``state`` (any keys / shapes: for broken checkpoints)."""
    from safetensors.torch import save_file
    write_config(path, config)
    save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(path, "model.safetensors"))
    return str(path)


def make_hf_model(config, *, task: str = "causal_lm", seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    if task == "value":
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = 0
        model = transformers.AutoModelForSequenceClassification.from_config(config, torch_dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model = model.float().eval()
    randomize_(model, seed)
    if getattr(config, "tie_word_embeddings", False) and task == "causal_lm":
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def save_checkpoint(model, path: str, *, max_shard_size: str | None = None) -> str:
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(path, **kwargs)
    return path


def hf_state_dict(model) -> dict[str, torch.Tensor]:
    """The state dict an HF checkpoint of this model holds (tied lm_head dropped as save_pretrained does)."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    return sd


def rewrite_config_4x(path: str) -> None:
    """Turn a transformers-5 config.json into the transformers-4.x style (rope_theta / rope_scaling)."""
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    rp = dict(cfg.pop("rope_parameters", None) or {})
    cfg["rope_theta"] = rp.pop("rope_theta", 10000.0)
    kind = rp.pop("rope_type", "default")
    rp.pop("type", None)
    cfg["rope_scaling"] = None if kind == "default" else {"type": kind, **rp}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)


def padded_batch(vocab: int, *, seed: int = 1, batch: int = 4, seq: int = 10):
    """input_ids and attention_mask with a full row, left padding and right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, :3] = 0          # left padding
    mask[2, -4:] = 0         # right padding
    if batch > 3:
        mask[3, :1] = 0
        mask[3, -2:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hf_logits(model, ids, mask):
    import parallm
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask))
    return out.logits.float()


def max_diff_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.bool()
    return (a[m] - b[m]).abs().max().item()


# -- launching gloo ranks ------------------------------------------------------------------------------------

def _worker(fn, rank, world, init_file, queue, args_file, timeout):
    import faulthandler
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    # A hung rank prints where it is stuck, then exits, instead of waiting for the test's timeout.
    faulthandler.dump_traceback_later(max(timeout - 15, 5), exit=True)
    try:
        args = torch.load(args_file, weights_only=False)
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                             world_size=world, timeout=timedelta(seconds=180))
        result = fn(rank, world, *args)
        try:  # the queue's feeder thread would drop an unpicklable result silently and the test would hang
            mp.reduction.ForkingPickler.dumps(result)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"the rank function's result cannot be sent back to the test process: {e}") from e
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "err", traceback.format_exc()))
    finally:
        try:
            import parallm
            parallm.destroy_parallel()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "transformers", "megatron.core.tensor_parallel", "parallm",
                                     "helpers"])
    return _CTX


def run_ranks(fn, world: int, *args, timeout: float = SPAWN_TIMEOUT_S):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results (list by rank).

    A rank that raises fails the call with its traceback; a run that exceeds ``timeout`` is killed and fails.
    """
    ctx = _context()
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        # Arguments travel through a file: tensors passed directly would each cost a shared-memory fd.
        args_file = os.path.join(tmp, "args.pt")
        torch.save(args, args_file)
        procs = [ctx.Process(target=_worker, args=(fn, r, world, init_file, queue, args_file, timeout),
                             daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        results, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = queue.get(timeout=min(remaining, 5.0))
            except Exception:  # queue.Empty
                if errors and all(not p.is_alive() for p in procs):
                    break
                dead = [i for i, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)
                        and i not in results and i not in errors]
                for i in dead:
                    errors[i] = f"rank {i} died with exit code {procs[i].exitcode}"
                continue
            (results if status == "ok" else errors)[rank] = value
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        if errors:
            # The root cause is usually the error that is not a lost connection.
            ranked = sorted(errors, key=lambda r: ("Connection closed" in errors[r], r))
            raise AssertionError(f"{len(errors)} rank(s) failed ({sorted(errors)}); rank {ranked[0]}:\n"
                                 f"{errors[ranked[0]]}")
        if len(results) < world:
            missing = sorted(set(range(world)) - set(results))
            raise AssertionError(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)")
        return [results[r] for r in range(world)]


def run_ranks_allow_dead(fn, world: int, *args, timeout: float = SPAWN_TIMEOUT_S):
    """Like :func:`run_ranks`, for tests where a rank is meant to die (``os._exit``): never raises; returns one
    outcome per rank (list by rank):

    ``("ok", result)``     the rank function returned
    ``("err", text)``      it raised (traceback text)
    ``("dead", exitcode)`` the process ended without a result (killed on purpose, crashed, or stopped by the
                           faulthandler watchdog after ``timeout - 15`` s: its stack dump is on stderr)
    ``("hang", None)``     still running at ``timeout`` (then killed)
    """
    import queue as queue_mod
    ctx = _context()
    q = ctx.Queue()
    outcomes: dict[int, tuple] = {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        args_file = os.path.join(tmp, "args.pt")
        torch.save(args, args_file)
        procs = [ctx.Process(target=_worker, args=(fn, r, world, init_file, q, args_file, timeout), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(outcomes) < world and time.monotonic() < deadline:
            try:
                rank, status, value = q.get(timeout=0.5)
                outcomes[rank] = (status, value)
                continue
            except queue_mod.Empty:
                pass
            if all(not p.is_alive() for p in procs):
                break
        # drain what the ranks sent before they ended (a rank may exit before its result is read)
        while len(outcomes) < world:
            try:
                rank, status, value = q.get(timeout=1.0)
                outcomes[rank] = (status, value)
            except queue_mod.Empty:
                break
        hung = set()
        for r, p in enumerate(procs):
            p.join(timeout=10 if r in outcomes else 0.1)
            if p.is_alive():
                if r not in outcomes:
                    hung.add(r)
                p.kill()
                p.join(timeout=10)
        for r, p in enumerate(procs):
            if r not in outcomes:
                outcomes[r] = ("hang", None) if r in hung else ("dead", p.exitcode)
    return [outcomes[r] for r in range(world)]


def file_barrier(directory: str, rank: int, ranks, *, deadline: float) -> bool:
    """Wait (without torch.distributed) until every rank in ``ranks`` has called this with the same directory,
    or until ``time.monotonic() >= deadline``. Returns whether all arrived.

    Survivors of a killed peer use it to stay alive until every survivor has finished: a survivor that could
    only end because another one exited (closing its sockets) would otherwise go unnoticed.
    """
    open(os.path.join(directory, f"arrived-{rank}"), "w").close()
    while True:
        if all(os.path.exists(os.path.join(directory, f"arrived-{r}")) for r in ranks):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def tree_digest(path: str) -> dict[str, str]:
    """{relative path: sha256} of every file under ``path`` (directories as ``"<dir>"``), to compare trees."""
    import hashlib
    out = {}
    for root, dirs, files in os.walk(path):
        for d in dirs:
            out[os.path.relpath(os.path.join(root, d), path)] = "<dir>"
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out
