"""The rollout engines of examples/grpo.py (a module of its own beside it; the example imports it): one vLLM
engine in rank 0's process (:class:`VLLMRollout`), two ``vllm serve`` engines in processes of their own
(:class:`ServeRollout`), or transformers' ``generate`` on rank 0 when vLLM is not installed
(:class:`TransformersRollout`). Each has ``sample(prompts, n=, temperature=, seed=)`` (rank 0: the answers and the
engine's log-probs of them) and ``push(chunks)`` (collective: the trainer's weights into the engine)."""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

VOCAB = 16                              # the example's vocabulary (tokens 0..9 are the digits)


def write_tokenizer(path: str) -> None:
    """A word-level tokenizer ``t<id>`` -> id: a ``vllm serve`` server detokenizes what it returns."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)


def on_rank0(fn):
    """``fn()`` on rank 0, its result on every rank; an exception there is raised on every rank (the other rank
    would otherwise wait in the broadcast)."""
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            box = [("error", f"{type(e).__name__}: {e}")]
            error = e
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status != "ok":
        if dist.get_rank() == 0:
            raise error
        raise RuntimeError(f"rank 0 failed: {value}")
    return value


class VLLMRollout:
    name = "vllm"

    def __init__(self, ckpt: str, max_len: int, seed: int, lora: int = 0, moe: bool = False):
        from parallm.integrations import vllm as pv
        self.pv, self.lora, self.request = pv, lora, None
        # --lora on a dense model: an engine serving LoRA receives the adapter alone (vLLM's CPU build runs no MoE
        # LoRA: a MoE engine gets the merged weights, push_adapter decides)
        extra = dict(enable_lora=True, max_lora_rank=lora, max_loras=1) if lora and not moe else {}
        self.llm = pv.launch(ckpt, rank=0, dtype="float32", max_model_len=max_len, kv_cache_memory_bytes=64 << 20,
                             seed=seed, **extra)

    def sample(self, prompts: torch.Tensor, *, n: int, temperature: float, seed: int):
        """Rank 0: (answers [B, n], the engine's log-probs of them [B, n])."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        # a seed per request: the repeats of one prompt (a GRPO group) must not share a random stream, and the
        # trainer's global RNG stays untouched
        params = [SamplingParams(max_tokens=n, temperature=temperature, logprobs=0, seed=seed * 65537 + i,
                                 ignore_eos=True) for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts], params,
                                 use_tqdm=False, lora_request=self.request)
        answers = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
        lps = torch.tensor([[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                            for o in outs])
        return answers, lps

    def push(self, chunks) -> dict:
        if not self.lora:
            return self.pv.push_weights(chunks, self.llm, rank=0)
        stats = self.pv.push_adapter(chunks, self.llm, rank=0)    # the adapter, or the merged weights
        self.request = stats["lora_request"]
        return stats


class ServeRollout:
    """Two ``vllm serve`` engines in processes of their own (TP 2 and TP 1, started by rank 0), each sampling
    half of the rollouts over HTTP; pushes through vLLM's weight-transfer API (``connect`` + ``push_weights``)."""
    name = "vllm-serve"

    def __init__(self, ckpt: str, max_len: int, seed: int, backend: str = "parallm_shm", lora: int = 0):
        import concurrent.futures

        from parallm.integrations import vllm as pv
        self.pv, self.ckpt, self.servers, self.lora = pv, ckpt, [], lora
        self.pool = concurrent.futures.ThreadPoolExecutor(16)
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR")}

        def start():
            write_tokenizer(ckpt)
            for tp in (2, 1):
                self.servers.append(pv.serve(ckpt, tensor_parallel_size=tp, max_model_len=max_len,
                                             kv_cache_memory_bytes=64 << 20, env=env, timeout=600))
            return [s.url for s in self.servers]
        try:
            self.urls = on_rank0(start)
            self.conn = pv.connect(self.urls, backend=backend)
        except BaseException:
            self.close()
            raise

    def _one(self, url, prompt, n, temperature, seed):
        import urllib.request
        body = {"model": self.ckpt, "prompt": prompt, "max_tokens": n, "temperature": temperature, "seed": seed,
                "logprobs": 0, "ignore_eos": True, "return_tokens_as_token_ids": True}
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as res:
            lp = json.loads(res.read())["choices"][0]["logprobs"]
        return [int(t.split(":")[1]) for t in lp["tokens"]], lp["token_logprobs"]

    def sample(self, prompts, *, n: int, temperature: float, seed: int):
        """Rank 0: row i to usable engine i % (their number), one request per row (its own seed), all at once.
        An engine in ``conn.needs_restart`` (it failed, or a failed push left it without the current weights)
        gets nothing."""
        urls = [u for u in self.urls if u not in self.conn.needs_restart]
        if not urls:
            raise RuntimeError(f"no usable engine: every one needs a restart ({self.conn.needs_restart})")
        futures = [self.pool.submit(self._one, urls[i % len(urls)], p.tolist(), n, temperature, seed * 65537 + i)
                   for i, p in enumerate(prompts)]
        rows = [f.result() for f in futures]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    def push(self, chunks) -> dict:
        """The weights into every healthy engine. An engine failing is reported (``EngineFailed``, raised on every
        rank after the others received every tensor) and left out from then on; the run goes on with the
        others (:meth:`sample` raises when none is left)."""
        t = time.perf_counter()
        try:
            if self.lora:       # engines in other processes: the merged weights
                return self.pv.push_adapter(chunks, self.conn)
            return self.pv.push_weights(chunks, self.conn)
        except self.pv.EngineFailed as e:
            if dist.get_rank() == 0:
                print(f"push: {e}; going on with the other engines", flush=True)
            return {"seconds": time.perf_counter() - t, "failed": str(e)}

    def prefix_cache(self) -> tuple[float, float]:
        """Rank 0: prompt tokens served from the engines' prefix caches, and prompt tokens looked up, summed over
        the engines (vLLM's ``vllm:prefix_cache_hits`` / ``_queries`` counters from ``/metrics``)."""
        import urllib.request
        hits = queries = 0.0
        for url in self.urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=60) as res:
                for line in res.read().decode().splitlines():
                    if line.startswith("vllm:prefix_cache_hits_total"):
                        hits += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:prefix_cache_queries_total"):
                        queries += float(line.rsplit(" ", 1)[1])
        return hits, queries

    def close(self) -> None:
        if getattr(self, "conn", None) is not None:
            self.conn.close()
        for s in self.servers:
            s.stop()
        self.pool.shutdown(wait=False)


class TransformersRollout:
    """Without vLLM: transformers' ``generate`` on rank 0, its weights refreshed from ``save_hf_weights``."""
    name = "transformers"

    def __init__(self, ckpt: str, max_len: int, seed: int, lora: int = 0):
        import transformers
        self.model = None
        if dist.get_rank() == 0:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(ckpt).eval()

    def sample(self, prompts, *, n: int, temperature: float, seed: int):
        kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_k=0,
                                                                  top_p=1.0)
        rng = torch.get_rng_state()
        torch.manual_seed(seed)
        try:
            with torch.no_grad():
                out = self.model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=n,
                                          min_new_tokens=n, output_scores=True, return_dict_in_generate=True,
                                          pad_token_id=0, eos_token_id=None, **kw)
        finally:
            torch.set_rng_state(rng)
        answers = out.sequences[:, prompts.shape[1]:]
        scores = torch.stack(out.scores, 1)            # after the temperature: the sampling distribution
        return answers, scores.log_softmax(-1).gather(-1, answers[..., None]).squeeze(-1)

    def push(self, chunks) -> dict:
        import parallm
        t = time.perf_counter()
        # collective; the full state dict on rank 0 (with --lora the adapters merged into the frozen base)
        state = parallm.save_hf_weights(chunks, merged=True)
        if self.model is not None:
            missing, unexpected = self.model.load_state_dict(fuse_experts(state), strict=False)
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise RuntimeError(f"push: missing {missing}, unexpected {unexpected}")
            self.model.tie_weights()
        return {"seconds": time.perf_counter() - t}


def fuse_experts(state: dict) -> dict:
    """The Hub's per-expert tensors (what ``save_hf_weights`` writes, ``mlp.experts.{e}.{gate,up,down}_proj``) ->
    transformers 5's fused in-memory ones (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``),
    which ``load_state_dict`` wants; a dense model's state passes unchanged."""
    out, experts = {}, {}
    for name, t in state.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        e, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(e)] = t
    for head, projs in experts.items():
        n = len(projs["down_proj"])
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs["gate_proj"][e], projs["up_proj"][e]]) for e in range(n)])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([projs["down_proj"][e] for e in range(n)])
    return out
