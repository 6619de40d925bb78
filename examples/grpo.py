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

from grpo_rollouts import VOCAB, ServeRollout, TransformersRollout, VLLMRollout, on_rank0, write_tokenizer

SEP = 10                                # tokens 0..9 are the digits
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
    ap.add_argument("--system-prompt-tokens", type=int, default=0, metavar="S",
                    help="a fixed system prompt of S random tokens in front of every prompt (the same at every step: "
                         "with S >= 128, vLLM-CPU's KV block, the engines' prefix cache holds it across steps)")
    ap.add_argument("--max-mismatch", type=float, default=1e-4,
                    help="stop with an error when a step's max |engine - trainer| log-prob exceeds this (inf: never)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", default=None, help="where the initial checkpoint goes (default: a temporary dir)")
    ap.add_argument("--jsonl", default=None, help="write one JSON line per step to this file (rank 0)")
    args = ap.parse_args(argv)
    if args.prompts * args.group % args.updates:
        ap.error(f"--prompts x --group ({args.prompts * args.group}) must split into --updates {args.updates}")
    return args


# -- the task ---------------------------------------------------------------------------------------------------

def system_prompt(tokens: int, seed: int) -> torch.Tensor:
    """``--system-prompt-tokens``: the fixed tokens every prompt starts with ([tokens], seeded)."""
    return torch.randint(0, VOCAB, (tokens,), generator=torch.Generator().manual_seed(10 ** 5 + seed))


def make_prompts(n: int, task: str, digits: int, g: torch.Generator, system: torch.Tensor | None = None):
    """[n, S + digits + 2]: ``<system (S tokens)> <task> d1 .. dN <sep>``."""
    kinds = list(TASKS) if task == "mix" else [task]
    token = torch.tensor([TASKS[k] for k in kinds])[torch.randint(0, len(kinds), (n,), generator=g)]
    system = torch.zeros(0, dtype=torch.long) if system is None else system
    return torch.cat([system.expand(n, -1), token[:, None], torch.randint(0, 10, (n, digits), generator=g),
                      torch.full((n, 1), SEP)], dim=1)


def answer_of(prompts: torch.Tensor, digits: int) -> torch.Tensor:
    token, given = prompts[:, -digits - 2:-digits - 1], prompts[:, -digits - 1:-1]
    return torch.where(token == TASKS["repeat"], given,
                       torch.where(token == TASKS["reverse"], given.flip(1), given.sort(1).values))


def reward(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """The fraction of the answer positions that hold the right digit, per row."""
    return (answers == answer_of(prompts, answers.shape[1])).float().mean(1)


# -- the model --------------------------------------------------------------------------------------------------

def make_checkpoint(path: str, digits: int, seed: int, model: str = "dense", system: int = 0) -> None:
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                  max_position_embeddings=4 * digits + 8 + system, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
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
        p = make_prompts(64, args.task, args.digits, g, args.system)
        ids = torch.cat([p, answer_of(p, args.digits)], dim=1)

        def loss_fn(lp, ids, mask):
            lp = answer_slice(lp, p.shape[1], args.digits)
            return -lp.sum(), lp.numel()
        loss = float(parallm.forward_backward(chunks, ids, loss_fn=loss_fn, output="logprobs"))
        parallm.finalize_grads(chunks)
        parallm.clip_grad_norm_(chunks, 1.0)
        opt.step()
        opt.zero_grad()
    return loss


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
    args.system = system_prompt(args.system_prompt_tokens, args.seed)
    n, start = args.digits, args.system_prompt_tokens + args.digits + 2
    if rank == 0:
        make_checkpoint(ckpt, n, args.seed, args.model, args.system_prompt_tokens)
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


def check_mismatch(row: dict, limit: float) -> None:
    """Every rank raises when the step's max |engine - trainer| log-prob is above ``limit`` (the engine sampled
    from other weights than the trainer's: a stale push, a stale prefix cache, a lossy cast). The value is
    agreed on over the ranks first (max), so that all of them stop."""
    worst = torch.tensor([row["logprob_mismatch_max"]], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if not worst.item() <= limit:
        raise RuntimeError(f"step {row['step']}: the engine's log-probs of its samples are {worst.item():.2e} from "
                           f"the trainer's (--max-mismatch {limit:g}): it did not sample from the trainer's weights")


def lr_factor(step: int, steps: int) -> float:
    """The GRPO learning rate's schedule (a factor of ``--lr``): linear warm-up over the first 5% of the steps
    (at least one), then cosine down to half at the last."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / (warm + 1)
    return 0.5 + 0.25 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, steps - warm))))


def summarize(rows, args, rollout, warm_loss, accuracy, held_out: int, t_start: float) -> None:
    """Rank 0, at the end: the reward of the first and last 10 % of the steps, the worst mismatch, the pushes,
    the routing drift (MoE), the engines' prefix-cache hits (``--engines serve``), the greedy accuracy."""
    n = args.digits
    k = max(1, len(rows) // 10)
    first, last = (sum(x["reward"] for x in part) / len(part) for part in (rows[:k], rows[-k:]))
    print(f"task {args.task}, {n} digits; rollouts: {rollout.name}; warm-up loss {warm_loss:.3f} after "
          f"{args.warmup_steps} steps")
    if rows:
        worst = max(rows, key=lambda x: x["logprob_mismatch_max"])
        print(f"mean reward: first {k} steps {first:.3f}, last {k} steps {last:.3f}; max log-prob mismatch "
              f"{worst['logprob_mismatch_max']:.1e} (step {worst['step']}; every step checked <= "
              f"{args.max_mismatch:g}); push {min(x['push_s'] for x in rows):.3f}-"
              f"{max(x['push_s'] for x in rows):.3f} s")
    if rows and args.model == "moe":
        print(f"router replay: routing drift after each step's updates {min(x['routing_drift'] for x in rows):.3f}"
              f"-{max(x['routing_drift'] for x in rows):.3f} of (answer token, MoE layer) pairs")
    if hasattr(rollout, "prefix_cache"):
        hits, queries = rollout.prefix_cache()
        print(f"prefix cache: {hits:.0f} of {queries:.0f} prompt tokens served from the engines' caches")
    print(f"greedy accuracy on {held_out} held-out prompts: {accuracy[0]:.3f} before GRPO, "
          f"{accuracy[1]:.3f} after; {time.perf_counter() - t_start:.0f} s")


def run(chunks, opt, rollout, args, g, warm_loss, t_start, made, rank) -> list[dict]:
    import parallm
    from tqdm.auto import tqdm
    n, start = args.digits, args.system_prompt_tokens + args.digits + 2
    # parallm's optimizer is a torch.optim.Optimizer: torch's schedulers drive its learning rate
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    rollout.push(chunks)                             # the engine started from the initial checkpoint
    eval_prompts = make_prompts(256, args.task, n, torch.Generator().manual_seed(10 ** 6 + args.seed), args.system)
    acc_before = greedy_accuracy(rollout, eval_prompts, n)

    log = open(args.jsonl, "w") if args.jsonl and rank == 0 else None
    rows = []
    bar = tqdm(range(1, args.steps + 1), desc=f"GRPO {args.task} ({rollout.name})", disable=rank != 0,
               dynamic_ncols=True, file=sys.stdout, mininterval=1.0)
    for step in bar:
        t0 = time.perf_counter()
        prompts = make_prompts(args.prompts, args.task, n, g, args.system).repeat_interleave(args.group, dim=0)
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
                            f"mismatch max {row['logprob_mismatch_max']:.1e} push {push['seconds'] * 1e3:.0f} ms",
                            refresh=False)
        if log:
            log.write(json.dumps(row) + "\n")
            log.flush()
        check_mismatch(row, args.max_mismatch)
    bar.close()
    acc_after = greedy_accuracy(rollout, eval_prompts, n)
    if rank == 0:
        summarize(rows, args, rollout, warm_loss, (acc_before, acc_after), len(eval_prompts), t_start)
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
