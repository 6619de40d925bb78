"""``parallm demo``: tiny LLaMA / Qwen2 checkpoints made with transformers, and the layouts the demo runs.

Every model is small (hidden 64, 4 layers, 4 query heads of 16, GQA) and has non-trivial weights: transformers
initialises norms to 1 and biases to 0, which would hide a mapping bug, so every tensor is redrawn from a seed.
Vocabulary sizes are odd on purpose (not divisible by tp: the padding path runs).
"""

from __future__ import annotations

import os

# name -> (family, config overrides, task, label shown in the table)
MODELS = {
    "llama-untied": ("llama", dict(attention_bias=True, vocab_size=101), "causal_lm",
                     "llama untied, qkvo bias"),
    "llama-tied": ("llama", dict(tie_word_embeddings=True, num_key_value_heads=1, vocab_size=99), "causal_lm",
                   "llama tied, 1 kv head"),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, vocab_size=103), "causal_lm", "qwen2 tied"),
    "qwen2-value": ("qwen2", dict(vocab_size=101), "value", "qwen2 value head"),
}

BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
            tie_word_embeddings=False, rope_theta=10000.0)

# The layouts (world 4: tp * pp * dp). quick: the subset `parallm demo --quick` runs.
LAYOUTS = [
    dict(model="llama-untied", tp=2, pp=1, vpp=None, nmb=1, mode="slice", quick=True),
    dict(model="llama-tied", tp=2, pp=2, vpp=2, nmb=2, mode="broadcast", quick=False),
    dict(model="qwen2-tied", tp=2, pp=1, vpp=None, nmb=1, packed=True, sp=True, quick=False),
    dict(model="qwen2-value", tp=2, pp=2, vpp=None, nmb=2, packed=True, sp=True, task="value", quick=True),
]
DEMO_WORLD = 4


def demo_cases(workdir: str, *, quick: bool, world: int) -> tuple[list[dict], list[str]]:
    """The cases that fit ``world`` ranks (tp * pp must divide it), and a note per skipped one."""
    cases, skipped = [], []
    for lay in LAYOUTS:
        if quick and not lay["quick"]:
            continue
        name, label = lay["model"], MODELS[lay["model"]][3]
        if world % (lay["tp"] * lay["pp"]):
            skipped.append(f"{name} tp{lay['tp']} pp{lay['pp']}: needs a multiple of {lay['tp'] * lay['pp']} "
                           f"ranks, the world has {world}")
            continue
        case = {k: v for k, v in lay.items() if k != "quick"}
        case.update(model=label, ckpt=os.path.join(workdir, "checkpoints", name), mode=lay.get("mode", "auto"),
                    task=MODELS[name][2])
        cases.append(case)
    return cases, skipped


def randomize_weights(model, seed: int) -> None:
    """Every weight non-trivial: norms around 1, biases non-zero, matrices ~N(0, 0.08)."""
    import torch
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


def make_checkpoint(name: str, path: str, seed: int) -> str:
    """Save the demo model ``name`` with transformers' save_pretrained (safetensors)."""
    import torch
    import transformers

    from .checks import quiet_transformers
    quiet_transformers()
    family, overrides, task, _ = MODELS[name]
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    config = cls(**dict(BASE, **overrides))
    torch.manual_seed(seed)
    if task == "value":
        config.num_labels = 1
        config.pad_token_id = 0
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.float().eval()
    randomize_weights(model, seed)
    if config.tie_word_embeddings and task == "causal_lm":
        model.tie_weights()
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_checkpoints(cases: list[dict]) -> None:
    """Create every checkpoint the cases need (rank 0)."""
    done = set()
    for case in cases:
        path = case["ckpt"]
        if path in done:
            continue
        name = os.path.basename(path)
        make_checkpoint(name, path, seed=sorted(MODELS).index(name) + 1)
        done.add(path)
