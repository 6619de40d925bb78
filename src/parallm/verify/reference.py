"""The transformers side of a verification (no torch.distributed here).

Tiny models with every weight non-trivial (transformers initialises norms to 1 and biases to 0, which would hide a
mapping bug), the test batch, the losses of the training step, transformers' output / one SGD step on a
checkpoint, and the comparisons. Outputs are what ``parallm.forward`` returns: fp32 logits ``[B, S, V]``, or for
value models ``score(last hidden state)`` ``[B, S]``; they are compared at real (unpadded) positions only.
"""

from __future__ import annotations

import gc

import torch

from . import AUTO_UPDATE, VERIFY_DTYPES
from .ties import lowest_first_topk, near_tie_note

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=101, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
            attn_implementation="eager")


def tiny_config(family: str, **overrides):
    """A small transformers config of ``family`` (a model_type: "llama", "qwen2", "qwen3", "mistral", ...):
    hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 101, untied, eager attention, unless overridden."""
    import transformers
    return transformers.AutoConfig.for_model(family, **dict(TINY, **overrides))


def randomize_weights(model, seed: int) -> None:
    """Every weight non-trivial: norms around 1, biases non-zero, matrices ~N(0, 0.08)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def make_hf_model(config, *, task: str = "causal_lm", seed: int = 0):
    """A transformers model of ``config`` (``*ForCausalLM``, or ``*ForSequenceClassification`` with one label
    for ``task="value"``), fp32, eval mode, weights from :func:`randomize_weights`; tied embeddings stay tied."""
    import transformers
    quiet_transformers()
    torch.manual_seed(seed)
    if task == "value":
        config.num_labels = 1
        if config.pad_token_id is None:
            config.pad_token_id = 0
        model = transformers.AutoModelForSequenceClassification.from_config(config, **{_dtype_kwarg(): torch.float32})
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, **{_dtype_kwarg(): torch.float32})
    model = model.float().eval()
    randomize_weights(model, seed)
    if getattr(config, "tie_word_embeddings", False) and task == "causal_lm":
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def padded_batch(vocab: int, *, batch: int = 4, seq: int = 10, seed: int = 1):
    """``input_ids, attention_mask`` ``[batch, seq]``; rows cycle through: full, left-padded (30 % of the row),
    right-padded (40 %), padded on both sides (1 left, 2 right). Padded ids are 0."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for b in range(batch):
        if b % 4 == 1:
            mask[b, :max(1, int(0.3 * seq + 0.5))] = 0
        elif b % 4 == 2:
            mask[b, seq - max(1, int(0.4 * seq + 0.5)):] = 0
        elif b % 4 == 3:
            mask[b, :1] = 0
            mask[b, -2:] = 0
    return ids.masked_fill(mask == 0, 0), mask


# -- losses of the training step -----------------------------------------------------------------------------


def causal_lm_loss(logits, ids, mask):
    """Mean next-token cross entropy over real (unpadded) positions."""
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def value_loss(values, ids, mask):
    """Mean squared error of the values against a deterministic target made from the tokens, ``(id % 7) / 7``."""
    target = (ids % 7).float() / 7.0
    m = mask.float()
    return (((values.float() - target) ** 2) * m).sum() / m.sum()


def loss_for(task: str):
    return value_loss if task == "value" else causal_lm_loss


# -- transformers ---------------------------------------------------------------------------------------------


def _dtype_kwarg() -> str:
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def quiet_transformers() -> None:
    import transformers
    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass


def load_transformers(path: str, *, task: str, device="cpu", dtype=torch.float32):
    """transformers' model of a checkpoint directory in ``dtype`` (fp32 by default) with eager attention, and its
    loading info."""
    import transformers
    quiet_transformers()
    cls = transformers.AutoModelForSequenceClassification if task == "value" else transformers.AutoModelForCausalLM
    kw = {_dtype_kwarg(): dtype, "attn_implementation": "eager", "output_loading_info": True}
    if task == "value":
        kw["num_labels"] = 1
    model, info = cls.from_pretrained(path, **kw)
    return model.to(dtype=dtype, device=device).eval(), info


def check_dtype(name: str) -> torch.dtype:
    """A verification dtype by name: float32, or bfloat16 (float16 cannot train without loss scaling, which
    parallm does not do)."""
    if name not in VERIFY_DTYPES:
        raise ValueError(f"dtype {name!r} cannot be verified; use one of {', '.join(VERIFY_DTYPES)}")
    return getattr(torch, name)


def sgd_step(p: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
    """``p - lr * grad`` computed in fp32 and rounded once into ``p``'s dtype: the step both sides take, so
    that in bf16 they differ only by their gradients (parallm's fp32 ``main_grad``, transformers' bf16 grad)."""
    return (p.float() - lr * grad.float()).to(p.dtype)


def hf_output(model, ids, mask, *, task: str = "causal_lm") -> torch.Tensor:
    """What ``parallm.forward`` returns, computed by transformers with the same position_ids: fp32 logits, or
    ``score(model.model(...).last_hidden_state)`` (one value per token) for value models. Gradients flow."""
    from ..api import default_position_ids
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    pos = default_position_ids(mask)
    if task == "value":
        hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        return model.score(hidden).squeeze(-1).float()
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


def hf_state(model, *, clone: bool = True) -> dict[str, torch.Tensor]:
    """The tensors an HF checkpoint of ``model`` holds, on CPU, in the checkpoint's names (a tied lm_head dropped,
    as save_pretrained does). transformers 5 fuses MoE experts in memory (``experts.gate_up_proj``); its own
    save-time conversion gives the per-expert tensors a checkpoint holds."""
    sd = {k: (v.detach().cpu().clone() if clone else v.detach().cpu()) for k, v in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: the in-memory names are the checkpoint's
        revert_weight_conversion = None
    if revert_weight_conversion is not None:
        sd = dict(revert_weight_conversion(model, sd))
    if getattr(model.config, "tie_word_embeddings", False) and "score.weight" not in sd:
        sd.pop("lm_head.weight", None)
    return sd


# -- comparisons ----------------------------------------------------------------------------------------------


def max_diff_real(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest absolute difference of two outputs at real positions (``mask == 1``), in fp32."""
    m = mask.bool().cpu()
    return (a.float().cpu()[m] - b.float().cpu()[m]).abs().max().item()


def compare_states(got: dict, want: dict) -> tuple[bool, float, str]:
    """(bit-exact?, max |difference| (inf when names or shapes differ), what differs) of two HF state dicts."""
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    problems = [f"missing {', '.join(missing[:5])}"] if missing else []
    if extra:
        problems.append(f"extra {', '.join(extra[:5])}")
    worst, worst_name, unequal = (float("inf") if problems else 0.0), None, []
    for k in sorted(set(got) & set(want)):
        a, b = got[k], want[k]
        if a.shape != b.shape:
            problems.append(f"{k}: shape {tuple(a.shape)} vs {tuple(b.shape)}")
            worst = float("inf")
            continue
        if not torch.equal(a, b.to(a.dtype)):
            unequal.append(k)
            d = (a.float() - b.float()).abs().max().item()
            if worst_name is None or d > worst:
                worst_name = k
            worst = max(worst, d)
    if unequal:
        problems.append(f"{len(unequal)} tensor(s) differ, most: {worst_name}")
    return not problems, worst, "; ".join(problems)


def stepped_difference(got: dict, want: dict, dtype) -> tuple[float, str]:
    """How far parallm's weights after the step (``got``) are from transformers' (``want``): the max absolute
    difference in fp32; in a low-precision ``dtype`` the max over elements of what exceeds one rounding step of
    ``dtype`` at the reference weight (``|w| = m 2^e``, ``m`` in [0.5, 1): spacing ``eps 2^(e-1)``), since the two
    sides round ``w - lr g`` from slightly different gradients (fp32 ``main_grad`` vs a bf16 grad) and a
    rounding may fall either way. inf (and what) when names or shapes differ."""
    same, worst, what = compare_states(got, want)
    if same or dtype == torch.float32 or worst == float("inf"):
        return worst, what
    eps, worst, where = torch.finfo(dtype).eps, 0.0, None
    for k in sorted(got):
        a, b = got[k].float(), want[k].float()
        _, e = torch.frexp(b.abs())
        excess = ((a - b).abs() - eps * torch.ldexp(torch.ones_like(b), e - 1)).clamp(min=0).max().item()
        if excess > worst:
            worst, where = excess, k
    return worst, (f"most beyond one {str(dtype).replace('torch.', '')} step: {where}" if where else "")


# -- the reference run ----------------------------------------------------------------------------------------


def reference(ckpt: str, task: str, *, ids, mask, pre: dict, pieces: int, lr: float | None, device="cpu",
              dtype=torch.float32) -> dict:
    """transformers on the same checkpoint: the output, one SGD step (the loss is the mean over ``pieces`` equal
    slices of the batch, as parallm's data-parallel replicas x microbatches compute it), the output and weights
    after it. ``pre``: what parallm holds right after loading (HF names), compared bit for bit ("roundtrip");
    a value head that is not in the checkpoint is taken from it (parallm initialised it). ``lr=None``:
    ``AUTO_UPDATE / max|grad|``, so the largest weight moves by AUTO_UPDATE whatever the model's scale.
    ``dtype``: transformers runs in it (the model's parameters' dtype on parallm's side). Sparse-attention
    indexers break top-k ties by the lower key position, as parallm does (:mod:`.ties`); ``near_ties``: notes
    naming a top-k near-tie of the batch, before or after the step (shown when the layout differs)."""
    model, info = load_transformers(ckpt, task=task, device=device, dtype=dtype)
    notes = []
    missing = sorted(str(k) for k in info.get("missing_keys", []))
    no_score = task == "value" and "score.weight" in missing
    missing = [k for k in missing if k != "score.weight"]
    if missing:
        notes.append(f"transformers did not find {', '.join(missing[:5])} in the checkpoint")
    if no_score:
        with torch.no_grad():
            model.score.weight.copy_(pre["score.weight"].to(model.score.weight.device))
        notes.append("score.weight is not in the checkpoint: the reference uses the head parallm made "
                     "(see docs/layouts.md, value heads)")
    same, _, what = compare_states(pre, hf_state(model, clone=False))
    if not same:
        notes.append(f"round trip: {what}")
    with lowest_first_topk(model):
        out, loss, ties = _forward_and_loss(model, task, ids, mask, pieces, device)
    gmax = max((p.grad.abs().float().max().item() for p in model.parameters() if p.grad is not None), default=0.0)
    if lr is None:
        lr = AUTO_UPDATE / gmax if gmax > 0 else 1.0
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.copy_(sgd_step(p, p.grad, lr))
        with lowest_first_topk(model):
            after = hf_output(model, ids, mask, task=task).cpu()
        ties += near_tie_note(model, ids, mask, lambda: hf_output(model, ids, mask, task=task),
                              "after the step")
    stepped = hf_state(model)
    del model
    gc.collect()
    return dict(out=out, loss=loss.item(), lr=float(lr), update=float(lr * gmax), after=after, stepped=stepped,
                roundtrip=same, notes=notes, near_ties=ties)


def _forward_and_loss(model, task, ids, mask, pieces: int, device):
    """transformers' output (no grad), the loss over ``pieces`` slices (its backward run) and the near-tie notes
    of the batch."""
    with torch.no_grad():
        out = hf_output(model, ids, mask, task=task).cpu()
        ties = near_tie_note(model, ids, mask, lambda: hf_output(model, ids, mask, task=task),
                             "before the step")
    size = ids.shape[0] // pieces
    model.zero_grad(set_to_none=True)
    losses = [loss_for(task)(hf_output(model, ids[i:i + size], mask[i:i + size], task=task),
                             ids[i:i + size].to(device), mask[i:i + size].to(device))
              for i in range(0, ids.shape[0], size)]
    loss = torch.stack(losses).mean()
    loss.backward()
    return out, loss, ties


def reload_check(save_dir: str, task: str, *, saved: dict, dtype=torch.float32) -> tuple[bool, str]:
    """transformers reloads a directory parallm saved (in ``dtype``): nothing missing, unexpected or mis-shaped,
    and exactly the tensors of ``saved``. Returns (ok, what is wrong)."""
    model, info = load_transformers(save_dir, task=task, dtype=dtype)
    problems = [f"{key.replace('_', ' ')}: {', '.join(str(k) for k in list(info[key])[:5])}"
                for key in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(key)]
    same, _, what = compare_states(hf_state(model, clone=False), saved)
    if not same:
        problems.append(what)
    del model
    return not problems, "; ".join(problems)
