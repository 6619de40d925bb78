"""Sliding-window attention (``DecoderSpec.layer_windows``) in every layout, and the block kernels that run it.

* The windows families build from a config, against the per-layer windows transformers' models hold (Qwen2 with
  ``use_sliding_window`` + ``max_window_layers``, explicit ``layer_types``, Qwen2-MoE's alternation, Mistral and
  Qwen3-MoE on every layer, 4.x config.json dicts).
* Pure checks of the pieces (no process group): context-parallel attention (all-gather pieces and the ring's,
  cp 1-4, padded and packed layouts) and the packed path's windowed plan equal to masked attention over each
  row's real tokens, gradients included, with every block kernel (the explicit fp32 one, the CPU's fused one,
  the CUDA kernel's plumbing with aten's flash op emulated on CPU); pieces wholly outside the window dropped and
  the tiles never the square of a sequence.
* Kernel calls per layer that do not grow with the documents of a packed batch (4 and 64 documents).
* One 4-rank spawn against transformers through ``parallm.verify.check_layout`` (forward, one SGD step, the
  weights after it, a saved directory transformers reloads) at S = 6 x window: a Mistral (window on every layer)
  and a Qwen2 with ``use_sliding_window`` and ``max_window_layers`` (first of 4 layers full, the others windowed) at
  padded tp2, packed+SP tp2, cp2 all-gather and ring, cp4 ring, pp2.
"""

from __future__ import annotations

import math

import pytest
import torch

import helpers
from cuda_emulation import emulated_flash, local_slots
from parallm import verify

WINDOW = 8
SEQ = 6 * WINDOW


# -- windows from configs ---------------------------------------------------------------------------------------

def _hf_windows(config):
    """Each layer's window as transformers' model holds it (models with ``layer_types``: the attention module's
    ``sliding_window``, set on sliding layers; Mistral-style: the config's on every layer)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(config)
    out = []
    typed = getattr(config, "layer_types", None) is not None      # the mask each layer gets follows its type
    for layer in model.model.layers:
        out.append(getattr(layer.self_attn, "sliding_window", None) if typed
                   else getattr(config, "sliding_window", None))
    return tuple(out)


@pytest.mark.parametrize("family,overrides", [
    ("mistral", dict(sliding_window=WINDOW)),
    ("mistral", dict(sliding_window=None)),
    ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, num_hidden_layers=3)),
    ("qwen2", dict(use_sliding_window=False, sliding_window=WINDOW, max_window_layers=1)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, num_hidden_layers=4,
                   layer_types=["sliding_attention", "full_attention"] * 2)),
    ("qwen3", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    ("qwen2_moe", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3, num_hidden_layers=4)),
    ("qwen3_moe", dict(use_sliding_window=True, sliding_window=WINDOW)),
])
def test_layer_windows_as_transformers_builds_them(family, overrides):
    from parallm.families import spec_from_config
    config = helpers.tiny_config(family, **overrides)
    spec, _ = spec_from_config(config)
    want = _hf_windows(config)
    want = () if all(w is None or w == 0 for w in want) else tuple(w or None for w in want)
    assert spec.layer_windows == want, (spec.layer_windows, want)
    # the same from the config.json dict transformers writes, and without its layer_types (a 4.x config.json:
    # the family's own rule must rebuild them)
    raw = config.to_dict()
    assert spec_from_config(raw)[0].layer_windows == want
    if "layer_types" not in overrides:
        raw.pop("layer_types", None)
        assert spec_from_config(raw)[0].layer_windows == want


def test_layer_windows_from_4x_dicts_and_errors():
    from parallm.families import spec_from_config
    base = helpers.tiny_config("qwen2").to_dict()
    base.pop("layer_types", None)
    # a 4.x Qwen2 config keeps sliding_window whatever use_sliding_window says: no window unless switched on
    off = dict(base, use_sliding_window=False, sliding_window=4096, max_window_layers=1)
    assert spec_from_config(off)[0].layer_windows == ()
    on = dict(base, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert spec_from_config(on)[0].layer_windows == (None, 16)
    with pytest.raises(ValueError, match="sliding_attention but sets no sliding_window"):
        spec_from_config(dict(base, use_sliding_window=False, sliding_window=None,
                              layer_types=["full_attention", "sliding_attention"]))
    with pytest.raises(ValueError, match="layer_types"):
        spec_from_config(dict(on, layer_types=["sliding_attention"]))


# -- the pieces, without a process group ------------------------------------------------------------------------

def _batch(seed=0, b=5, s=3 * WINDOW + 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 50, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[1, :6] = 0                       # left padding
    mask[2, s - 9:] = 0                   # right padding
    mask[3, 0] = 0
    mask[3, -2:] = 0                      # both sides
    mask[4] = 0
    mask[4, 3:3 + WINDOW - 2] = 1         # shorter than the window
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, pos, mask


def _window_reference(q, k, v, mask, window):
    """Sliding-window causal attention over each row's real tokens (contiguous here): q, k, v [B, S, h, d]."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        idx = mask[b].nonzero().squeeze(-1)
        if len(idx):
            n = len(idx)
            i = torch.arange(n)
            band = (i[:, None] >= i[None]) & (i[:, None] - i[None] < (window or n + 1))
            o = torch.nn.functional.scaled_dot_product_attention(
                *(t[b, idx].transpose(0, 1)[None] for t in (q, k, v)), attn_mask=band, enable_gqa=True)
            out[b, idx] = o[0].transpose(0, 1)
    return out


@pytest.fixture
def emulated_cuda(monkeypatch):
    """CUDA_BLOCK with aten's flash op emulated (``cuda_flash_usable`` forced true on CPU fp32 tensors)."""
    from parallm.model.layers import blocks as attention
    fwd, bwd = emulated_flash()
    monkeypatch.setattr(attention, "flash_forward", fwd)
    monkeypatch.setattr(attention, "flash_backward", bwd)
    monkeypatch.setattr(attention, "cuda_flash_usable", lambda q: True)
    return attention.CUDA_BLOCK


def _kernels(emulated_cuda):
    from parallm.model.layers.blocks import CPU_FLASH_BLOCK, MATH_BLOCK
    return {"math": MATH_BLOCK, "cpu-flash": CPU_FLASH_BLOCK, "cuda-emulated": emulated_cuda}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_context_parallel_pieces_within_the_window(cp, packed, emulated_cuda):
    """Every rank's chunks through the all-gather pieces and through the ring's pieces (block by block, merged
    by log-sum-exp), with each kernel: equal to sliding-window attention over the real tokens (windows 1, 3, 8,
    and none), gradients of q, k, v too (all-gather pieces through autograd; the ring's through the kernels'
    backward with the final output and lse)."""
    from parallm.model.layers.blocks import merge_rows
    from parallm.model.context_parallel import attend_pieces, ring_plan, split_batch
    ids, pos, mask = _batch()
    b, s = ids.shape
    hq, hkv, d = 4, 2, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for h in (hq, hkv, hkv))
    go = torch.randn(b, s, hq, d, generator=g)
    real = mask.bool()
    for window in (1, 3, WINDOW, None):
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref = _window_reference(qr, kr, vr, real, window)
        (ref * go * real[..., None, None]).sum().backward()
        splits = [split_batch(ids, pos, mask, cp=cp, rank=r, packed=packed, multiple=2 if packed else 1)
                  for r in range(cp)]
        origin = splits[0].origin
        kept = origin[origin >= 0]
        for name, kernel in _kernels(emulated_cuda).items():
            qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
            kv = torch.cat([torch.cat([local_slots(ks, sp), local_slots(vs, sp)], dim=2) for sp in splits])
            got = torch.cat([attend_pieces(local_slots(qs, sp), kv, sp, kernel, window=window).reshape(-1, hq, d)
                             for sp in splits])
            full = torch.zeros(b * s, hq, d).index_put((kept,), got[origin >= 0])
            err = (full.view(b, s, hq, d) - ref)[real].abs().max().item()
            assert err < 1e-5, (name, window, err)
            (full.view(b, s, hq, d) * go * real[..., None, None]).sum().backward()
            for t, r in ((qs, qr), (ks, kr), (vs, vr)):
                e = (t.grad - r.grad)[real].abs().max().item()
                assert e < 1e-5, (name, window, "grad", e)
            # the ring's pieces, block by block, forward and backward (each key block's gradient summed over the
            # ranks whose queries see it, as the ring carries it back to its owner)
            dks = [torch.zeros(sp.slots, hkv, d) for sp in splits]
            dvs = [torch.zeros(sp.slots, hkv, d) for sp in splits]
            for sp in splits:
                qf = local_slots(q, sp).reshape(-1, hq, d)
                acc = torch.zeros(qf.shape)
                lse = torch.full(qf.shape[:2], float("-inf"))
                blocks = [(local_slots(k, splits[src]).reshape(-1, hkv, d), local_slots(v, splits[src]).reshape(-1, hkv, d))
                          for src in range(cp)]
                for src in range(cp):
                    plan = ring_plan(sp, src, window)
                    if plan.pieces:
                        merge_rows(acc, lse, *kernel.attend(qf, *blocks[src], plan, d ** -0.5))
                mine = sp.origin[sp.rank * sp.slots:(sp.rank + 1) * sp.slots]
                ok = mine >= 0
                err = (acc[ok] - ref.detach().reshape(b * s, hq, d)[mine[ok]]).abs().max().item()
                assert err < 1e-5, (name, window, "ring", err)
                gq = local_slots(go * real[..., None, None], sp).reshape(-1, hq, d)
                dq = torch.zeros(qf.shape)
                for src in range(cp):
                    plan = ring_plan(sp, src, window)
                    if plan.pieces:
                        kernel.attend_backward(qf, *blocks[src], acc, lse, gq, plan, d ** -0.5, dq, dks[src],
                                               dvs[src])
                err = (dq[ok] - qr.grad.reshape(b * s, hq, d)[mine[ok]]).abs().max().item()
                assert err < 1e-5, (name, window, "ring dq", err)
            for src, sp in enumerate(splits):
                mine = sp.origin[src * sp.slots:(src + 1) * sp.slots]
                ok = mine >= 0
                for got_d, r in ((dks[src], kr), (dvs[src], vr)):
                    err = (got_d[ok] - r.grad.reshape(b * s, hkv, d)[mine[ok]]).abs().max().item()
                    assert err < 1e-5, (name, window, "ring dk/dv", err)


def test_pieces_outside_the_window_are_dropped_and_tiles_stay_small():
    """At cp4 with a window shorter than a chunk, a chunk's pieces against chunks wholly outside the window are
    not in the plan; the tiles of a long packed sequence cover a band about the window wide (never S^2)."""
    from parallm.model.layers.attention import make_packing
    from parallm.model.context_parallel import ring_plan, split_batch
    s = 12 * WINDOW
    ids = torch.arange(s)[None] % 50
    mask = torch.ones_like(ids)
    pos = mask.cumsum(-1) - 1
    sp = split_batch(ids, pos, mask, cp=4, rank=3, packed=False)           # chunks 3 and 4 of 8, c = 12
    full = sp.plan(None)
    win = sp.plan(WINDOW)
    assert [p.k1 - p.k0 for p in full.pieces] == [48, 60]                   # chunk j: the (j + 1) c keys to it
    assert [p.k1 - p.k0 for p in win.pieces] == [12 + WINDOW - 1] * 2       # only the window's keys
    assert [bool(ring_plan(sp, src, WINDOW).pieces) for src in range(4)] == [False, False, True, True]
    assert all(ring_plan(sp, src, None).pieces for src in range(4))
    packing = make_packing(torch.ones(1, s, dtype=torch.long))
    tiles = packing.window_plan(WINDOW).tiles("cpu")
    area = band = 0
    for g, masked in tiles.groups(1):
        qi, ki, mask, _ = tiles.build(g, masked)
        area += qi.numel() * tiles.size
        band += int((mask == 0).sum()) if masked else int((qi >= 0).sum()) * tiles.size
    assert band == sum(min(i + 1, WINDOW) for i in range(s))              # exactly the window's pairs
    assert area <= 3 * WINDOW * s < s * s // 2, (area, s)


def test_packed_window_plan_matches_masked_attention(emulated_cuda):
    """The packed path's windowed attention (sdpa_loop_varlen with a window, every document in one plan) equal to
    per-document masked SDPA, with gradients, for each kernel; the plain loop below the window."""
    from parallm.model.layers.attention import make_packing, sdpa_loop_varlen
    from parallm.model.layers.blocks import attend_plan
    lengths = [5 * WINDOW + 3, 2, WINDOW, WINDOW + 1, 17]
    s = max(lengths)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    packing = make_packing(mask, multiple=4)
    t = packing.total
    hq, hkv, d = 4, 1, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    go = torch.randn(t, hq, d, generator=g)
    real = torch.arange(t) < packing.nnz
    bounds = packing.cu_seqlens.tolist()
    for window in (1, 5, WINDOW):
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = torch.cat([_window_reference(*(x[a:b][None] for x in (qr, kr, vr)), torch.ones(1, b - a,
                                                                                             dtype=torch.bool),
                                           window)[0] for a, b in zip(bounds[:-1], bounds[1:])])
        (ref * go * real[:, None, None]).sum().backward()
        for name, kernel in list(_kernels(emulated_cuda).items()) + [("default", None)]:
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            got = (sdpa_loop_varlen(*xs, packing, window=window) if kernel is None
                   else attend_plan(*xs, packing.window_plan(window), kernel))
            assert (got - ref)[real].abs().max() < 1e-5, (name, window)
            (got * go * real[:, None, None]).sum().backward()
            for x, r in zip(xs, (qr, kr, vr)):
                assert (x.grad - r.grad).abs().max() < 1e-5, (name, window)
    # windows no shorter than the longest document: the per-document loop, unchanged
    same = sdpa_loop_varlen(q, k, v, packing, window=s)
    assert torch.equal(same, sdpa_loop_varlen(q, k, v, packing))


def test_padded_window_mask():
    """The padded path's band: query i sees keys i - w < j <= i by index in the row (transformers' overlay)."""
    from parallm.model.layers.attention import padded_attention, window_band
    band = window_band(6, 3)
    want = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0],
                         [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(band, want)
    from transformers.masking_utils import sliding_window_causal_mask_function
    fn = sliding_window_causal_mask_function(3)
    i = torch.arange(6)
    assert torch.equal(band, fn(torch.tensor(0), torch.tensor(0), i[:, None], i[None]).expand(6, 6))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 4, generator=g) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=want)
    assert torch.allclose(padded_attention(q, k, v, None, window=3), ref, atol=1e-6)
    assert torch.equal(padded_attention(q, k, v, None, window=6), padded_attention(q, k, v, None))


# -- kernel calls do not grow with the documents ----------------------------------------------------------------

def _counting(kernel):
    from parallm.model.layers.blocks import BlockKernel
    calls = {"forward": 0, "backward": 0}

    def fwd(*a, **kw):
        calls["forward"] += 1
        return kernel.forward(*a, **kw)

    def bwd(*a, **kw):
        calls["backward"] += 1
        return kernel.backward(*a, **kw)

    return BlockKernel("counting", fwd, bwd), calls


@pytest.mark.parametrize("window", [None, 5])
def test_kernel_calls_per_layer_do_not_grow_with_documents(window):
    """A packed batch of 4 and of 64 documents (the same 512 tokens) at cp2: the all-gather attention of one
    layer makes at most two forward and two backward kernel calls (tiles that see every pair, banded tiles), the
    ring as many per step, whatever the number of documents (the per-document loop made four per document)."""
    from parallm.model.layers.blocks import CPU_FLASH_BLOCK, merge_rows
    from parallm.model.context_parallel import attend_pieces, ring_plan, split_batch
    counts = {}
    for docs in (4, 64):
        n = 512 // docs
        mask = torch.ones(docs, n, dtype=torch.long)
        ids = torch.arange(docs * n).view(docs, n) % 50
        pos = mask.cumsum(-1) - 1
        kernel, calls = _counting(CPU_FLASH_BLOCK)
        ring = {"forward": 0, "backward": 0}
        for rank in range(2):
            sp = split_batch(ids, pos, mask, cp=2, rank=rank, packed=True)
            hq, hkv, d = 4, 2, 8
            g = torch.Generator().manual_seed(rank)
            q = torch.randn(sp.rows, 1, hq, d, generator=g, requires_grad=True)
            kv = torch.randn(2 * sp.rows, 1, 2 * hkv, d, generator=g, requires_grad=True)
            attend_pieces(q, kv, sp, kernel, window=window).sum().backward()
            rk, rcalls = _counting(CPU_FLASH_BLOCK)
            qf = q.detach().reshape(-1, hq, d)
            acc, lse = torch.zeros(qf.shape), torch.full(qf.shape[:2], float("-inf"))
            for src in range(2):
                plan = ring_plan(sp, src, window)
                merge_rows(acc, lse, *rk.attend(qf, qf[:, :hkv], qf[:, :hkv], plan, d ** -0.5))
                rk.attend_backward(qf, qf[:, :hkv], qf[:, :hkv], acc, lse, qf, plan, d ** -0.5, torch.zeros(qf.shape),
                                   torch.zeros(qf[:, :hkv].shape), torch.zeros(qf[:, :hkv].shape))
            for key in ring:
                ring[key] += rcalls[key]
        counts[docs] = (dict(calls), ring)
    # at most two of each (tiles that see every pair, banded tiles) per attention call, whatever the documents:
    # 2 ranks, 2 ring steps each
    for docs, (allgather, ring) in counts.items():
        assert all(n <= 2 * 2 for n in allgather.values()) and all(n <= 2 * 2 * 2 for n in ring.values()), counts


# -- the CUDA kernel's choice -----------------------------------------------------------------------------------

def test_block_kernel_choice_by_device():
    """CUDA devices however named (index 0 included) get the CUDA kernel, CPU the fused CPU one, others the
    explicit fp32 one; a backend's own block kernel wins."""
    from parallm.model.layers.attention import BACKENDS, AttnBackend
    from parallm.model.layers.blocks import CPU_FLASH_BLOCK, CUDA_BLOCK, MATH_BLOCK, block_kernel
    for device in (torch.device("cuda", 0), torch.device("cuda", 1), "cuda:0", "cuda", 0, 3):
        assert block_kernel(None, device) is CUDA_BLOCK, device
        assert block_kernel(BACKENDS["sdpa"], device) is CUDA_BLOCK
    for device in ("cpu", torch.device("cpu")):
        assert block_kernel(None, device) is CPU_FLASH_BLOCK
    assert block_kernel(None, "meta") is MATH_BLOCK
    own = AttnBackend("own", packed=True, fn=None, block=MATH_BLOCK)
    assert block_kernel(own, torch.device("cuda", 0)) is MATH_BLOCK


def test_cuda_kernel_groups_pieces_by_what_flash_can_mask():
    """The CUDA kernel's split of a plan: pieces whose band flash-attention expresses (bottom-right causal edge,
    or every key visible) in at most one call per kind, the rest (another rank's chunk cut by the window)
    through the fp32 tiles; fp32 tensors never reach flash (checked without the emulation)."""
    from parallm.model.layers import blocks as attention
    from parallm.model.context_parallel import ring_plan, split_batch
    ids = torch.arange(64)[None] % 50
    mask = torch.ones_like(ids)
    sp = split_batch(ids, mask.cumsum(-1) - 1, mask, cp=2, rank=0, packed=False)
    for window in (None, 5):     # a chunk's keys before it and its diagonal: one piece, causal at the corner
        groups, rest = attention._flash_split(sp.plan(window), "cpu")
        assert [g.causal for g in groups] == [True] and not rest.pieces
        assert groups[0].cu_q.numel() == 3                                    # both chunks in one call
    groups, rest = attention._flash_split(ring_plan(sp, 1, 5), "cpu")
    assert rest.pieces                                                        # a window cut across chunks
    assert not attention.cuda_flash_usable(torch.zeros(2, 2, 8))              # CPU tensors


# -- against transformers ---------------------------------------------------------------------------------------

MODELS = {
    # name: (family, config overrides)
    "mistral": ("mistral", dict(sliding_window=WINDOW, max_position_embeddings=128)),
    "qwen2": ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                            num_hidden_layers=4, max_position_embeddings=128)),
}

LAYOUTS = [
    ("mistral", dict(tp=2)),
    ("mistral", dict(tp=2, sequence_parallel=True)),
    ("mistral", dict(cp=2, packed=True, cp_attn="allgather")),
    ("mistral", dict(cp=2, cp_attn="ring")),
    ("mistral", dict(cp=4, packed=True, cp_attn="ring")),
    ("mistral", dict(pp=2, microbatches=2)),
    ("qwen2", dict(tp=2)),
    ("qwen2", dict(tp=2, sequence_parallel=True)),
    ("qwen2", dict(cp=2, cp_attn="allgather")),
    ("qwen2", dict(cp=2, packed=True, cp_attn="ring")),
    ("qwen2", dict(pp=2, microbatches=2)),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("window")
    out = {}
    for i, (name, (family, overrides)) in enumerate(MODELS.items()):
        config = helpers.tiny_config(family, **overrides)
        model = helpers.make_hf_model(config, seed=70 + i)
        out[name] = dict(path=helpers.save_checkpoint(model, str(root / name)), model=model, config=config)
    out["root"] = str(root)
    return out


def test_transformers_reference_uses_the_window(models):
    """The check below means something: transformers' output with the window differs from the same weights
    without it past the window, and equals it up to the window."""
    import copy
    ids, mask = helpers.padded_batch(99, batch=2, seq=SEQ, seed=3)
    mask[:] = 1
    for name in MODELS:
        model = models[name]["model"]
        config = copy.deepcopy(models[name]["config"])
        config.sliding_window = None
        config.layer_types = ["full_attention"] * config.num_hidden_layers
        plain = type(model)(config).float().eval()
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            a, b = model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits
        assert (a[:, :WINDOW] - b[:, :WINDOW]).abs().max() < 1e-5
        assert (a[:, WINDOW:] - b[:, WINDOW:]).abs().max() > 1e-2


def _parity_rank(rank, world, checks):
    return [verify.check_layout(check) for check in checks]


@pytest.mark.timeout(500)
def test_against_transformers(models):
    checks = [verify.Check(models[name]["path"], f"{models['root']}/saved-{i}", seq=SEQ, seed=i, label=name, **kw)
              for i, (name, kw) in enumerate(LAYOUTS)]
    rows = helpers.run_ranks(_parity_rank, 4, checks, timeout=500)[0]
    print(verify.results_table(rows))
    bad = [f"{r['layout']} {r['model']}: {r}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_holes_refused_where_the_window_counts_real_tokens(world_of_one, models):
    """A row with padding between real tokens spanning more than the window: refused by a packed model (which
    counts the window over real tokens), run by a padded one exactly as transformers (positions in the row)."""
    import parallm
    ckpt = models["mistral"]["path"]
    ids, mask = helpers.padded_batch(99, batch=2, seq=2 * WINDOW, seed=5)
    mask[:] = 1
    mask[0, 3] = 0
    padded = parallm.build_model(ckpt)
    parallm.load_hf_weights(padded, ckpt)
    with torch.no_grad():
        got = parallm.forward(padded, ids, mask)
        want = verify.hf_output(models["mistral"]["model"], ids, mask)
    assert (got - want)[mask.bool()].abs().max() < 1e-4
    packed = parallm.build_model(ckpt, packed=True)
    parallm.load_hf_weights(packed, ckpt)
    with pytest.raises(ValueError, match=r"row 0 .*padding between its real tokens.*sliding window of 8"):
        parallm.forward(packed, ids, mask)
    short = mask.clone()
    short[:, WINDOW - 2:] = 0                    # the same hole within a row no longer than the window: fine
    with torch.no_grad():
        got = parallm.forward(packed, ids, short)
        want = verify.hf_output(models["mistral"]["model"], ids, short)
    assert (got - want)[short.bool()].abs().max() < 1e-4
    assert math.isfinite(float(got.abs().max()))


def _largest_tensor_during(fn):
    """(fn's result, the largest number of elements of any tensor an op made while ``fn`` ran, backward included
    when ``fn`` runs it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    with Largest():
        result = fn()
    return result, Largest.most


def _padded_window_case(pad: str, s: int, w: int = 16):
    """Output and gradients of one windowed padded attention (``PaddedRows`` or, ``pad == "none"``, no mask)
    against SDPA over the padded mask and transformers' band (real queries), and the largest tensor made."""
    from parallm.model.layers.attention import PaddedRows, padded_attention, padded_attention_mask, window_band
    b, hq, hkv, d = 2, 4, 2, 8
    keep = torch.ones(b, s, dtype=torch.bool)
    if pad == "left":
        keep[0, :s // 3] = False
    elif pad == "right":
        keep[1, s - s // 4:] = False
    elif pad == "hole":
        keep[0, :5] = False
        keep[1, 40:47] = False                  # a hole shorter than the window: keys on both sides visible
        keep[1, 60:60 + w + 3] = False          # and one longer: the run after it sees nothing before it
    g = torch.Generator().manual_seed(0)
    q0 = torch.randn(b, hq, s, d, generator=g)
    k0, v0 = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    go = torch.randn(b, hq, s, d, generator=g)
    real = keep[:, None, :, None]

    def run(ctx):
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = padded_attention(q, k, v, ctx, window=w)
        (out * go * real).sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    ref = run(padded_attention_mask(keep) & window_band(s, w))
    got, largest = _largest_tensor_during(lambda: run(None if pad == "none" else PaddedRows(keep)))
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        a, r = (a * real, r * real) if name in ("out", "dq") else (a, r)
        assert (a - r).abs().max() < 1e-5, (pad, s, name, (a - r).abs().max())
    return largest


@pytest.mark.parametrize("pad", ["none", "left", "right", "hole"])
def test_padded_window_memory_linear_in_s(pad):
    """A padded batch longer than the window: the windowed layer's output and gradients equal SDPA's over the
    padded mask and transformers' band (real queries: left / right padding, holes shorter and longer than the
    window), and the largest tensor any op makes grows linearly with S (4x the tokens: at most ~4x; the old path
    built an [S, S] int64 band and a [B, 1, S, S] mask per layer call: 16x)."""
    small, large = _padded_window_case(pad, 128), _padded_window_case(pad, 512)
    assert large <= 4.5 * small, (small, large)
