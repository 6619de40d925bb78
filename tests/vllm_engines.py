"""Helpers of the vLLM tests (tests/test_vllm*.py): tiny checkpoints with a tokenizer (a ``vllm serve`` server
needs one to return log-probs over HTTP), sampling through the server's completions route and through a
``vllm.LLM``, the comparison with parallm's ``forward(output="logprobs")`` (the one check of every push), a few
training steps, recording an attempt's outcome, and stand-in engines for the main suite's tests of the sender
(:class:`StandIn`)."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import torch

import helpers

# every vLLM server of a test: one OpenMP thread per worker, no core binding (2 cores shared by every process)
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def write_tokenizer(path: str, vocab: int) -> None:
    """A word-level tokenizer ``t<id>`` -> id over the whole vocabulary (vLLM's server detokenizes outputs)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)


def checkpoint(path: str, family: str, seed: int, *, moe: bool = False, **overrides) -> str:
    """A tiny seeded checkpoint (head_dim 32: the smallest vLLM's CPU attention takes) with a tokenizer."""
    cfg = helpers.tiny_config(family, head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              **overrides)
    model = helpers.make_hf_model(cfg, seed=seed)
    if moe:
        helpers.hub_state_dict(model, path)
    else:
        helpers.save_checkpoint(model, path)
    write_tokenizer(path, cfg.vocab_size)
    return path


def prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]


def sample_http(url: str, model: str, batch, seed: int, *, max_tokens: int = 8, dp_rank: int | None = None):
    """The server's samples of each prompt (token ids) and its log-prob of each sampled token; ``dp_rank``: the
    data-parallel replica of an engine started with ``--data-parallel-size`` that serves them (vLLM's
    ``X-data-parallel-rank`` header; default: vLLM's load balancing picks)."""
    out = []
    headers = {"Content-Type": "application/json"}
    if dp_rank is not None:
        headers["X-data-parallel-rank"] = str(dp_rank)
    for k, p in enumerate(batch):
        body = {"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 1.0, "seed": seed + k,
                "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=120) as res:
            lp = json.loads(res.read())["choices"][0]["logprobs"]
        out.append(([int(t.split(":")[1]) for t in lp["tokens"]], list(lp["token_logprobs"])))
    return out


def sample_llm(llm, batch, seed: int, *, max_tokens: int = 8):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=0, seed=seed, ignore_eos=True)
    res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in res]


def max_diff(chunks, batch, samples) -> float:
    """max |engine's log-prob - parallm's forward(output="logprobs")| over every sampled token (collective)."""
    import parallm
    rows = [p + toks for p, (toks, _) in zip(batch, samples)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, :len(r)] = torch.tensor(r)
        mask[b, :len(r)] = 1
    with torch.no_grad():
        lp = parallm.forward(chunks, ids, mask, output="logprobs")
    worst = 0.0
    for b, (p, (toks, lps)) in enumerate(zip(batch, samples)):
        mine = lp[b, len(p) - 1:len(p) - 1 + len(toks)]       # position t scores token t + 1
        worst = max(worst, (mine - torch.tensor(lps)).abs().max().item())
    return worst


def train(chunks, opt, vocab: int, steps: int, seed: int, *, num_microbatches: int = 2) -> None:
    """``steps`` AdamW steps of next-token loss on a random batch (the same on every rank of a replica)."""
    import parallm
    g = torch.Generator().manual_seed(seed)

    def loss_fn(logits, ids, mask):
        lp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        return -lp.mean()

    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 12), generator=g)
        parallm.forward_backward(chunks, ids, torch.ones_like(ids), loss_fn=loss_fn,
                                 num_microbatches=num_microbatches)
        parallm.finalize_grads(chunks)
        opt.step()
        opt.zero_grad()


def attempt(out: dict, key: str, fn) -> None:
    """``out[key]``: ``("ok", fn(), seconds)``, or ``(exception type name, message, seconds)`` if it raised."""
    t0 = time.monotonic()
    try:
        value = fn()
        out[key] = ("ok", value, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001
        out[key] = (type(e).__name__, str(e), time.monotonic() - t0)


class StandIn:
    """A stand-in engine with one worker for the main suite's tests of the sender (no vLLM): what parallm's worker
    backend does with each call, minus vLLM; every call recorded in ``calls``. ``fail``: ``{call name: exception}``
    raised by that call (after recording it); ``reset_ok``: what ``reset_prefix_cache`` answers; ``init_delay``:
    seconds a gloo init waits before joining (a slow engine)."""

    def __init__(self, name, *, fail=None, reset_ok=True, init_delay=0.0):
        self.name, self.got, self.calls, self.shm = name, {}, [], None
        self.slot_bytes, self.group, self.infos = 0, None, []
        self.fail, self.reset_ok, self.init_delay = dict(fail or {}), reset_ok, init_delay

    def _call(self, what):
        self.calls.append(what)
        if what in self.fail:
            raise self.fail[what]

    def workers(self):
        return 1

    def local(self):
        return True

    def init(self, info):
        import datetime

        import torch.distributed as dist
        if "verify" in info:
            self._call("verify")
        elif info["transport"] == "shm":
            self._call("init")
            self.shm = torch.from_file(info["path"], shared=True, size=info["slot_bytes"] * info["slots"],
                                       dtype=torch.uint8)
            self.slot_bytes = info["slot_bytes"]
        else:
            self._call("init")
            time.sleep(self.init_delay)
            timeout = datetime.timedelta(seconds=info["timeout_s"])
            store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"],
                                  is_master=False, timeout=timeout)
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(info["group"], store), info["rank_offset"],
                                               info["world_size"], timeout)

    def update(self, info):
        from parallm.integrations.vllm.backends import unpack
        self._call("update")
        time.sleep(0.005)                    # a slot rewritten too early would be read rewritten
        if info["transport"] == "shm":
            start = info["slot"] * self.slot_bytes
            buf = self.shm[start:start + info["nbytes"]]
        else:
            buf = torch.empty(info["nbytes"], dtype=torch.uint8)
            self.group.broadcast(buf, 0).wait()
        for name, t in unpack(buf, info):
            self.got[name] = t.clone()
        self.infos.append(info)

    def start(self):
        self._call("start")

    def pause(self):
        self._call("pause")

    def resume(self):
        self._call("resume")

    def finish(self):
        self._call("finish")

    def reset_prefix_cache(self):
        self._call("reset")
        return self.reset_ok


def on_rank(src, llm, fn):
    """``fn(llm)`` on the rank holding the engine (``src``), its result broadcast to every rank."""
    import torch.distributed as dist
    obj = [fn(llm) if llm is not None else None]
    dist.broadcast_object_list(obj, src=src)
    return obj[0]


def engine_state(llm):
    """The engine's parameters and buffers as its model holds them (prepacked linears included), copied."""
    return llm.apply_model(lambda m: {k: v.detach().clone() for k, v in m.state_dict().items()})[0]


def push_against_fresh_engine(ckpt: str, saved: str, engine: dict) -> tuple[dict, dict | None]:
    """The in-process push check shared by the family files (collective, trainer tp2 on 2 ranks): an engine on rank
    0 loads ``ckpt``; parallm's log-probs against its samples before training (``before``), after two AdamW steps
    (``stale_diff``) and after ``push_weights`` (``after_diff``, ``moved``); ``save_hf_weights`` into ``saved`` and a
    second engine on rank 1 loading it (``fresh_diff``, ``same_samples``: the same tokens and log-probs); on rank 0
    ``names`` (the same tensors) and ``differ`` (every engine tensor not bit-identical, with its largest
    difference). Returns ``(out, states)``: ``states`` on rank 0 ``{"initial", "pushed", "fresh"}`` (the engine's
    tensors before training, after the push, and the fresh engine's), None elsewhere."""
    import parallm
    from parallm.integrations import vllm as pv
    out = {}
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    llm = pv.launch(ckpt, rank=0, **engine)
    initial = on_rank(0, llm, engine_state)
    vocab = chunks[0].spec.vocab_size
    batch = prompts(vocab, 1)
    out["before"] = max_diff(chunks, batch, on_rank(0, llm, lambda e: sample_llm(e, batch, 1)))
    opt = parallm.build_optimizer(chunks, lr=2e-2)
    train(chunks, opt, vocab, 2, seed=2)
    stale = on_rank(0, llm, lambda e: sample_llm(e, batch, 5))
    out["stale_diff"] = max_diff(chunks, batch, stale)
    out["push"] = pv.push_weights(chunks, llm)
    pushed = on_rank(0, llm, lambda e: sample_llm(e, batch, 5))
    out["after_diff"] = max_diff(chunks, batch, pushed)
    out["moved"] = stale != pushed
    parallm.save_hf_weights(chunks, saved)
    fresh = pv.launch(saved, rank=1, **engine)      # a second engine, loading the saved directory
    fresh_sample = on_rank(1, fresh, lambda e: sample_llm(e, batch, 5))
    out["fresh_diff"] = max_diff(chunks, batch, fresh_sample)
    out["same_samples"] = pushed == fresh_sample
    pushed_state, fresh_state = (on_rank(r, e, engine_state) for r, e in ((0, llm), (1, fresh)))
    states = None
    if llm is not None:                              # rank 0: the first engine's
        states = {"initial": initial, "pushed": pushed_state, "fresh": fresh_state}
        out["names"] = sorted(pushed_state) == sorted(fresh_state)
        out["tensors"] = len(pushed_state)
        out["differ"] = {k: (pushed_state[k].float() - fresh_state[k].float()).abs().max().item()
                         for k in pushed_state if not torch.equal(pushed_state[k], fresh_state[k])}
    parallm.destroy_parallel()
    return out, states
