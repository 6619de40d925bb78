"""parallm's own sampler (``--sampler parallm``, or where vLLM is not installed): the trainer ranks compute
samples and prompt log-probs as work items between the training requests (:mod:`.sampling` has the job types and
the vLLM engine sampler, and what both return)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .sampling import SampleInputError, SampleJob, SampleResult, empty_topk, max_new_tokens, stop_spec

__all__ = ["ParallmSampler"]


class ParallmSampler:
    """Samples and prompt log-probs from the trainer ranks (``run(op_args)`` hands a ``sampler_forward`` item to
    the dispatcher and returns rank 0's result). ``tokenizer``: for stop strings (None: stop strings refused)."""

    serves_full = True          # full-fine-tuning snapshots (Hugging Face checkpoints): the trainer runs them

    def __init__(self, run, *, max_model_len: int, eos: list, tokenizer=None):
        self.run, self.max_model_len, self.eos, self.tokenizer = run, max_model_len, list(eos), tokenizer

    def close(self) -> None:
        pass

    def state(self) -> str:
        return "ready"

    def _forward(self, adapter_dir, rows: list, output):
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, :len(r)] = torch.as_tensor(r)
            mask[i, :len(r)] = 1
        return self.run({"op": "sampler_forward", "args": {"adapter_dir": adapter_dir, "input_ids": ids,
                                                           "attention_mask": mask, "output": output}})

    def prompt_logprobs(self, job: SampleJob) -> np.ndarray:
        out = np.full(len(job.prompt), np.nan, dtype=np.float32)
        if len(job.prompt) > 1:
            lp = self._forward(job.adapter_dir, [job.prompt], "logprobs")[0]
            out[1:] = lp[:len(job.prompt) - 1].numpy()
        return out

    def prompt_topk(self, job: SampleJob) -> tuple:
        """The top-k of the distribution before every prompt token (row 0: empty), from one logits forward."""
        n, k = len(job.prompt), job.topk_prompt
        ids, lps = empty_topk(n, k)
        if n > 1:
            values, index = self._forward(job.adapter_dir, [job.prompt], f"topk:{k}")
            ids[1:], lps[1:] = index[0, :n - 1].numpy(), values[0, :n - 1].numpy()
        return ids, lps

    def sample(self, job: SampleJob):
        strings, stop_ids, ignore_eos = stop_spec(job.params.get("stop"), self.eos)
        if strings and self.tokenizer is None:
            raise SampleInputError("stop strings need a tokenizer in the model directory (this one has none)")
        stops = set(stop_ids) | (set() if ignore_eos else set(self.eos))
        p = job.params
        gen = torch.Generator().manual_seed(int(p["seed"]) if p.get("seed") is not None
                                            else int(torch.randint(0, 2 ** 62, ()).item()))
        limit = max_new_tokens(job)
        seqs = [[] for _ in range(job.num_samples)]
        lps = [[] for _ in range(job.num_samples)]
        tops = [[] for _ in range(job.num_samples)]
        live = list(range(job.num_samples))
        reasons = ["length"] * job.num_samples
        for _ in range(limit):
            if not live:
                break
            logits = self._forward(job.adapter_dir, [job.prompt + seqs[i] for i in live], None)
            for row, i in enumerate(live[:]):
                tok, lp = _draw(logits[row], p, gen)
                seqs[i].append(tok)
                lps[i].append(lp)
                if job.topk_sample:
                    v, t = torch.log_softmax(logits[row].double(), -1).topk(job.topk_sample)
                    tops[i].append((t.numpy(), v.numpy()))
                if tok in stops or (strings and _has_stop(self.tokenizer, seqs[i], strings)):
                    reasons[i] = "stop"
                    live.remove(i)
        out = SampleResult([(seqs[i], lps[i], reasons[i]) for i in range(job.num_samples)],
                           self.prompt_logprobs(job) if job.prompt_logprobs else None)
        if job.topk_sample:
            out.topk_sampled = [(np.stack([t for t, _ in rows]).astype(np.int32) if rows else empty_topk(0, job.topk_sample)[0],
                                 np.stack([v for _, v in rows]).astype(np.float32) if rows else empty_topk(0, job.topk_sample)[1])
                                for rows in tops]
        if job.topk_prompt:
            out.topk_prompt = self.prompt_topk(job)
        return out


def _has_stop(tokenizer, tokens, strings) -> bool:
    text = tokenizer.decode(tokens)
    return any(s in text for s in strings)


def _draw(logits: torch.Tensor, params: dict, gen) -> tuple[int, float]:
    """One token from ``logits`` [V] under temperature / top-k / top-p; its unscaled log-prob."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    t = float(params.get("temperature", 1.0))
    if t <= 0:
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    z = logits.double() / t
    k = int(params.get("top_k", -1))
    if 0 < k < z.numel():
        kth = torch.topk(z, k).values[-1]
        z = z.masked_fill(z < kth, -math.inf)
    probs = torch.softmax(z, dim=-1)
    top_p = float(params.get("top_p", 1.0))
    if top_p < 1.0:
        sp, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    tok = int(torch.multinomial(probs, 1, generator=gen))
    return tok, float(logp[tok])
