"""bf16 parity of parallm against transformers, as a figure (not a timing; not part of the test suite).

    python bench/bf16_parity.py                       # Qwen3.5 (Gated DeltaNet hybrid), Qwen3-Next (MoE), Qwen2
    python bench/bf16_parity.py --family qwen3_5_text --tp 2

The tests compare parallm with transformers in fp32 (tight tolerances); in bf16 there is no exact reference, and
the tests' tiny random models (weights ~N(0, 0.08), norms around 1) are so badly conditioned that transformers'
own bf16 logits differ from its fp32 ones by a third of the largest logit. Here each model is transformers' own
initialisation (``initializer_range`` 0.02, norms as a real checkpoint starts) at a modest size (hidden 256,
4 layers), which keeps bf16 meaningful. Reported, per model, against transformers in fp32 (the reference) on the
same padded batch: transformers in bf16 (what bf16 costs by itself) and parallm in bf16 (at ``--tp`` ranks,
padded and packed): relative error of the logits (||x - ref|| / ||ref|| over real tokens), the largest absolute
error, and top-1 agreement. parallm in bf16 is doing as well as bf16 can when its errors are of the order of
transformers' own bf16 errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import run_world, table  # noqa: E402

SHAPES = {
    "qwen3_5_text": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, full_attention_interval=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64),
    "qwen3_next": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, full_attention_interval=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
                       linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
                       num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=256),
    "qwen2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
}


def _batch(vocab: int):
    import torch
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 96), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 70:] = 0
    mask[2, :20] = 0
    mask[3, 40:] = 0
    return ids, mask


def _parallm_logits(rank, world, ckpt, tp, packed):
    import torch

    import parallm
    parallm.init_parallel(tp=tp)
    chunks = parallm.build_model(ckpt, dtype=torch.bfloat16, packed=packed)
    parallm.load_hf_weights(chunks, ckpt)
    ids, mask = _batch(chunks[0].spec.vocab_size)
    with torch.no_grad():
        out = parallm.forward(chunks, ids, mask)
    parallm.destroy_parallel()
    return out.float()


def _errors(got, want, mask):
    real = mask.bool()
    g, w = got[real].float(), want[real].float()
    return ((g - w).norm() / w.norm()).item(), (g - w).abs().max().item(), \
        (g.argmax(-1) == w.argmax(-1)).float().mean().item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=sorted(SHAPES))
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    import transformers
    rows = []
    for family in args.family or list(SHAPES):
        cfg = transformers.AutoConfig.for_model(family, vocab_size=1000, attn_implementation="eager",
                                                tie_word_embeddings=False, **SHAPES[family])
        torch.manual_seed(0)
        hf = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
        ckpt = tempfile.mkdtemp(prefix="parallm-bf16-")
        hf.save_pretrained(ckpt)
        ids, mask = _batch(cfg.vocab_size)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            want = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
            hf_bf16 = hf.to(torch.bfloat16)(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
        scale = want[mask.bool()].abs().max().item()
        rows.append((family, "transformers bf16", *(f"{x:.2e}" for x in _errors(hf_bf16, want, mask)[:2]),
                     f"{_errors(hf_bf16, want, mask)[2]:.3f}", f"{scale:.2f}"))
        for packed in (False, True):
            got = run_world(_parallm_logits, args.tp, ckpt, args.tp, packed)[0]
            rel, worst, top1 = _errors(got, want, mask)
            rows.append((family, f"parallm bf16 tp{args.tp}{' packed' if packed else ''}", f"{rel:.2e}",
                         f"{worst:.2e}", f"{top1:.3f}", f"{scale:.2f}"))
    print("against transformers fp32 on the same padded batch (4 x 96, real tokens only)")
    print(table(rows, ["model", "run", "relative error", "max |error|", "top-1 agreement", "max |logit|"]))


if __name__ == "__main__":
    main()
