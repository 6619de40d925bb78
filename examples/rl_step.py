"""One PPO / GRPO actor update with parallm, checked against transformers + torch.optim.AdamW.

    python examples/rl_step.py [CHECKPOINT] [--out DIR] [--steps 4] [--lr 1e-4] [--tp 2]

It starts itself under ``torch.distributed.run`` with ``--tp`` local ranks (gloo on CPU); ``torchrun
--nproc-per-node 2 examples/rl_step.py ...`` works too (tp = the number of ranks, unless ``--tp`` says less: the
rest are data-parallel replicas). Without a CHECKPOINT it writes a tiny Qwen3 with transformers (hidden 128, 2
layers, vocab 512, random weights) into a temporary directory and uses that.

What it does, the recipe of docs/api.md's "A GRPO / PPO actor step":

1. ``init_parallel``, ``build_model`` + ``load_hf_weights``, ``build_optimizer`` (AdamW, weight decay 0.01 off
   biases and norms) with a ``torch.optim.lr_scheduler.LambdaLR`` (linear warm-up, cosine decay).
2. A batch per data-parallel replica (its generator seeded by ``chunks[0].dims.dp_rank``: every tensor- and
   pipeline-parallel rank of a replica passes the replica's whole batch; sharding data by global rank is an
   error): prompts + responses with left padding, a response mask, one advantage per sequence.
3. The old policy's log-probs: ``forward(batch, output="logprobs")``.
4. ``--steps`` updates: ``forward_backward`` with the batch mapping (the old log-probs, advantages and response
   mask are entries of the batch, split with its rows into each microbatch's ``loss_fn(out, mb)``),
   ``output="logprobs+entropy"``, a PPO-clip loss returned as ``((loss_sum, num_tokens), metrics)``: a token
   mean over the whole batch of every replica, not a mean of per-microbatch means; then ``finalize_grads``,
   ``clip_grad_norm_``, ``opt.step()``, ``sched.step()``, ``opt.zero_grad()``.
5. ``save_hf_weights`` into ``--out``.

The check (rank 0; ``--no-check`` skips it): the same steps on one transformers model of the checkpoint with
``torch.optim.AdamW`` (the same two parameter groups), ``torch.nn.utils.clip_grad_norm_`` and the same
``LambdaLR``, on the same batches: the loss, the gradient norm and the entropy metric of every step, and the
weights at the end (transformers reloading ``--out``), must agree within fp32 tolerances, and the reloaded
directory's logits must match parallm's. It prints ``OK`` and exits 0, or names what differs and exits 1.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile

import torch

BATCH, SEQ, PROMPT = 8, 24, 8          # sequences per replica, tokens per sequence, prompt tokens
MICROBATCHES = 4
CLIP = 0.2                             # PPO's clip range
TOL = {"loss": 1e-5, "grad_norm": 1e-4, "entropy": 1e-5, "weights": 2e-5, "logits": 1e-4}


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", help="an HF checkpoint directory (default: a tiny Qwen3 written here)")
    p.add_argument("--out", help="where save_hf_weights writes the trained model (default: a temporary directory)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the number of ranks)")
    p.add_argument("--no-check", action="store_true", help="skip the transformers + torch AdamW comparison")
    return p.parse_args(argv)


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 2 steps, then cosine decay to 0 at ``steps``."""
    return min(1.0, (step + 1) / 2) * 0.5 * (1 + math.cos(math.pi * step / steps))


def _transformers():
    import transformers
    transformers.utils.logging.disable_progress_bar()
    return transformers


def tiny_checkpoint(path: str) -> str:
    """A tiny Qwen3 (random weights, seed 0) written with transformers' save_pretrained."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=256, vocab_size=512, head_dim=32,
                                      tie_word_embeddings=False)
    transformers.Qwen3ForCausalLM(config).float().save_pretrained(path)
    return path


def make_batch(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """One replica's rollouts: ``BATCH`` sequences of ``SEQ`` tokens, left-padded prompts of ``PROMPT`` tokens
    followed by a response; the response mask, an advantage per sequence."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    attention_mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    for b in range(BATCH):
        attention_mask[b, : b % 4] = 0                      # left padding
    response_mask = torch.zeros(BATCH, SEQ)
    response_mask[:, PROMPT:] = 1
    response_mask *= attention_mask
    return {"input_ids": input_ids.masked_fill(attention_mask == 0, 0), "attention_mask": attention_mask,
            "response_mask": response_mask, "advantages": torch.randn(BATCH, generator=g)}


def ppo_terms(logprobs, entropy, mb):
    """The PPO-clip objective's pieces for one microbatch: ``(loss_sum, num_tokens, entropy_sum, clipped)``.
    ``logprobs[:, t]`` is the log-prob of token ``t + 1``, so the response mask is shifted by one."""
    m = torch.zeros_like(logprobs)
    m[:, :-1] = mb["response_mask"][:, 1:]
    ratio = torch.exp(logprobs - mb["old_logprobs"])
    adv = mb["advantages"][:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    clipped = (((ratio - 1).abs() > CLIP).float() * m).sum()
    return (pg * m).sum(), m.sum(), (entropy * m).sum(), clipped


def loss_fn(out, mb):
    """parallm's loss: ``((loss_sum, num_tokens), metrics)``, a token mean over the global batch."""
    loss_sum, n, ent, clipped = ppo_terms(out.logprobs, out.entropy, mb)
    denom = n.clamp(min=1)
    return (loss_sum, n), {"entropy": ent / denom, "clipfrac": clipped / denom}


def train(args, ckpt: str, out_dir: str):
    """The parallm side (every rank). Returns ``(per-step figures, the same on every rank; logits of replica 0's
    batch after the steps; the layout)``."""
    import parallm
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    dims = chunks[0].dims
    batch = make_batch(chunks[0].spec.vocab_size, seed=dims.dp_rank)     # one batch per replica
    with torch.no_grad():
        batch["old_logprobs"] = parallm.forward(chunks, batch, output="logprobs")
    opt = parallm.build_optimizer(chunks, lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    rows = []
    for step in range(args.steps):
        loss, metrics = parallm.forward_backward(chunks, batch, loss_fn=loss_fn, num_microbatches=MICROBATCHES,
                                                 output="logprobs+entropy")
        parallm.finalize_grads(chunks)
        grad_norm = parallm.clip_grad_norm_(chunks, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        rows.append({"loss": float(loss), "grad_norm": float(grad_norm), "entropy": float(metrics["entropy"]),
                     "clipfrac": float(metrics["clipfrac"])})
        if dims.rank == 0:
            print(f"step {step}: loss {rows[-1]['loss']:+.5f}  grad norm {rows[-1]['grad_norm']:.4f}  entropy "
                  f"{rows[-1]['entropy']:.4f}  clipfrac {rows[-1]['clipfrac']:.3f}", flush=True)
    with torch.no_grad():
        logits = parallm.forward(chunks, batch["input_ids"], batch["attention_mask"])
    parallm.save_hf_weights(chunks, out_dir, overwrite=True)
    return rows, logits, dims


def hf_token_stats(model, ids, mask):
    """transformers' log-probs of the next tokens and entropies, as parallm's ``output="logprobs+entropy"``."""
    import parallm
    logits = model(input_ids=ids, attention_mask=mask, position_ids=parallm.default_position_ids(mask)).logits
    logp = logits.float().log_softmax(-1)
    lp = torch.zeros(ids.shape, dtype=torch.float32)
    lp[:, :-1] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1), logits.float()


def reference(args, ckpt: str, dp: int) -> tuple[list[dict], dict]:
    """The same steps on one transformers model with torch.optim.AdamW: per-step figures and final weights."""
    transformers = _transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).train()
    vocab = model.config.vocab_size
    batches = [make_batch(vocab, seed=r) for r in range(dp)]
    with torch.no_grad():
        for b in batches:
            b["old_logprobs"] = hf_token_stats(model, b["input_ids"], b["attention_mask"])[0]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or p.dim() == 1)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    rows = []
    for _ in range(args.steps):
        parts = []
        for b in batches:
            lp, ent, _ = hf_token_stats(model, b["input_ids"], b["attention_mask"])
            parts.append(ppo_terms(lp, ent, b))
        loss_sum, n, ent, clipped = (sum(p[i] for p in parts) for i in range(4))
        loss = loss_sum / n                                  # the token mean over every replica's batch
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        rows.append({"loss": loss.item(), "grad_norm": grad_norm.item(), "entropy": (ent / n).item(),
                     "clipfrac": (clipped / n).item()})
    return rows, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check(args, ckpt: str, out_dir: str, rows, logits, dp: int) -> list[str]:
    """rank 0: parallm's steps, saved weights and logits against the transformers + AdamW reference."""
    transformers = _transformers()
    ref_rows, ref_weights = reference(args, ckpt, dp)
    problems = []
    for step, (got, want) in enumerate(zip(rows, ref_rows)):
        print(f"reference step {step}: loss {want['loss']:+.5f}  grad norm {want['grad_norm']:.4f}  entropy "
              f"{want['entropy']:.4f}")
        for key in ("loss", "grad_norm", "entropy"):
            if abs(got[key] - want[key]) > TOL[key] * max(1.0, abs(want[key])):
                problems.append(f"step {step}: {key} {got[key]:.7g} vs transformers {want[key]:.7g}")
    saved = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    worst = max((saved.state_dict()[k] - v).abs().max().item() for k, v in ref_weights.items())
    print(f"max |weights - reference| after {args.steps} steps: {worst:.2e}")
    if worst > TOL["weights"]:
        problems.append(f"the saved weights differ from the reference by {worst:.3g}")
    batch = make_batch(saved.config.vocab_size, seed=0)
    with torch.no_grad():
        reloaded = hf_token_stats(saved, batch["input_ids"], batch["attention_mask"])[2]
    real = batch["attention_mask"].bool()
    diff = (reloaded[real] - logits[real]).abs().max().item()
    print(f"max |transformers(saved) - parallm| logits: {diff:.2e}")
    if diff > TOL["logits"]:
        problems.append(f"the reloaded directory's logits differ from parallm's by {diff:.3g}")
    return problems


def main(args) -> int:
    import torch.distributed as dist

    import parallm
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallm.init_parallel(tp=args.tp or world)
    rank = dist.get_rank()
    made = [None, None]
    if rank == 0:       # a temporary checkpoint / output directory, named to every rank
        made = [None if args.checkpoint else tempfile.mkdtemp(prefix="rl_step_ckpt_"),
                None if args.out else tempfile.mkdtemp(prefix="rl_step_out_")]
        if made[0] is not None:
            tiny_checkpoint(made[0])
    dist.broadcast_object_list(made, src=0)
    ckpt, out_dir = args.checkpoint or made[0], args.out or made[1]
    try:
        rows, logits, dims = train(args, ckpt, out_dir)
        problems = check(args, ckpt, out_dir, rows, logits, dims.dp) if rank == 0 and not args.no_check else []
        if rank == 0:
            print("\n".join(f"MISMATCH: {p}" for p in problems) or
                  ("OK: parallm matches transformers + torch.optim.AdamW" if not args.no_check else "done"))
            if args.out:
                print(f"saved to {out_dir}")
        failed = [len(problems)]
        dist.broadcast_object_list(failed, src=0)
    finally:
        if rank == 0:
            for path in made:
                if path is not None:
                    shutil.rmtree(path, ignore_errors=True)
        parallm.destroy_parallel()
    return 1 if failed[0] else 0


if __name__ == "__main__":
    if "RANK" not in os.environ:        # start the local ranks running this file
        ranks = parse().tp or 2
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc-per-node", str(ranks), os.path.abspath(__file__), *sys.argv[1:]])
    sys.exit(main(parse()))
