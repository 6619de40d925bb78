"""Training at scale: vocab-parallel log-probs / entropy, GRPO-shaped steps with clipping, schedules, recompute,
fp32 main_grad, and their errors, against transformers.

One 4-rank spawn runs every layout in turn (tp 1/2/4, pp2, pp2 x vpp2, packed + SP with recompute, vocab
padding, tied embeddings across stages, KV heads replicated over TP):

* ``forward(output="logprobs" | "logprobs+entropy", temperature=0.7)`` in small token chunks vs
  ``log_softmax(logits / T)`` of transformers' logits, at real positions;
* a GRPO-shaped step: ``forward_backward`` with a clipped-ratio policy loss from the log-probs minus an entropy
  bonus, ``finalize_grads``, ``clip_grad_norm_`` with norm_type inf (no clipping) and 2 (clipping), SGD; the
  norms against ``torch.nn.utils.clip_grad_norm_`` on the unsharded transformers model and the weights after
  the step against the same step in transformers;
* a bf16 model: gradients only in fp32 ``main_grad``; live saved activations and in-flight send buffers do not
  grow with the number of microbatches (pp 1 and 2); recompute keeps gradients and drops the layers' saved
  activations;
* the errors (unknown output, temperature <= 0, output on a value model, a bad value on one rank only) on
  every rank, quickly.
"""

import math
import weakref

import helpers
import pytest
import torch

T = 0.7
LR = 0.5
CHUNK = 5           # tokens per head chunk: several chunks per microbatch


# -- pure: schedules -------------------------------------------------------------------------------------------

def test_schedules_complete_and_bound_live_microbatches():
    """Every microbatch count, multiples of pp or not, completes with at most warm-up + 1 live forwards, the
    warm-up being Megatron's when pp divides the count and (vpp - 1) * (largest group - pp) longer otherwise
    (docs/pipeline.md states the bound); the warm-up formula is checked independently of the code's."""
    from parallm.parallel.pipeline import exchange_plan, warmup_steps, schedule, simulate
    for pp in range(1, 9):
        for vpp in range(1, 5):
            if pp == 1 and vpp > 1:
                continue
            for m in range(1, 3 * pp + 2):
                steps = [schedule(pp, p, vpp, m, backward=True) for p in range(pp)]
                for p in range(pp):   # every (microbatch, chunk) forward once, then backward once
                    fwd = [s[1:] for s in steps[p] if s[0] == "F"]
                    bwd = [s[1:] for s in steps[p] if s[0] == "B"]
                    assert sorted(fwd) == sorted(bwd) == sorted((i, v) for i in range(m) for v in range(vpp))
                    for k, (kind, i, v) in enumerate(steps[p]):
                        if kind == "B":
                            assert ("F", i, v) in steps[p][:k]
                stuck, peak = simulate(steps, pp, vpp)
                assert not stuck, (pp, vpp, m, stuck)
                if vpp == 1:      # 1F1B: at most pp - p microbatches alive on rank p
                    assert all(peak[p] <= min(m, pp - p) for p in range(pp)), (pp, m, peak)
                else:             # warm-up + 1 virtual microbatches (Megatron's bound when pp divides m)
                    assert all(peak[p] <= warmup_steps(pp, p, vpp, m) + 1 for p in range(pp)), (pp, vpp, m)
                    largest = pp + -(-(m % pp) // (m // pp)) if m >= pp else m
                    bound = [min(2 * (pp - p - 1) + (vpp - 1) * largest, m * vpp) for p in range(pp)]
                    assert [warmup_steps(pp, p, vpp, m) for p in range(pp)] == bound, (pp, vpp, m)
                    if m % pp == 0:
                        assert bound == [min(2 * (pp - p - 1) + (vpp - 1) * pp, m * vpp) for p in range(pp)]  # Megatron's
                if pp > 1:        # each round's messages are matched within the round, one per link
                    rounds = exchange_plan(pp, vpp, m, backward=True)
                    sends = sorted((p, peer, name) for p in range(pp) for ops, _ in rounds[p]
                                   for op, peer, name in ops if op == "send")
                    recvs = sorted((peer, p, name) for p in range(pp) for ops, _ in rounds[p]
                                   for op, peer, name in ops if op == "recv")
                    assert sends == recvs and len(sends) == len(set(sends)), (pp, vpp, m)
    # pp == 1: each microbatch's forward, then its backward
    assert schedule(1, 0, 1, 3, backward=True) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0),
                                                   ("F", 2, 0), ("B", 2, 0)]


def test_simulation_detects_a_deadlock():
    from parallm.parallel.pipeline import simulate
    # rank 0 waits for a gradient before sending the activation rank 1 needs to produce it
    steps = [[("B", 0, 0), ("F", 0, 0)], [("F", 0, 0), ("B", 0, 0)]]
    stuck, _ = simulate(steps, 2, 1)
    assert stuck == [0, 1]


def test_output_argument_errors_name_the_value():
    from parallm.model.logprobs import check_output
    for kwargs, needle in [(dict(output="logits"), "'logits'"), (dict(output="logprobs", temperature=0), "0"),
                           (dict(output="logprobs", temperature=-1.5), "-1.5"),
                           (dict(output="logprobs", temperature=float("nan")), "nan"),
                           (dict(output="logprobs", token_chunk=0), "token_chunk must")]:
        kwargs.setdefault("temperature", 1.0)
        with pytest.raises(ValueError) as e:
            check_output(kwargs.pop("output"), kwargs.pop("temperature"), task="causal_lm", **kwargs)
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="value model"):
        check_output("logprobs", 1.0, task="value")
    assert check_output(None, 1.0, task="value") is None
    req = check_output("logprobs+entropy", 0.5, task="causal_lm", token_chunk=3)
    assert req.entropy and req.temperature == 0.5 and req.chunk == 3


# -- references ------------------------------------------------------------------------------------------------

def token_stats(logits, ids, temperature):
    """log_softmax(logits / T)[next token] (0 at the last position) and the entropy: the definition."""
    logp = (logits.float() / temperature).log_softmax(-1)
    lp = torch.zeros(ids.shape)
    lp[:, :-1] = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


def grpo_loss(out, ids, mask):
    """A clipped-ratio policy loss (old log-probs and advantages derived from the tokens) minus an entropy bonus."""
    lp, ent = out
    m = torch.zeros(mask.shape)
    m[:, :-1] = (mask[:, 1:] * mask[:, :-1]).float()
    old = lp.detach() + 0.1 * torch.sin(ids.float())
    ratio = torch.exp(lp - old)
    adv = ((ids[:, :1] % 5).float() - 2.0) / 2.0
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.95, 1.05) * adv)
    return (pg * m).sum() / m.sum() - 0.01 * (ent * mask).sum() / mask.sum()


def reference(model, ids, mask, pieces):
    """transformers: stats, and the GRPO step (mean over ``pieces`` equal batch pieces): inf norm, 2-norm
    (clipping at half of it), weights after SGD."""
    import copy

    import parallm
    model = copy.deepcopy(model)
    pos = parallm.default_position_ids(mask)
    with torch.no_grad():
        lp, ent = token_stats(model(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, T)
    size = ids.shape[0] // pieces
    losses = []
    for i in range(0, ids.shape[0], size):
        sl = slice(i, i + size)
        logits = model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=pos[sl]).logits
        losses.append(grpo_loss(token_stats(logits, ids[sl], T), ids[sl], mask[sl]))
    loss = torch.stack(losses).mean()
    loss.backward()
    params = list(model.parameters())      # a tied weight appears once
    inf_norm = torch.nn.utils.clip_grad_norm_(params, 1e9, norm_type=float("inf")).item()
    norm = torch.nn.utils.get_total_norm([p.grad for p in params]).item()
    clipped = torch.nn.utils.clip_grad_norm_(params, norm / 2).item()
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
    return dict(lp=lp, ent=ent, loss=loss.item(), inf_norm=inf_norm, norm=clipped,
                after=helpers.hf_state_dict(model))


# -- rank side -------------------------------------------------------------------------------------------------

class _Held:
    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor):
        self.tensor = tensor


class SavedBytes:
    """Bytes of tensors autograd has saved and not yet freed (saved_tensors_hooks), and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def pack(self, t):
        holder = _Held(t)
        n = t.numel() * t.element_size()
        self.live += n
        self.peak = max(self.peak, self.live)
        weakref.finalize(holder, self._free, n)
        return holder

    @staticmethod
    def unpack(holder):
        return holder.tensor

    def measure(self, fn):
        self.live = self.peak = 0
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            fn()
        return self.peak


class SentBytes:
    """Bytes of tensors the pipeline hands to its transport as sends and still referenced (in-flight send buffers
    the pipeline keeps alive), and their peak."""

    def __init__(self):
        self.live = self.peak = 0

    def _free(self, n):
        self.live -= n

    def measure(self, fn):
        from parallm.parallel.pipeline import DistTransport
        real = DistTransport.post
        self.live = self.peak = 0

        def post(transport, ops):
            for is_send, tensor, _ in ops:
                if is_send:
                    n = tensor.numel() * tensor.element_size()
                    self.live += n
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(tensor, self._free, n)
            return real(transport, ops)
        DistTransport.post = post
        try:
            fn()
        finally:
            DistTransport.post = real
        return self.peak


def _stats_diff(out, case, rows, mask):
    lp, ent = out
    m = mask.bool()
    return max((lp - case["ref"]["lp"][rows])[m].abs().max().item(),
               (ent - case["ref"]["ent"][rows])[m].abs().max().item(),
               lp[:, -1].abs().max().item())


def _run_case(parallm, case, rank):
    from parallm.parallel.state import current_dims
    parallm.init_parallel(tp=case["tp"], pp=case["pp"], vpp=case["vpp"])
    lay = current_dims()
    chunks = parallm.build_model(case["ckpt"], **case["build"])
    parallm.load_hf_weights(chunks, case["ckpt"])
    ids, mask = case["ids"], case["mask"]
    res = {"name": case["name"]}

    lp = parallm.forward(chunks, ids, mask, output="logprobs", temperature=T, token_chunk=CHUNK)
    both = parallm.forward(chunks, ids, mask, output="logprobs+entropy", temperature=T, token_chunk=CHUNK)
    assert isinstance(both, parallm.TokenStats) and lp.dtype == both.entropy.dtype == torch.float32
    assert tuple(lp.shape) == tuple(ids.shape) and torch.equal(lp, both.logprobs)
    res["stats"] = _stats_diff(both, case, slice(None), mask)
    gathered = [torch.empty_like(lp) for _ in range(lay.world)]
    torch.distributed.all_gather(gathered, lp)
    res["same_everywhere"] = all(torch.equal(g, lp) for g in gathered)

    per = ids.shape[0] // lay.dp
    sl = slice(lay.dp_rank * per, (lay.dp_rank + 1) * per)
    loss = parallm.forward_backward(chunks, ids[sl], mask[sl], loss_fn=grpo_loss, num_microbatches=case["nmb"],
                                    output="logprobs+entropy", temperature=T, token_chunk=CHUNK)
    parallm.finalize_grads(chunks)
    res["loss"] = abs(loss.item() - case["ref"]["loss"])
    res["inf_norm"] = parallm.clip_grad_norm_(chunks, 1e9, norm_type=float("inf")).item()
    res["norm"] = parallm.clip_grad_norm_(chunks, case["ref"]["norm"] / 2).item()
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p -= LR * p.grad
    after = parallm.save_hf_weights(chunks)
    if rank == 0:
        ref = case["ref"]["after"]
        assert after.keys() == ref.keys()
        res["weights"] = max((after[k] - ref[k]).abs().max().item() for k in ref)
    parallm.destroy_parallel()
    return res


def _bf16_accumulation_error(parallm, chunks, ids, mask, loss_fn) -> float:
    """How far the fp32 ``main_grad`` of a bf16 model after two microbatches is from the fp32 sum of the two
    microbatches' gradients, each taken alone (relative, worst parameter).

    Why this reference allows a tight bound: in the two-microbatch run, microbatch i back-propagates loss_i / 2.
    The backward is linear in its incoming gradient and halving is exact in binary floating point, so its bf16
    ``param.grad`` is exactly half the one-microbatch run's (barring subnormals). Accumulating in fp32 then
    computes ``fp32(g_1) / 2 + fp32(g_2) / 2`` with one fp32 addition: the same bits as the reference. An
    accumulation in bf16 instead rounds that sum to bf16, a relative error of about 2^-9 per element, which a
    bound of 1e-6 rejects."""
    from parallm.model.params import grad_of, zero_grads
    params = [p for c in chunks for p in c.parameters()]
    zero_grads(chunks)
    parallm.forward_backward(chunks, ids[:4], mask[:4], loss_fn=loss_fn, num_microbatches=2, output="logprobs")
    both = [grad_of(p).clone() for p in params]
    alone = []
    for half in (slice(0, 2), slice(2, 4)):
        zero_grads(chunks)
        parallm.forward_backward(chunks, ids[half], mask[half], loss_fn=loss_fn, output="logprobs")
        alone.append([grad_of(p).clone() for p in params])
    zero_grads(chunks)
    worst = 0.0
    for got, a, b in zip(both, *alone):
        want = a / 2 + b / 2
        worst = max(worst, ((got - want).norm() / want.norm().clamp(min=1e-30)).item())
    return worst


def _extras(parallm, ckpt, ids, mask):
    """bf16 main_grad, memory vs number of microbatches, recompute."""
    out = {}
    loss_fn = lambda o, i, m: -(o * m).sum() / m.sum()  # noqa: E731
    # -- bf16 at tp 2 (dp 2): gradients only in fp32 main_grad, accumulated in fp32
    parallm.init_parallel(tp=2)
    for dtype in (torch.float32, torch.bfloat16):
        chunks = parallm.build_model(ckpt, dtype=dtype)
        parallm.load_hf_weights(chunks, ckpt)
        parallm.forward_backward(chunks, ids[:4], mask[:4], loss_fn=loss_fn, num_microbatches=2, output="logprobs")
        params = dict(chunks[0].named_parameters())
        if dtype == torch.bfloat16:
            out["bf16_grad_none"] = all(p.grad is None for p in params.values())
            out["bf16_main_grad_fp32"] = all(p.main_grad.dtype == torch.float32 for p in params.values())
            parallm.finalize_grads(chunks)
            out["bf16_after_finalize"] = all(p.grad is None and p.main_grad.dtype == torch.float32
                                             for p in params.values())
            out["bf16_norm_finite"] = math.isfinite(parallm.clip_grad_norm_(chunks, 1.0).item())
            out["bf16_accumulation_rel"] = _bf16_accumulation_error(parallm, chunks, ids, mask, loss_fn)
        else:
            out["fp32_no_main_grad"] = all(getattr(p, "main_grad", None) is None for p in params.values())
            parallm.finalize_grads(chunks)
    # -- memory: live saved activations with 2 vs 8 microbatches of the same size (pp 1, then pp 2)
    meter = SavedBytes()
    batch = torch.cat([ids, ids])  # 16 rows
    bmask = torch.cat([mask, mask])
    for tp, pp in ((2, 1), (1, 2)):
        parallm.init_parallel(tp=tp, pp=pp)
        chunks = parallm.build_model(ckpt)
        parallm.load_hf_weights(chunks, ckpt)
        peaks, sent = [], []
        for n in (2, 8):
            def run(chunks=chunks, n=n):
                parallm.forward_backward(chunks, batch[:2 * n], bmask[:2 * n], loss_fn=loss_fn,
                                         num_microbatches=n, output="logprobs")
            peaks.append(meter.measure(run))
            sent.append(SentBytes().measure(run))
        out[f"saved_peaks_tp{tp}_pp{pp}"] = peaks
        out[f"sent_peaks_tp{tp}_pp{pp}"] = sent
    # -- recompute (tp 2, packed + SP): same gradients, layers' activations not kept
    parallm.init_parallel(tp=2)
    grads = {}
    for recompute in (None, "full"):
        chunks = parallm.build_model(ckpt, packed=True, sequence_parallel=True, recompute=recompute)
        parallm.load_hf_weights(chunks, ckpt)
        peak = meter.measure(lambda chunks=chunks: parallm.forward_backward(
            chunks, ids[:4], mask[:4], loss_fn=loss_fn, num_microbatches=1, output="logprobs"))
        grads[recompute] = {n: p.grad for n, p in chunks[0].named_parameters()}
        out[f"recompute_{recompute}_saved"] = peak
    out["recompute_grad_diff"] = max((grads[None][n] - grads["full"][n]).abs().max().item() for n in grads[None])
    parallm.destroy_parallel()
    return out


def _errors(parallm, rank, ckpt, ids, mask):
    """Every bad output / temperature is a ValueError on every rank naming the value; nothing hangs."""
    import time
    parallm.init_parallel(tp=2, pp=2)
    chunks = parallm.build_model(ckpt)
    parallm.load_hf_weights(chunks, ckpt)
    value = parallm.build_model(ckpt, task="value")
    loss_fn = lambda o, i, m: o.sum()  # noqa: E731
    calls = {
        "unknown": lambda: parallm.forward(chunks, ids, mask, output="probs"),
        "temperature0": lambda: parallm.forward_backward(chunks, ids, mask, loss_fn=loss_fn, output="logprobs",
                                                         temperature=0.0),
        "temperature_neg": lambda: parallm.forward(chunks, ids, mask, output="logprobs", temperature=-2),
        "value": lambda: parallm.forward(value, ids, mask, output="logprobs+entropy"),
        "one_rank": lambda: parallm.forward(chunks, ids, mask, output="logprobs" if rank != 3 else "logprob"),
    }
    out = {}
    for name, call in calls.items():
        t = time.monotonic()
        try:
            call()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - every error is reported back
            out[name] = (type(e).__name__, str(e), time.monotonic() - t)
    out["after"] = tuple(parallm.forward(chunks, ids, mask, output="logprobs").shape)
    parallm.destroy_parallel()
    return out


def _rank(rank, world, cases, extra_ckpt, ids, mask):
    import parallm
    results = [_run_case(parallm, case, rank) for case in cases]
    return results, _extras(parallm, extra_ckpt, ids, mask), _errors(parallm, rank, extra_ckpt, ids, mask)


CASES = [
    # name, family, config overrides, layout (tp, pp, vpp), build options
    ("llama tp1 dp4 v101", "llama", dict(attention_bias=True), (1, 1, None), {}),
    ("qwen2 tp2 tied nkv1 v99 (padding)", "qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1,
                                                          vocab_size=99), (2, 1, None), {}),
    ("llama tp4 nkv2 v101 (padding)", "llama", dict(), (4, 1, None), {}),
    ("qwen2 pp2 dp2 tied", "qwen2", dict(num_hidden_layers=4, tie_word_embeddings=True), (1, 2, None), {}),
    ("llama pp2 vpp2 dp2 tied", "llama", dict(num_hidden_layers=4, tie_word_embeddings=True), (1, 2, 2), {}),
    ("qwen2 packed+SP tp2 pp2 nkv1 v99 recompute", "qwen2",
     dict(num_hidden_layers=4, num_key_value_heads=1, vocab_size=99), (2, 2, None),
     dict(packed=True, sequence_parallel=True, recompute="full")),
    ("qwen3 tp4 vocab_multiple 64 (ranks without real columns)", "qwen3", dict(), (4, 1, None),
     dict(vocab_multiple=64)),
]


@pytest.mark.timeout(600)
def test_logprobs_grpo_step_clip_main_grad_schedules_recompute_errors(tmp_path):
    ids, mask = helpers.padded_batch(99, seed=5, batch=8, seq=9)
    cases = []
    for i, (name, family, overrides, (tp, pp, vpp), build) in enumerate(CASES):
        cfg = helpers.tiny_config(family, **overrides)
        model = helpers.make_hf_model(cfg, seed=30 + i)
        ckpt = helpers.save_checkpoint(model, str(tmp_path / f"m{i}"))
        dp = 4 // (tp * pp)
        nmb = 2
        cases.append(dict(name=name, ckpt=ckpt, tp=tp, pp=pp, vpp=vpp, build=build, ids=ids, mask=mask, nmb=nmb,
                          ref=reference(model, ids, mask, dp * nmb)))
    extra_ckpt = cases[0]["ckpt"]
    results = helpers.run_ranks(_rank, 4, cases, extra_ckpt, ids, mask, timeout=560)

    failures = []
    print()
    for idx, case in enumerate(cases):
        per_rank = [r[0][idx] for r in results]
        stats = max(r["stats"] for r in per_rank)
        loss = max(r["loss"] for r in per_rank)
        inf_norms = [r["inf_norm"] for r in per_rank]
        norms = [r["norm"] for r in per_rank]
        ref = case["ref"]
        w = per_rank[0]["weights"]
        print(f"{case['name']:<44} stats {stats:.1e} loss {loss:.1e} norm {norms[0]:.6f}/{ref['norm']:.6f} "
              f"inf {inf_norms[0]:.6f}/{ref['inf_norm']:.6f} weights {w:.1e}")
        if not stats < 2e-5:
            failures.append(f"{case['name']}: log-probs / entropy differ by {stats:.3g}")
        if not all(r["same_everywhere"] for r in per_rank):
            failures.append(f"{case['name']}: log-probs differ between ranks")
        if not loss < 2e-5:
            failures.append(f"{case['name']}: loss differs by {loss:.3g}")
        if len(set(norms)) != 1 or len(set(inf_norms)) != 1:
            failures.append(f"{case['name']}: norms differ between ranks {norms} {inf_norms}")
        if abs(norms[0] - ref["norm"]) > 1e-5 * ref["norm"] or abs(inf_norms[0] - ref["inf_norm"]) > 1e-5 * ref["inf_norm"]:
            failures.append(f"{case['name']}: norms {norms[0]}, {inf_norms[0]} vs torch's {ref['norm']}, "
                            f"{ref['inf_norm']}")
        if not w < 2e-5:
            failures.append(f"{case['name']}: weights after the clipped step differ by {w:.3g}")

    for rank, (_, extras, errors) in enumerate(results):
        print(f"rank {rank}: {extras}")
        for key in ("bf16_grad_none", "bf16_main_grad_fp32", "bf16_after_finalize", "fp32_no_main_grad",
                    "bf16_norm_finite"):
            if not extras[key]:
                failures.append(f"rank {rank}: {key} is False")
        if not extras["bf16_accumulation_rel"] < 1e-6:   # derivation: _bf16_accumulation_error
            failures.append(f"rank {rank}: bf16 main_grad is not an fp32 accumulation of the microbatches' "
                            f"gradients ({extras['bf16_accumulation_rel']:.3g})")
        for layout in ("tp2_pp1", "tp1_pp2"):
            two, eight = extras[f"saved_peaks_{layout}"]
            if not (two > 0 and eight <= two * 1.05):
                failures.append(f"rank {rank} {layout}: saved activations grow with microbatches: {two} -> {eight}")
        two, eight = extras["sent_peaks_tp1_pp2"]
        if not (two > 0 and eight <= two * 1.05):
            failures.append(f"rank {rank}: in-flight send buffers grow with microbatches: {two} -> {eight}")
        if not extras["recompute_grad_diff"] < 1e-6:
            failures.append(f"rank {rank}: recompute changes gradients by {extras['recompute_grad_diff']:.3g}")
        if not extras["recompute_full_saved"] * 3 <= extras["recompute_None_saved"]:
            failures.append(f"rank {rank}: recompute saved {extras['recompute_full_saved']} vs "
                            f"{extras['recompute_None_saved']} bytes")
        for name, needle, culprit in [("unknown", "'probs'", None), ("temperature0", "0.0", None),
                                      ("temperature_neg", "-2", None), ("value", "value model", None),
                                      ("one_rank", "'logprob'", 3)]:
            got = errors[name]
            if got is None or got[0] != "ValueError" or needle not in got[1] or got[2] > 60:
                failures.append(f"rank {rank} {name}: {got}")
            elif culprit is not None and rank != culprit and f"failed on rank {culprit}" not in got[1]:
                failures.append(f"rank {rank} {name}: culprit not named: {got[1]}")
        if errors["after"] != tuple(ids.shape):
            failures.append(f"rank {rank}: forward after the errors gave {errors['after']}")
    assert not failures, "\n".join(failures)
