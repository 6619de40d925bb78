"""A toy task for verl's trainer on CPU: a tiny seeded Qwen2 checkpoint made from a config, a word-level tokenizer
with a chat template, GRPO prompt files in verl's parquet layout, and the rule reward verl calls.

``python -m parallm.integrations.verl.toy OUT_DIR`` writes ``OUT_DIR/model`` (``config.json``, safetensors,
``tokenizer.json``, ``tokenizer_config.json``, ``generation_config.json``) and ``OUT_DIR/data/{train,val}.parquet``.
The reward (:func:`compute_score`, given to verl as ``reward.custom_reward_function.path=<this file>``) is the
share of the response's words among the letters a-m: a random model scores about 0.4 with a spread over
samples (so GRPO's advantages are not zero from the first step), and a policy learns it by shifting probability
onto those tokens.

Nothing here imports verl: the files are what verl reads (``RLHFDataset``'s ``prompt`` / ``data_source`` /
``reward_model`` columns; the reward signature of verl's ``default_compute_score``).
"""

from __future__ import annotations

import json
import os

__all__ = ["compute_score", "write_checkpoint", "write_data", "write_toy"]

# A byte-level BPE vocabulary of 64 tokens that transformers' Qwen2Tokenizer (which transformers 5 uses for any
# model_type "qwen2" checkpoint, whatever tokenizer_class says) reads as it is: the pad and end-of-turn tokens,
# newline and space (verl's Qwen chat-boundary handling needs "\n" to be one token and "<|im_end|>" to exist),
# the letters alone and after a space ("a b c" is three tokens), and the digits 0-7. Words are single letters.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_end|>")
_LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
_TOKENS = [*SPECIAL_TOKENS, "\u010a", "\u0120", *_LETTERS, *("\u0120" + c for c in _LETTERS), *"01234567"]
_VOCAB = {t: i for i, t in enumerate(_TOKENS)}
_MERGES = [("\u0120", c) for c in _LETTERS]
VOCAB_SIZE = len(_TOKENS)
TARGET_WORDS = "abcdefghijklm"    # the reward: the share of response words among these letters
PAD_ID, EOS_ID = 0, 1


def write_checkpoint(path: str, *, vocab: int = VOCAB_SIZE, hidden: int = 128, layers: int = 2, seed: int = 0,
                     model_type: str = "qwen2") -> str:
    """A tiny seeded ``Qwen2ForCausalLM`` (head_dim 32: the smallest vLLM's CPU attention takes; untied head:
    vLLM-CPU keeps a prepacked copy of a tied head that a weight reload does not refresh) with every weight
    non-trivial (norm weights and biases drawn too, so a mapping bug cannot hide behind ones and zeros).
    ``model_type="qwen3_moe"``: a ``Qwen3MoeForCausalLM`` of the same size, 4 experts of width ``hidden / 2``,
    2 chosen per token (normalised), every layer sparse, no router auxiliary loss in the output.
    ``model_type="gpt_oss"``: a ``GptOssForCausalLM`` of the same size (attention sinks, a window of 8 tokens on
    the even layers, 4 biased experts of width ``2 * hidden``, 2 per token; transformers runs it with
    ``attn_implementation="eager"``). ``model_type="glm_moe_dsa"``: a GLM-5 (MLA with the DeepSeek sparse-attention
    indexer keeping 4 keys per query, 16 indexer heads; the first layer dense, then 4 experts top-2)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    extra = {"use_sliding_window": False}
    if model_type == "qwen3_moe":
        extra = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "output_router_logits": False}
    elif model_type == "glm_moe_dsa":
        extra = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": hidden // 2,
                 "n_shared_experts": 1, "mlp_layer_types": ["dense"] + ["sparse"] * (layers - 1),
                 "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                 "v_head_dim": 32, "index_topk": 4, "index_head_dim": 16, "index_n_heads": 16,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e4}, "num_key_value_heads": hidden // 32}
    elif model_type == "gpt_oss":
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
                 "output_router_logits": False}
    fields = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64), head_dim=32,
                  max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=None,
                  eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="float32")
    cfg = transformers.AutoConfig.for_model(model_type, **dict(fields, **extra))
    torch.manual_seed(seed)
    attn = "eager" if model_type in ("gpt_oss", "glm_moe_dsa") else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path, safe_serialization=True)

    tok = Tokenizer(models.BPE(vocab=_VOCAB, merges=_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "pad_token": SPECIAL_TOKENS[PAD_ID],
                   "eos_token": SPECIAL_TOKENS[EOS_ID], "model_max_length": 512,
                   "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": EOS_ID, "pad_token_id": PAD_ID}, f)
    return path


def write_data(path: str, *, train: int = 64, val: int = 8, seed: int = 0) -> tuple[str, str]:
    """``train.parquet`` / ``val.parquet`` of prompts of 4-8 random one-letter words."""
    import random

    import pandas as pd

    os.makedirs(path, exist_ok=True)
    rng = random.Random(seed)

    def rows(n, split):
        out = []
        for i in range(n):
            words = " ".join(rng.choice(_LETTERS) for _ in range(rng.randrange(4, 9)))
            out.append({"data_source": "parallm_toy", "prompt": [{"role": "user", "content": words}],
                        "ability": "toy", "reward_model": {"style": "rule", "ground_truth": TARGET_WORDS},
                        "extra_info": {"split": split, "index": i}})
        return pd.DataFrame(out)

    files = os.path.join(path, "train.parquet"), os.path.join(path, "val.parquet")
    rows(train, "train").to_parquet(files[0])
    rows(val, "val").to_parquet(files[1])
    return files


def write_toy(out_dir: str, *, seed: int = 0, model_type: str = "qwen2") -> dict[str, str]:
    model = write_checkpoint(os.path.join(out_dir, "model"), seed=seed, model_type=model_type)
    train, val = write_data(os.path.join(out_dir, "data"), seed=seed)
    return {"model": model, "train": train, "val": val, "reward": os.path.abspath(__file__)}


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """The share of the response's words that are one of the letters of ``ground_truth`` (0 for an empty one)."""
    words = solution_str.split()
    return sum(len(w) == 1 and w in ground_truth for w in words) / len(words) if words else 0.0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m parallm.integrations.verl.toy",
                                 description="Write the toy task: a tiny model, its tokenizer and the data files.")
    ap.add_argument("out_dir")
    ap.add_argument("--model-type", choices=["qwen2", "qwen3_moe"], default="qwen2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(write_toy(args.out_dir, seed=args.seed, model_type=args.model_type)))
