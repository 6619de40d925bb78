"""GRPO on a verifiable toy task, end to end: parallm trains at tp=2 on 2 local ranks, vLLM samples on rank 0.

    python examples/grpo.py [--task reverse] [--model moe] [--steps 100] [--warmup-steps 30] [--jsonl steps.jsonl]

It starts itself under ``torch.distributed.run`` with 2 local ranks (gloo on CPU); ``torchrun --nproc-per-node 2
examples/grpo.py`` works too (the model runs at tp = the number of ranks). vLLM comes from ``bash
scripts/setup_vllm.sh``: run this with ``.venv-vllm/bin/python`` for vLLM rollouts. Without vLLM the rollouts fall
back to transformers' ``generate`` on rank 0, its weights refreshed from ``save_hf_weights`` every step.

The task (``--task``): a prompt is ``<task> d1 .. dN <sep>`` (N = ``--digits``, 4 by default); the answer is the N
digits repeated, reversed or sorted; ``mix`` draws the task per prompt. The reward is the fraction of the N answer
positions that hold the right digit. The model: a Qwen2-shaped decoder (hidden 128, 2 layers, 4 query heads of 32
over 2 KV heads, tied embeddings; vLLM's CPU attention needs head_dim >= 32) built from a config, then warmed up
with a few supervised steps on the task so that it starts above chance and well below perfect. ``--model moe``: a
Qwen3-MoE of the same shape whose MLPs are 8 routed experts of width 64, top-2, trained with router replay (below).

One GRPO step:

1. rollouts: ``--prompts`` prompts x ``--group`` samples at temperature 1 from the engine, with the engine's
   log-probs of the sampled tokens, sent to every rank;
2. rewards, and group-relative advantages (the reward minus its group's mean, over the group's std);
3. the trainer's log-probs of the same tokens (``forward(output="logprobs")``): the old policy of the PPO ratio,
   and the rollout / trainer mismatch (the engine's log-probs against them: when the two differ the "on-policy"
   update is not, a known RL pitfall); with ``--model moe`` this forward also returns the experts every MoE layer
   routed each token to (``return_routed_experts=True``);
4. ``--updates`` PPO-clip updates over minibatches of the rollouts: ``forward_backward(batch,
   output="logprobs+entropy", num_microbatches=--microbatches)`` with the batch form (the old log-probs and the
   advantages are entries of the batch, split with its rows into each microbatch's ``loss_fn(out, mb)``) and a
   token-mean loss returning metrics (``((loss_sum, num_tokens), {"entropy", "clipped"})``: the sum over the
   answer tokens of the batch over their number; the metrics come back reduced over the microbatches and
   replicas), ``finalize_grads``, ``clip_grad_norm_``, parallm's AdamW (a ``torch.optim.Optimizer``: a
   ``LambdaLR`` warm-up + cosine schedule, :func:`lr_factor`, steps its learning rate once per GRPO step);
   ``--model moe``: router replay, the experts of step 3 as the batch's ``routed_experts`` entry, so every update
   routes each token as the old policy did (the ratio compares the same experts; the router's probabilities of
   them still give the weights, so the router trains). The experts the rollout engine itself chose would be the
   thing to replay, but vLLM's CPU build cannot return them (its routed-experts capture needs Triton) and
   transformers' ``generate`` does not; the old policy's forward on the trainer is the closest stand-in, and
   ``routing_drift`` (logged) measures how far the updates moved the routing of those tokens;
5. ``push_weights`` into the engine(s).

``--lora R``: the warmed-up model becomes a frozen base (saved, and the engine starts from it) and GRPO trains LoRA
adapters of rank R (alpha 2R) on every projection (``build_model(lora=...)``; the optimizer holds the adapters'
state only); step 5 pushes the adapter alone (``pv.push_adapter`` into an engine started with ``enable_lora``: a
``LoRARequest`` the rollouts then name), or the merged weights where the engine cannot serve LoRA (transformers'
rollouts, ``--engines serve``, the MoE model on vLLM's CPU build). Give it a larger ``--lr`` (e.g. 5e-3).

``--engines serve`` (with vLLM): instead of one engine in rank 0's process, rank 0 starts two ``vllm serve``
engines in processes of their own, one with 2 tensor-parallel workers and one with 1 (``pv.serve``), splits
every step's rollouts between them (data-parallel rollout replicas), and pushes into both at once through vLLM's
weight-transfer API and parallm's ``--backend`` (``pv.connect`` + ``pv.push_weights``); the servers are stopped
at the end.

Logged per step (a progress bar on rank 0; one JSON line per step with ``--jsonl``): mean reward, entropy (of the
policy on its rollouts), clip fraction (answer tokens where the clipped term was the one taken, in the updates
after the first), the mismatch (mean and max of |engine - trainer| over the sampled tokens), push seconds; with
``--model moe`` ``routing_drift``, the share of (answer token, MoE layer) pairs whose experts after the step's
updates differ from the replayed ones. At the
end: the mean reward of the first and last 10 % of the steps, and the greedy accuracy on 256 held-out prompts
before and after GRPO. docs/rl.md has the figures of a full run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist

SEP, VOCAB = 10, 16                     # tokens 0..9 are the digits
TASKS = {"repeat": 11, "reverse": 12, "sort": 13}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=[*TASKS, "mix"], default="repeat")
    ap.add_argument("--model", choices=["dense", "moe"], default="dense",
                    help="dense: a Qwen2-shaped decoder; moe: a Qwen3-MoE (8 experts, top-2) trained with router "
                         "replay")
    ap.add_argument("--digits", type=int, default=4, help="digits per prompt (N)")
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps")
    ap.add_argument("--warmup-steps", type=int, default=8, help="supervised steps before GRPO")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--updates", type=int, default=2, help="PPO minibatch updates per step")
    ap.add_argument("--microbatches", type=int, default=4, help="microbatches per PPO update (forward_backward)")
    ap.add_argument("--lr", type=float, default=1e-3, help="GRPO peak learning rate (warm-up, then cosine to half)")
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon")
    ap.add_argument("--entropy-coef", type=float, default=0.0)
    ap.add_argument("--rollout", choices=["auto", "vllm", "transformers"], default="auto",
                    help="auto: vLLM when it is installed, else transformers")
    ap.add_argument("--engines", choices=["inprocess", "serve"], default="inprocess",
                    help="vLLM rollouts: inprocess (one engine in rank 0's process, pushes in-process) or serve "
                         "(two `vllm serve` engines in processes of their own, TP 2 and TP 1, the rollouts split "
                         "between them, pushes through vLLM's weight-transfer API)")
    ap.add_argument("--backend", choices=["parallm_shm", "parallm_gloo"], default="parallm_shm",
                    help="with --engines serve: parallm's weight-transfer backend")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="GRPO trains LoRA adapters of rank R (every projection; alpha 2R) on the warmed-up model, "
                         "which stays frozen; the engine receives the adapter alone (0: train every weight)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the initial checkpoint goes (default: a temporary dir)")
    ap.add_argument("--jsonl", default=None, help="write one JSON line per step to this file (rank 0)")
    args = ap.parse_args(argv)
    if args.prompts * args.group % args.updates:
        ap.error(f"--prompts x --group ({args.prompts * args.group}) must split into --updates {args.updates}")
    return args


# -- the task ---------------------------------------------------------------------------------------------------

def make_prompts(n: int, task: str, digits: int, g: torch.Generator) -> torch.Tensor:
    """[n, digits + 2]: ``<task> d1 .. dN <sep>``."""
    kinds = list(TASKS) if task == "mix" else [task]
    token = torch.tensor([TASKS[k] for k in kinds])[torch.randint(0, len(kinds), (n,), generator=g)]
    return torch.cat([token[:, None], torch.randint(0, 10, (n, digits), generator=g),
                      torch.full((n, 1), SEP)], dim=1)


def answer_of(prompts: torch.Tensor) -> torch.Tensor:
    digits, token = prompts[:, 1:-1], prompts[:, :1]
    return torch.where(token == TASKS["repeat"], digits,
                       torch.where(token == TASKS["reverse"], digits.flip(1), digits.sort(1).values))


def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The fraction of the answer positions that hold the right digit, per row."""
    return (answers == answer_of(prompts)).float().mean(1)


# -- the model --------------------------------------------------------------------------------------------------

def write_tokenizer(path: str) -> None:
    """A word-level tokenizer ``t<id>`` -> id: a ``vllm serve`` server detokenizes what it returns."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "t0"}, f)


def make_checkpoint(path: str, digits: int, seed: int, model: str = "dense") -> None:
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                  max_position_embeddings=4 * digits + 8, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if model == "moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                          norm_topk_prob=True)
        transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    else:
        transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).save_pretrained(path)


def answer_slice(out: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Position t of a log-prob / entropy row scores token t + 1: the answer tokens are at [start - 1, +n)."""
    return out[:, start - 1:start - 1 + n]


def warmup(chunks, opt, args, g: torch.Generator) -> float:
    """Supervised steps on the task: next-token loss on the answer tokens, token-mean."""
    import parallm
    loss = float("nan")
    for _ in range(args.warmup_steps):
        p = make_prompts(64, args.task, args.digits, g)
        ids = torch.cat([p, answer_of(p)], dim=1)

        def loss_fn(lp, ids, mask):
            lp = answer_slice(lp, p.shape[1], args.digits)
            return -lp.sum(), lp.numel()
        loss = float(parallm.forward_backward(chunks, ids, loss_fn=loss_fn, output="logprobs"))
        parallm.finalize_grads(chunks)
        parallm.clip_grad_norm_(chunks, 1.0)
        opt.step()
        opt.zero_grad()
    return loss


# -- rollouts: one engine on rank 0 -----------------------------------------------------------------------------

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
        """Rank 0: row i to engine i % 2, one request per row (its own seed), all at once."""
        futures = [self.pool.submit(self._one, self.urls[i % len(self.urls)], p.tolist(), n, temperature,
                                    seed * 65537 + i) for i, p in enumerate(prompts)]
        rows = [f.result() for f in futures]
        return torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])

    def push(self, chunks) -> dict:
        if self.lora:           # engines in other processes: the merged weights
            return self.pv.push_adapter(chunks, self.conn)
        return self.pv.push_weights(chunks, self.conn)

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


# -- GRPO -------------------------------------------------------------------------------------------------------

def ppo_update(chunks, opt, ids, start, n, old, adv, args, routed=None):
    """``args.updates`` PPO-clip minibatch steps over the rollouts. ``routed``: the old policy's experts
    ``[B, S, moe layers, top_k]`` to replay (MoE models), or None. Returns (the policy's mean entropy on the
    rollouts, from the first update; the clip fraction of the later ones)."""
    import parallm
    b = ids.shape[0]
    order = torch.randperm(b, generator=torch.Generator().manual_seed(int(ids.sum())))
    entropy, clipped = None, []
    for u in range(args.updates):
        sel = order[u * b // args.updates:(u + 1) * b // args.updates]
        # the batch form: the rollouts' old log-probs and advantages travel with their rows into each microbatch
        batch = {"input_ids": ids[sel], "old_logprobs": old[sel], "advantages": adv[sel]}
        if routed is not None:      # router replay: each token routed as the old policy routed it
            batch["routed_experts"] = routed[sel]

        def loss_fn(out, mb):
            lp, ent = answer_slice(out.logprobs, start, n), answer_slice(out.entropy, start, n)
            ratio = torch.exp(lp - mb["old_logprobs"])
            a = mb["advantages"][:, None]
            unclipped, clipped_ = ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a
            loss = -torch.minimum(unclipped, clipped_) - args.entropy_coef * ent
            metrics = {"entropy": ent.detach().mean(),                          # token means (weighted by n)
                       "clipped": (clipped_ < unclipped).float().mean()}      # min() took the clipped term
            return (loss.sum(), loss.numel()), metrics                          # token-mean over the batch
        _, stats = parallm.forward_backward(chunks, batch, loss_fn=loss_fn, output="logprobs+entropy",
                                            num_microbatches=args.microbatches)
        stats = {k: v.item() for k, v in stats.items()}
        parallm.finalize_grads(chunks)
        parallm.clip_grad_norm_(chunks, 1.0)
        opt.step()
        opt.zero_grad()
        if u == 0:
            entropy = stats["entropy"]
        else:
            clipped.append(stats["clipped"])
    return entropy, sum(clipped) / len(clipped) if clipped else 0.0


def greedy_accuracy(rollout, prompts, n: int) -> float:
    return on_rank0(lambda: reward(prompts, rollout.sample(prompts, n=n, temperature=0.0, seed=0)[0]).mean().item())


def pick_rollout(choice: str):
    if choice == "auto":
        try:
            import vllm  # noqa: F401
            choice = "vllm"
        except ImportError:
            choice = "transformers"
    return VLLMRollout if choice == "vllm" else TransformersRollout


def main(args) -> list[dict]:
    import parallm
    t_start = time.perf_counter()
    parallm.init_parallel(tp=int(os.environ.get("WORLD_SIZE", "1")))
    rank = dist.get_rank()
    # one directory for both ranks: rank 0 makes the temporary one and tells the others its path
    made = [tempfile.mkdtemp(prefix="parallm-grpo-") if rank == 0 and not args.workdir else None]
    dist.broadcast_object_list(made, src=0)
    workdir = args.workdir or made[0]
    ckpt = os.path.join(workdir, "init")
    n, start = args.digits, args.digits + 2
    if rank == 0:
        make_checkpoint(ckpt, n, args.seed, args.model)
    dist.barrier()
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    g = torch.Generator().manual_seed(args.seed)     # the same stream on every rank: the same prompts
    warm_loss = warmup(chunks, parallm.build_optimizer(chunks, lr=args.warmup_lr), args, g)
    if args.lora:
        # LoRA: the warmed-up model becomes the frozen base (written once, the engine starts from it) and GRPO
        # trains adapters on it; the optimizer holds the adapters' state only
        ckpt = os.path.join(workdir, "base")
        parallm.save_hf_weights(chunks, ckpt, overwrite=True)
        if rank == 0:
            write_tokenizer(ckpt)
        dist.barrier()
        config = parallm.LoraConfig(args.lora, 2 * args.lora, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj"))
        chunks = parallm.build_model(ckpt, lora=config)
        parallm.load_hf_weights(chunks, ckpt)
    opt = parallm.build_optimizer(chunks, lr=args.lr)

    cls = pick_rollout(args.rollout)
    if cls is VLLMRollout and args.engines == "serve":
        rollout = ServeRollout(ckpt, start + n, args.seed, backend=args.backend, lora=args.lora)
    else:
        rollout = cls(ckpt, start + n, args.seed, lora=args.lora,
                      **({"moe": args.model == "moe"} if cls is VLLMRollout else {}))
    try:
        return run(chunks, opt, rollout, args, g, warm_loss, t_start, made, rank)
    finally:
        if hasattr(rollout, "close"):
            rollout.close()


def routing_drift(chunks, ids, routed, start: int, n: int) -> float:
    """The share of (answer token, MoE layer) pairs whose experts (as sets) the updated policy would choose
    differently from ``routed``, the old policy's: how much the updates moved the routing that was replayed."""
    import parallm
    with torch.no_grad():
        _, now = parallm.forward(chunks, ids, output="logprobs", return_routed_experts=True)
    # the answer tokens: positions start .. start + n - 1 (routing is per input token)
    before, after = (t[:, start:start + n].sort(-1).values for t in (routed, now))
    return (before != after).any(-1).float().mean().item()


def lr_factor(step: int, steps: int) -> float:
    """The GRPO learning rate's schedule (a factor of ``--lr``): linear warm-up over the first 5% of the steps
    (at least one), then cosine down to half at the last."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / (warm + 1)
    return 0.5 + 0.25 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))


def run(chunks, opt, rollout, args, g, warm_loss, t_start, made, rank) -> list[dict]:
    import parallm
    from tqdm.auto import tqdm
    n, start = args.digits, args.digits + 2
    # parallm's optimizer is a torch.optim.Optimizer: torch's schedulers drive its learning rate
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    rollout.push(chunks)                             # the engine started from the initial checkpoint
    eval_prompts = make_prompts(256, args.task, n, torch.Generator().manual_seed(10 ** 6 + args.seed))
    acc_before = greedy_accuracy(rollout, eval_prompts, n)

    log = open(args.jsonl, "w") if args.jsonl and rank == 0 else None
    rows = []
    bar = tqdm(range(1, args.steps + 1), desc=f"GRPO {args.task} ({rollout.name})", disable=rank != 0,
               dynamic_ncols=True, file=sys.stdout, mininterval=1.0)
    for step in bar:
        t0 = time.perf_counter()
        prompts = make_prompts(args.prompts, args.task, n, g).repeat_interleave(args.group, dim=0)
        answers, rollout_lp = on_rank0(lambda: rollout.sample(prompts, n=n, temperature=1.0,
                                                              seed=args.seed * 100003 + step))
        t_rollout = time.perf_counter() - t0
        r = reward(prompts, answers)
        grouped = r.view(args.prompts, args.group)
        adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-6)).view(-1)
        ids = torch.cat([prompts, answers], dim=1)
        moe = args.model == "moe"
        with torch.no_grad():     # the old policy's log-probs (and, for an MoE model, the experts it routed with)
            out = parallm.forward(chunks, ids, output="logprobs", return_routed_experts=moe)
        lp, routed = out if moe else (out, None)
        old = answer_slice(lp, start, n)
        mismatch = (rollout_lp - old).abs()
        entropy, clip_frac = ppo_update(chunks, opt, ids, start, n, old, adv, args, routed=routed)
        lr = opt.param_groups[0]["lr"]
        schedule.step()                              # once per GRPO step (its --updates optimizer steps share it)
        drift = routing_drift(chunks, ids, routed, start, n) if moe else None
        push = rollout.push(chunks)
        row = dict(step=step, rollout=rollout.name, model=args.model, lora=args.lora, push_mode=push.get("mode"),
                   push_bytes=push.get("bytes"), reward=r.mean().item(), entropy=entropy,
                   clip_frac=clip_frac, logprob_mismatch=mismatch.mean().item(),
                   logprob_mismatch_max=mismatch.max().item(), lr=lr, push_s=push["seconds"], rollout_s=t_rollout,
                   step_s=time.perf_counter() - t0)
        if moe:
            row["routing_drift"] = drift
        if args.task == "mix":
            task_of = prompts[:, 0]
            row["reward_by_task"] = {k: r[task_of == t].mean().item() for k, t in TASKS.items()
                                     if (task_of == t).any()}
        rows.append(row)
        bar.set_postfix_str(f"reward {row['reward']:.3f} entropy {entropy:.2f} clip {clip_frac:.2f} "
                            f"mismatch {row['logprob_mismatch']:.1e} push {push['seconds'] * 1e3:.0f} ms", refresh=False)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
    bar.close()
    acc_after = greedy_accuracy(rollout, eval_prompts, n)
    if rank == 0:
        k = max(1, len(rows) // 10)
        first, last = (sum(x["reward"] for x in part) / len(part) for part in (rows[:k], rows[-k:]))
        print(f"task {args.task}, {n} digits; rollouts: {rollout.name}; warm-up loss {warm_loss:.3f} after "
              f"{args.warmup_steps} steps")
        if rows:
            print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}; max log-prob mismatch "
                  f"{max(x['logprob_mismatch_max'] for x in rows):.1e}; push {min(x['push_s'] for x in rows):.3f}-"
                  f"{max(x['push_s'] for x in rows):.3f} s")
        if rows and args.model == "moe":
            print(f"router replay: routing drift after each step's updates {min(x['routing_drift'] for x in rows):.3f}"
                  f"-{max(x['routing_drift'] for x in rows):.3f} of (answer token, MoE layer) pairs")
        print(f"greedy accuracy on {len(eval_prompts)} held-out prompts: {acc_before:.3f} before GRPO, "
              f"{acc_after:.3f} after; {time.perf_counter() - t_start:.0f} s")
    if log:
        log.close()
    parallm.destroy_parallel()
    if made[0] is not None and rank == 0:
        shutil.rmtree(made[0], ignore_errors=True)
    return rows


if __name__ == "__main__":
    if "RANK" not in os.environ:        # start 2 local ranks running this file
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ.setdefault("PARALLM_PROGRESS", "0")
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", "2", os.path.abspath(__file__), *sys.argv[1:]])
    main(parse())
