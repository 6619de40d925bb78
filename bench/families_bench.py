"""Gemma-4-shaped and Kimi-K2.5-shaped training steps and an INT4 Kimi load (issue 57's benchmark): parallm against
transformers. Not part of the test suite.

    python bench/families_bench.py                       # all three parts (about 10-15 min on one thread)
    python bench/families_bench.py --parts gemma4 kimi   # the steps only; --parts int4: the load only
    python bench/families_bench.py --ct-path /tmp/ct     # the INT4 reference through compressed-tensors (below)
    python bench/families_bench.py --quick               # tiny shapes: checks that the script runs, measures nothing

Steps (batch 2 x 1024, fp32, one thread, tp = pp = ep = 1): parallm.forward_backward against transformers'
forward + loss + backward on the same weights and batch, timed in interleaved rounds (best of ``--iters``, wall
and process CPU time) after one warm-up each, in one process per model; each side's peak anonymous RSS during a
step above its level before it in a second process (started with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 1 MiB, so
that memory a step frees goes back to the system). Targets (issue 57): time <= 1.0x, memory <= 1.0x.

* Gemma 4 (``Gemma4ForCausalLM``): Gemma-4-31B's released text shape (hidden 5376, 60 layers, 32 heads; sliding
  layers: head dim 256 over 16 KV heads, window 1024; full layers (every sixth): their own head dim
  ``global_head_dim`` 512 over ``num_global_key_value_heads`` 4 with K = V (``attention_k_eq_v``: no v_proj, the
  values are the keys' projection), proportional RoPE at 0.25; MLP 21504, soft-cap 30, vocab 262144, tied; no
  per-layer input embeddings (``hidden_size_per_layer_input`` 0), no KV sharing, no MoE block: those are the E2B /
  E4B and 26B-A4B checkpoints') scaled: hidden 1024, 8 heads, sliding head dim 256 over 4 KV heads, window 512;
  full: head dim 512 over 1 KV head, K = V; MLP 4096, 6 layers (5 sliding, 1 full), soft-cap 30, vocab 16384,
  tied. transformers: sdpa (its sliding layers attend through a [S, S] mask: every key computed, the window masked;
  parallm's attend only the tiles the window reaches).
* Kimi-K2.5 (``KimiK25ForConditionalGeneration`` over a DeepSeek-V3 text model): Kimi-K2's text shape (hidden
  7168, 64 MLA heads, q_lora 1536, kv_lora 512, nope 128 + rope 64, v 128, 384 experts top-8 of 2048 + 1 shared,
  first layer dense, sigmoid routing with a correction bias, scale 2.827, vocab 163840) scaled: hidden 1024, 8
  heads (head dims and kv_lora kept), q_lora 256, 64 experts top-8 of 256 + 1 shared, 4 layers (1 dense of 2560),
  vocab 16384; a 2-layer vision tower carried. Both sides load the same wrapper checkpoint: parallm its INT4 form,
  transformers the dequantised one (equal weights); transformers: sdpa. Text only (no image in the batch).

INT4 load: the Kimi checkpoint with every routed expert in compressed-tensors' ``pack-quantized`` INT4 (Kimi's
scheme: symmetric, group 32, bf16 scales, ``quantization_config`` in ``text_config``), everything else bf16, in
~200 MB shards; parallm's ``build_model`` + ``load_hf_weights`` of it (experts dequantised on load, bit-identical
to compressed-tensors' ``dequantize``) against transformers' loads. transformers reads such a checkpoint only
through the ``compressed-tensors`` package, which is not in .venv (not a parallm dependency;
tests/test_kimi_k25_parts.py skips its comparison with it). With ``--ct-path DIR`` (or compressed-tensors
importable; checked 2026-12-07 with compressed-tensors 0.20.0 put in a folder by ``pip install --target DIR
--no-deps compressed-tensors==0.20.0 loguru``, pydantic from .venv) the references are transformers'
``from_pretrained`` of the INT4 directory. What that load ends with (checked, and printed by each run: every kept
tensor counted by kind and dtype): the routed experts **dequantised** (transformers 5.25 fuses them into
``gate_up_proj`` / ``down_proj`` parameters, which are not ``nn.Linear`` modules, so its
``CompressedTensorsDequantize`` load operation decompresses them whatever ``dequantize`` / ``run_compressed`` says:
nothing stays ``weight_packed``, and ``CompressedTensorsConfig(dequantize=True)`` loads the same), but held in
the scales' dtype (bf16) even when ``dtype=float32`` is asked; everything else in the asked dtype. So there is no
packed (compressed) load of these experts to compare with. The sides (:data:`LOADS`):

* ``parallm`` (fp32) against ``transformers-int4-fp32``: transformers' INT4 load then its bf16 experts cast to fp32
  (``nn.Module.float``; transformers refuses ``model.float()`` on a quantized model): the same end state, every
  weight fp32, the experts' values equal. A target row.
* ``parallm-bf16`` against ``transformers-int4-bf16`` (``dtype=bfloat16``): the same end state, all bf16. A target
  row. (transformers' bf16 load maps the checkpoint's bf16 tensors without copying them, so its peak RSS is
  below the model's size.)
* ``parallm`` against ``transformers-int4`` as it ends (experts bf16, half the bytes of parallm's fp32 ones):
  reported.
* without compressed-tensors, a two-part stand-in (the target row then): ``transformers``, ``from_pretrained`` of
  the dequantised checkpoint (no dequantisation work: a lower bound), plus ``dequantise``, the dequantisation by
  the definition in torch from the INT4 files.

Each load runs in a fresh process (a first load untimed: imports, lazily imported modules, page cache; the second
measured), the sides interleaved, best of ``--iters`` processes (wall; CPU time, all threads of the process, the
figure to read on a loaded machine), with the measured load's peak anonymous RSS above its level before the load
(glibc's mmap threshold at 1 MiB, as for the steps).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import PeakRss, free_port, rss_anon, table, write_shards  # noqa: E402

GEMMA4 = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=6, num_attention_heads=8,
              num_key_value_heads=4, head_dim=256, global_head_dim=512, num_global_key_value_heads=1,
              attention_k_eq_v=True, sliding_window=512, vocab_size=16384, final_logit_softcapping=30.0,
              hidden_size_per_layer_input=0, num_kv_shared_layers=0)
GEMMA4_QUICK = dict(GEMMA4, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=32, global_head_dim=64, sliding_window=16, vocab_size=256)
KIMI = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=8,
            moe_intermediate_size=256, n_shared_experts=1, intermediate_size=2560, num_hidden_layers=4,
            first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, vocab_size=16384)
KIMI_QUICK = dict(KIMI, hidden_size=64, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=32,
                  kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=96, num_hidden_layers=2,
                  vocab_size=256)
VISION = dict(patch_size=14, pos_emb_height=16, pos_emb_width=16, pos_emb_time=4, num_attention_heads=4,
              num_hidden_layers=2, hidden_size=256, intermediate_size=1024, merge_kernel_size=[2, 2])
GROUP = 32
EXPERT = re.compile(r".*\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight$")
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
          "re:vision_tower.*", "re:mm_projector.*", "re:.*vision_tower.*", "re:.*mm_projector.*"]
# the last two: transformers' module names of the tower (model.vision_tower...), which compressed-tensors matches
# the ignore list against; without them it replaces the tower's Linears by quantized ones and loads them random


# -- compressed-tensors pack-quantized INT4 (symmetric), from its definition --------------------------------------

def quantize(w):
    """``w [rows, cols]`` -> (int32 ``[rows, cols / 8]`` words: value j of each 8 at bits 4j as ``value + 8``;
    bf16 scales ``[rows, cols / GROUP]`` = amax / 7)."""
    import torch
    rows, cols = w.shape
    g = w.float().reshape(rows, cols // GROUP, GROUP)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-6).to(torch.bfloat16)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).reshape(rows, cols).to(torch.int64) + 8
    words = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(8):
        words |= q[:, j::8] << (4 * j)
    return ((words + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32), scale


def dequantize(words, scale, shape):
    """The inverse: ``(value) * scale`` in bf16, per compressed-tensors' ``dequantize``."""
    import torch
    rows, cols = shape
    w = words.to(torch.int64) & 0xFFFFFFFF
    q = torch.empty(rows, words.shape[1] * 8, dtype=torch.int64)
    for j in range(8):
        q[:, j::8] = ((w >> (4 * j)) & 0xF) - 8
    return q[:, :cols].to(torch.bfloat16) * scale.repeat_interleave(GROUP, 1)


def kimi_checkpoints(shapes: dict, root: str) -> tuple[str, str]:
    """(INT4 dir, dequantised dir) of one seeded Kimi-K2.5 wrapper: transformers' DeepseekV3 init (the
    selection bias made random), the tower random, bf16 everywhere; the INT4 dir's experts pack-quantized, the
    dequantised dir's experts their dequantisation (so both dirs hold the same weights)."""
    import torch
    import transformers
    from safetensors.torch import load_file

    from parallm.families.kimi_k25 import vision_tensors
    cfg = transformers.DeepseekV3Config(**shapes, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    hub = os.path.join(root, "hub")
    model.save_pretrained(hub)
    del model
    state = {}
    for f in sorted(os.listdir(hub)):
        if f.endswith(".safetensors"):
            state.update({"language_model." + k: v for k, v in load_file(os.path.join(hub, f)).items()})
    text = dict(cfg.to_dict(), model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], torch_dtype="bfloat16")
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "text_config": text,
              "vision_config": VISION, "projection_hidden_size": VISION["hidden_size"], "tie_word_embeddings": False,
              "torch_dtype": "bfloat16"}
    state.update({k: 0.02 * torch.randn(s, generator=g) for k, s in vision_tensors(config, cfg.hidden_size)})
    quantized, deq = [], []
    for name, t in state.items():
        t = t.to(torch.bfloat16)
        if EXPERT.match(name):
            words, scale = quantize(t)
            stem = name[:-len("weight")]
            quantized += [(stem + "weight_packed", words), (stem + "weight_scale", scale),
                          (stem + "weight_shape", torch.tensor(list(t.shape), dtype=torch.int64))]
            deq.append((name, dequantize(words, scale, t.shape)))
        else:
            quantized.append((name, t))
            deq.append((name, t))
    qconfig = json.loads(json.dumps(config))
    qconfig["text_config"]["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                  "group_size": GROUP, "symmetric": True, "dynamic": False,
                                                  "actorder": None}}},
        "ignore": IGNORE, "kv_cache_scheme": None}
    dirs = []
    for sub, tensors, conf in (("int4", quantized, qconfig), ("deq", deq, config)):
        path = os.path.join(root, sub)
        os.makedirs(path)
        write_shards(path, tensors, 200 * 2**20)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(conf, f)
        dirs.append(path)
    return dirs[0], dirs[1]


# -- the steps ------------------------------------------------------------------------------------------------------

def ce_loss(logits, ids, mask):
    lp = logits[:, :-1].float().log_softmax(-1)
    m = (mask[:, 1:] * mask[:, :-1]).float()
    nll = -lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return (nll * m).sum() / m.sum()


def step_pair(model: str, args):
    """(hf_step, pl_step, description) of one model: both sides built in this process from the same weights."""
    import torch
    import transformers

    import parallm
    torch.manual_seed(0)
    if model == "gemma4":
        shapes = GEMMA4_QUICK if args.quick else GEMMA4
        n = shapes["num_hidden_layers"]
        cfg = transformers.Gemma4TextConfig(
            **shapes, layer_types=["sliding_attention"] * (n - 1) + ["full_attention"],
            rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            bos_token_id=None, eos_token_id=None, max_position_embeddings=4096, attn_implementation="sdpa")
        hf = transformers.Gemma4ForCausalLM(cfg).float()
        ckpt = tempfile.mkdtemp(prefix="families-bench-gemma4-")
        hf.save_pretrained(ckpt)
        pl_ckpt = ckpt
    else:
        root = tempfile.mkdtemp(prefix="families-bench-kimi-")
        pl_ckpt, ckpt = kimi_checkpoints(KIMI_QUICK if args.quick else KIMI, root)
        hf = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(ckpt, attn_implementation="sdpa",
                                                                            dtype=torch.float32)
    hf.train()
    parallm.init_parallel(tp=1)
    chunks = parallm.build_model(pl_ckpt)
    parallm.load_hf_weights(chunks, pl_ckpt)
    vocab = hf.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq, dtype=torch.long)
    pos = parallm.default_position_ids(mask)
    losses = {"transformers": [], "parallm": []}

    def hf_step():
        hf.zero_grad(set_to_none=True)
        loss = ce_loss(hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits, ids, mask)
        loss.backward()
        losses["transformers"].append(float(loss.detach()))

    def pl_step():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        losses["parallm"].append(float(parallm.forward_backward(chunks, ids, mask, loss_fn=ce_loss)))

    return hf_step, pl_step, losses, chunks, (ckpt if model == "gemma4" else root)


def run_steps(model: str, args) -> dict:
    """In this process: the interleaved timing, or (``--memory-only``) each side's peak of one step."""
    from moe_bench import interleaved
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                      PARALLM_PROGRESS="0")
    import torch

    import parallm
    torch.set_num_threads(1)
    hf_step, pl_step, losses, chunks, tmp = step_pair(model, args)
    shutil.rmtree(tmp, ignore_errors=True)      # both models are in memory
    out = {}
    if args.memory_only or args.quick:
        hf_step()               # each side's gradients exist before its measured step, as in the timed rounds
        pl_step()
        peaks = {}
        for name, fn in (("transformers", hf_step), ("parallm", pl_step)):
            before = rss_anon()
            with PeakRss() as peak:
                fn()
            peaks[name] = (peak.peak - before) / 2**20
        out["peaks"] = peaks
    if not args.memory_only:
        (t_pl, t_hf), (c_pl, c_hf) = interleaved([pl_step, hf_step], args.iters)
        out.update(wall=[t_pl, t_hf], cpu=[c_pl, c_hf], loss=[losses["parallm"][0], losses["transformers"][0]],
                   attn=str(chunks[0].attn_impl))
    parallm.destroy_parallel()
    return out


# -- the INT4 load ----------------------------------------------------------------------------------------------

LOADS = {   # side -> (checkpoint, what it does); each ends with every weight in memory (the end states below)
    "parallm": ("int4", "parallm build_model + load_hf_weights, fp32: every weight fp32, experts dequantised"),
    "parallm-bf16": ("int4", "the same in bf16 (build_model dtype=bf16)"),
    "transformers-int4": ("int4", "transformers from_pretrained(dtype=fp32) through compressed-tensors: experts "
                          "dequantised but left bf16 (the scales' dtype), the rest fp32"),
    "transformers-int4-fp32": ("int4", "the same, then its bf16 experts cast to fp32 (parallm's end state)"),
    "transformers-int4-bf16": ("int4", "from_pretrained(dtype=bf16) through compressed-tensors: all bf16"),
    "transformers": ("deq", "from_pretrained(dtype=fp32) of the dequantised checkpoint (no dequantisation)"),
    "dequantise": ("int4", "the dequantisation alone, by the definition, from the INT4 files"),
}


def _loader(side: str, path: str):
    """The load function of one side (:data:`LOADS`)."""
    import torch
    if side.startswith("parallm"):
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                          PARALLM_PROGRESS="0")
        import parallm
        parallm.init_parallel(tp=1)
        dtype = torch.bfloat16 if side.endswith("bf16") else torch.float32

        def load():
            chunks = parallm.build_model(path, dtype=dtype)
            parallm.load_hf_weights(chunks, path)
            return chunks
        return load
    if side.startswith("transformers"):
        import transformers
        dtype = torch.bfloat16 if side.endswith("bf16") else torch.float32

        def load():
            model = transformers.Kimi_K25ForConditionalGeneration.from_pretrained(path, attn_implementation="sdpa",
                                                                                    dtype=dtype)
            if side.endswith("fp32"):      # transformers refuses model.float() on a quantized model
                torch.nn.Module.float(model)
            return model
        return load
    from safetensors import safe_open

    def load():
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(path, f), "pt") as st:
                    for k in st.keys():
                        if k.endswith(".weight_packed"):
                            stem = k[:-len("weight_packed")]
                            out[stem] = dequantize(st.get_tensor(k), st.get_tensor(stem + "weight_scale"),
                                                   st.get_tensor(stem + "weight_shape").tolist()).float()
        return out
    return load


def end_state(kept) -> dict:
    """What a load kept: tensors by (kind, dtype), kind ``expert`` for routed experts' weights, ``packed`` for
    tensors still pack-quantized (``weight_packed`` / int32), else ``other``."""
    import torch
    if isinstance(kept, dict):
        named = kept.items()
    else:
        modules = kept if isinstance(kept, (list, tuple)) else [kept]
        named = [(n, t) for m in modules for n, t in m.state_dict().items()]
    counts = {}
    for name, t in named:
        if not isinstance(t, torch.Tensor):     # megatron's _extra_state entries
            continue
        kind = ("packed" if "weight_packed" in name or t.dtype == torch.int32 else
                "expert" if "experts" in name and "shared" not in name and t.dim() >= 2 else "other")
        key = f"{kind} {str(t.dtype).replace('torch.', '')}"
        counts[key] = counts.get(key, 0) + t.numel()
    return counts


def run_load(side: str, path: str) -> dict:
    """Two loads in this process, the second measured (the first untimed: imports, lazily loaded modules and the
    page cache warm): wall seconds, process CPU seconds, peak RSS above the level before it, and the end state
    (:func:`end_state`)."""
    import gc

    import torch
    torch.set_num_threads(1)
    load = _loader(side, path)
    load()
    gc.collect()
    before = rss_anon()
    with PeakRss() as peak:
        t0, c0 = time.perf_counter(), time.process_time()
        kept = load()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    state = end_state(kept)
    del kept
    return {"s": seconds, "cpu": cpu, "peak_mib": (peak.peak - before) / 2**20, "state": state}


def child(args, *extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.ct_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.ct_path, env.get("PYTHONPATH")) if p)
    if "--memory-only" in extra or "--load" in extra or args.quick:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    cmd = [sys.executable, os.path.abspath(__file__), "--iters", str(args.iters), "--seq", str(args.seq),
           "--batch", str(args.batch)] + (["--quick"] if args.quick else [])
    out = subprocess.run(cmd + list(extra), env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(extra)} failed (exit {out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def steps_rows(model: str, args) -> list:
    t = child(args, "--steps", model)
    # --quick: both in that one process (to keep it short); otherwise memory in a process of its own
    m = t["peaks"] if args.quick else child(args, "--steps", model, "--memory-only")["peaks"]
    (t_pl, t_hf), (c_pl, c_hf) = t["wall"], t["cpu"]
    print(f"  {model}: parallm attention {t['attn']}; first-step loss parallm {t['loss'][0]:.6f}, transformers "
          f"{t['loss'][1]:.6f} (|diff| {abs(t['loss'][0] - t['loss'][1]):.2e})", flush=True)
    return [(f"{model} step wall", f"{t_pl:.3f} s / {t_hf:.3f} s", f"{t_pl / t_hf:.2f}", "<= 1.0"),
            (f"{model} step CPU time", f"{c_pl:.3f} s / {c_hf:.3f} s", f"{c_pl / c_hf:.2f}", ""),
            (f"{model} step peak RSS above start", f"{m['parallm']:.0f} MiB / {m['transformers']:.0f} MiB",
             f"{m['parallm'] / max(m['transformers'], 1e-9):.2f}", "<= 1.0")]


def compressed_tensors_at(ct_path: str | None) -> str | None:
    """Where the children will import compressed-tensors from (``ct_path`` first, as their PYTHONPATH), or None."""
    import importlib.machinery
    spec = importlib.machinery.PathFinder.find_spec("compressed_tensors", ([ct_path] if ct_path else []) + sys.path)
    return spec.origin if spec else None


def _ratio_rows(label: str, pl: dict, ref: dict, target: str) -> list:
    return [(f"{label}: wall", f"{pl['s']:.2f} s / {ref['s']:.2f} s", f"{pl['s'] / ref['s']:.2f}", target),
            (f"{label}: CPU time", f"{pl['cpu']:.2f} s / {ref['cpu']:.2f} s", f"{pl['cpu'] / ref['cpu']:.2f}", ""),
            (f"{label}: peak RSS", f"{pl['peak_mib']:.0f} MiB / {ref['peak_mib']:.0f} MiB",
             f"{pl['peak_mib'] / max(ref['peak_mib'], 1e-9):.2f}", "report")]


def load_rows(args) -> list:
    root = tempfile.mkdtemp(prefix="families-bench-int4-")
    dirs = dict(zip(("int4", "deq"), kimi_checkpoints(KIMI_QUICK if args.quick else KIMI, root)))
    size = {k: sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)) / 2**20 for k, d in dirs.items()}
    ct = compressed_tensors_at(args.ct_path)
    sides = [s for s in LOADS if ct or not s.startswith("transformers-int4")]
    best = {}
    for _ in range(args.iters):          # the sides interleaved, best of --iters processes each
        for side in sides:
            r = child(args, "--load", side, dirs[LOADS[side][0]])
            if side not in best or r["s"] < best[side]["s"]:
                best[side] = r
            best[side]["cpu"] = min(best[side]["cpu"], r["cpu"])
    shutil.rmtree(root, ignore_errors=True)
    print(f"  int4: checkpoint {size['int4']:.0f} MiB INT4 experts, {size['deq']:.0f} MiB dequantised; "
          f"compressed-tensors {ct or 'not importable: the reference is the two-part stand-in'}", flush=True)
    for side in sides:
        print(f"    {side}: {LOADS[side][1]}; kept {best[side]['state']}", flush=True)
    pl, hf, dq = best["parallm"], best["transformers"], best["dequantise"]
    rows = []
    if ct:
        rows += _ratio_rows("INT4 load fp32: parallm / transformers (compressed-tensors), experts then cast to "
                            "fp32 (same end state)", pl, best["transformers-int4-fp32"], "<= 1.0")
        rows += _ratio_rows("INT4 load bf16: parallm / transformers (compressed-tensors) (same end state)",
                            best["parallm-bf16"], best["transformers-int4-bf16"], "<= 1.0")
        rows += _ratio_rows("INT4 load fp32: parallm / transformers (compressed-tensors) as it ends (experts bf16)",
                            pl, best["transformers-int4"], "report")
    stand_in = dict(s=hf["s"] + dq["s"], cpu=hf["cpu"] + dq["cpu"], peak_mib=hf["peak_mib"])
    rows += _ratio_rows("INT4 load fp32: parallm / (transformers' load of the dequantised + the dequantisation)",
                        pl, stand_in, "report" if ct else "<= 1.0")[:2]
    return rows + [("INT4 load fp32: parallm / transformers' load of the dequantised alone (a lower bound)",
                    f"{pl['s']:.2f} s / {hf['s']:.2f} s", f"{pl['s'] / hf['s']:.2f}", "report")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", choices=("gemma4", "kimi", "int4"), default=["gemma4", "kimi", "int4"])
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 2 x 64: checks the script runs")
    ap.add_argument("--ct-path", help="a folder holding the compressed-tensors package (and loguru), put on the "
                    "children's PYTHONPATH: transformers' own dequantising INT4 load becomes the reference")
    ap.add_argument("--steps", choices=("gemma4", "kimi"), help=argparse.SUPPRESS)
    ap.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--load", nargs=2, metavar=("SIDE", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.quick:
        args.seq, args.iters = 64, 1
    if args.steps:
        print(json.dumps(run_steps(args.steps, args)))
        return
    if args.load:
        print(json.dumps(run_load(*args.load)))
        return
    load_before = os.getloadavg()
    rows = []
    for part in args.parts:
        rows += load_rows(args) if part == "int4" else steps_rows(part, args)
    print(f"batch {args.batch} x {args.seq}, fp32, one thread; Gemma 4 {GEMMA4_QUICK if args.quick else GEMMA4}; "
          f"Kimi text {KIMI_QUICK if args.quick else KIMI}" + ("  (--quick: not a measurement)" if args.quick else ""))
    print(table(rows, ["metric", "parallm / transformers", "ratio", "target"]))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}"
          + ("" if max(load_before[0], load_after[0]) < 2 else "  -- PROVISIONAL: machine not quiet"))


if __name__ == "__main__":
    main()
