"""Helpers of the Tinker-server tests (tests/test_tinker*.py, run in .venv-tinker): a tiny checkpoint with a
character-level tokenizer (every character of printable ASCII is a token, so any text round-trips and
tinker-cookbook's ``role_colon`` renderer works), and the server as a subprocess (``parallm serve-tinker``),
started once per test module and stopped in ``finally``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import helpers

SPECIALS = ["<pad>", "<eos>", "<bos>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
SERVER_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
              "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def write_char_tokenizer(path: str) -> int:
    """A character-level fast tokenizer in ``path``; returns its size (specials first: pad 0, eos 1, bos 2)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>")
    fast.save_pretrained(path)
    return len(vocab)


def tiny_model(path: str, *, seed: int = 0, family: str = "qwen3", layers: int = 2) -> str:
    """A tiny seeded checkpoint (head_dim 32, what vLLM's CPU attention takes; non-trivial weights) with the
    character tokenizer; the vocabulary padded to 112."""
    os.makedirs(path, exist_ok=True)
    n = write_char_tokenizer(path)
    cfg = helpers.tiny_config(family, head_dim=32, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                              vocab_size=max(n, 112), num_hidden_layers=layers, max_position_embeddings=512,
                              eos_token_id=1, bos_token_id=2, pad_token_id=0)
    model = helpers.make_hf_model(cfg, seed=seed)
    helpers.save_checkpoint(model, path)
    return path


class Server:
    """The server in a subprocess (its own process group): ``python -m parallm.integrations.tinker``, or with
    ``cli=True`` the ``parallm serve-tinker`` command (``python -m parallm``); ``url`` once ready."""

    def __init__(self, model: str, workdir: str, *, tp: int = 2, sampler: str = "parallm", lora_rank: int = 8,
                 extra=(), python: str | None = None, api_key: str | None = None, timeout: float = 420.0,
                 cli: bool = False, env: dict | None = None):
        self.ready = os.path.join(workdir, "ready.json")
        self.log_path = os.path.join(workdir, "server.log")
        entry = ["-m", "parallm", "serve-tinker"] if cli else ["-m", "parallm.integrations.tinker"]
        cmd = [python or sys.executable, *entry, "--model", model, "--tp", str(tp),
               "--port", "0", "--sampler", sampler, "--lora-rank", str(lora_rank), "--ready-file", self.ready,
               "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--timeout", "120", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, **SERVER_ENV, **(env or {})),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.tail()
                self.stop()
                raise RuntimeError(f"the server did not start; its log:\n{tail}")
            time.sleep(0.5)
        with open(self.ready) as f:
            info = json.load(f)
        self.url, self.pid, self.sampler_pid = info["url"], info["pid"], info.get("sampler_pid")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        """SIGTERM to the launcher (rank 0 then stops the other ranks); the whole process group is killed if
        anything is left after 60 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()


# -- the references: transformers + PEFT on the same adapter, torch's AdamW ---------------------------------------

def adapter_dir(workdir: str, tinker_path: str) -> str:
    """The directory of a ``tinker://<model>/sampler_weights/<name>`` path of a server whose checkpoint directory
    is ``workdir/ckpt`` (the server's own mapping)."""
    from parallm.integrations.tinker.checkpoints import CheckpointStore
    model_id, segment, name = tinker_path[len("tinker://"):].split("/")
    return CheckpointStore(os.path.join(workdir, "ckpt")).path(model_id, segment, name)


def adapter_tensors(directory: str) -> dict:
    from safetensors.torch import load_file
    return load_file(os.path.join(directory, "adapter_model.safetensors"))


def peft_model(model_dir: str, adapter: str):
    """transformers' model of ``model_dir`` (fp32) with the PEFT adapter directory ``adapter``, trainable."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, adapter, is_trainable=True)
    return model


def peft_state(model) -> dict:
    from peft import get_peft_model_state_dict
    state = get_peft_model_state_dict(model, save_embedding_layers=False)      # the factors only (lm_head too)
    return {k: v.detach().clone() for k, v in state.items()}


def target_logprobs(model, tokens, targets):
    """transformers' log-prob of ``targets[t]`` after ``tokens[:t + 1]`` (differentiable)."""
    import torch
    logits = model(input_ids=torch.as_tensor([tokens])).logits[0].float()
    t = torch.as_tensor(targets)
    lsm = logits.log_softmax(-1)
    return lsm.gather(-1, t[:, None]).squeeze(-1) if t.dim() == 1 else lsm.gather(-1, t)


def reference_loss(loss_fn: str, tl, inputs: dict, config: dict):
    """Tinker's losses as its documentation writes them (torch), summed over the datum's tokens."""
    import torch
    lo = inputs.get("clip_low_threshold", config.get("clip_low_threshold", 0.8))
    hi = inputs.get("clip_high_threshold", config.get("clip_high_threshold", 1.2))
    if loss_fn == "cross_entropy":
        return (-tl * inputs["weights"]).sum()
    lp, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return -(torch.exp(tl - lp) * adv).sum()
    if loss_fn == "dro":
        return -(tl * adv - 0.5 * config["beta"] * (tl - lp) ** 2).sum()
    if loss_fn == "gspo":
        in_ratio = inputs["sequence_ratio_mask"] != 0
        log_ratio = (tl.detach() - lp)[in_ratio].mean()
        ratio = torch.exp(log_ratio + tl - tl.detach())
    else:
        ratio = torch.exp(tl - lp)
    clipped = torch.clamp(ratio, lo, hi)
    if loss_fn == "cispo":
        return -(clipped.detach() * tl * adv).sum()
    return -torch.min(ratio * adv, clipped * adv).sum()


def reference_step(model, data, loss_fn: str, config: dict, adam: dict, optimizer=None):
    """One Tinker step on the PEFT model: the summed loss of ``data`` (``(tokens, inputs)`` pairs), backward,
    gradient clipping when asked, torch.optim.AdamW. Returns (loss, per-datum target log-probs, optimizer)."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None:
        optimizer = torch.optim.AdamW(params, lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]),
                                      eps=adam["eps"], weight_decay=adam["weight_decay"])
    total, lps = 0.0, []
    for tokens, inputs in data:
        tl = target_logprobs(model, tokens, inputs["target_tokens"])
        t_inputs = {k: torch.as_tensor(v) for k, v in inputs.items()}
        loss = reference_loss(loss_fn, tl, t_inputs, config)
        loss.backward()
        total += float(loss.detach())
        lps.append(tl.detach())
    norm = float(torch.nn.utils.clip_grad_norm_(params, adam["grad_clip_norm"] or float("inf")))
    optimizer.step()
    optimizer.zero_grad()
    reference_step.grad_norm = norm             # the global gradient norm before clipping, of the last call
    return total, lps, optimizer


def rank_pids(server: Server) -> list[int]:
    """The server's rank processes in rank order (the launcher's children; rank 0 is the one that wrote the
    ready file)."""
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
    pids = sorted(int(p) for p in out.stdout.split())
    return [server.pid] + [p for p in pids if p != server.pid]


def check_sampling_params(sc, prompt, forward_lp) -> None:
    """Temperature, top-p and top-k change what is drawn, not the log-probs reported (the unscaled
    distribution's: the training forward's, within 1e-4); a stop token ends a sample with stop_reason "stop",
    the stop token last."""
    import numpy as np
    from tinker import types
    res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(
        max_tokens=5, seed=3, temperature=0.7, top_p=0.9, top_k=20, stop=[])).result()
    for s in res.sequences:
        assert len(s.tokens) == 5
        np.testing.assert_allclose(np.array(s.logprobs), forward_lp(prompt + s.tokens)[len(prompt) - 1:],
                                   atol=1e-4)
    stops = list(range(3, 60))
    res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=40, seed=4,
                                                                               stop=stops)).result()
    for s in res.sequences:
        assert s.stop_reason == "stop" and s.tokens[-1] in stops
        assert not any(t in stops for t in s.tokens[:-1])


def check_peft_rank(directory: str, rank: int, alpha: float, *, experts: bool = False) -> None:
    """A sampler snapshot is a rank-``rank`` PEFT adapter: ``r`` and ``lora_alpha`` in its config, every A with
    ``rank`` rows (a MoE's stacked experts: ``E rank``, their fused gate/up ``E 2 rank``: PEFT's rank pattern) and
    every B with ``rank`` columns likewise."""
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == rank and config["lora_alpha"] == alpha, (config["r"], config["lora_alpha"])
    if experts:
        assert config["rank_pattern"] == {r".*\.gate_up_proj": 2 * rank}, config["rank_pattern"]
    seen_experts = False
    for name, t in adapter_tensors(directory).items():
        k = t.shape[0] if ".lora_A." in name else t.shape[1]
        if name.endswith(("experts.lora_A.weight", "experts.lora_B.weight", "experts.base_layer.lora_A.weight",
                          "experts.base_layer.lora_B.weight")):
            seen_experts = True
            per = 2 * rank if ".base_layer." in name else rank
            assert k % per == 0 and k // per > 1, (name, tuple(t.shape))
        else:
            assert k == rank, (name, tuple(t.shape))
    assert seen_experts == experts


def check_topk(sc, model_dir: str, adapter: str | None, prompt: list, *, atol: float = 1e-4) -> None:
    """Top-k log-probs of a sampling client (prompt k = 5, sampled k = 3) against transformers' (+ PEFT's)
    top-k of the same logits: at every prompt position (the first empty) and before every sampled token, the
    same token ids in order (where their log-probs are not within ``atol`` of each other) and log-probs within
    ``atol``."""
    import numpy as np
    import torch
    from tinker import types
    from transformers import AutoModelForCausalLM
    model = peft_model(model_dir, adapter) if adapter else AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32)
    res = sc.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=4, seed=5, stop=[]),
                    include_prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=3).result()

    def want(tokens, k):
        with torch.no_grad():
            lsm = model(input_ids=torch.as_tensor([tokens])).logits[0].double().log_softmax(-1)
        v, i = lsm.topk(k, -1)
        return v.numpy(), i.numpy()

    def same(got, ref_v, ref_i):
        ids, lps = zip(*got)
        np.testing.assert_allclose(np.array(lps), ref_v, atol=atol, rtol=0)
        for j, (a, b) in enumerate(zip(ids, ref_i)):
            if a != b:      # only where two log-probs tie within the tolerance
                assert abs(ref_v[j] - lps[j]) <= atol, (ids, ref_i, lps, ref_v)
    top = res.topk_prompt_logprobs
    assert len(top) == len(prompt) and top[0] is None
    v, i = want(prompt, 5)
    for t in range(1, len(prompt)):
        assert len(top[t]) == 5
        same(top[t], v[t - 1], i[t - 1])
    for s in res.sequences:
        assert len(s.topk_logprobs) == len(s.tokens) == 4
        v, i = want(prompt + s.tokens, 3)
        for t, row in enumerate(s.topk_logprobs):
            assert len(row) == 3
            same(row, v[len(prompt) - 1 + t], i[len(prompt) - 1 + t])
            assert s.tokens[t] not in [x for x, _ in row] or \
                abs(dict(row)[s.tokens[t]] - s.logprobs[t]) <= atol      # the sampled token's own log-prob agrees


# -- shared by the vLLM-engine tests (test_tinker_push.py, test_tinker_engines.py) -----------------------------

def ready_info(srv) -> dict:
    """The server's ready file (its URL and the engines')."""
    with open(srv.ready) as f:
        return json.load(f)


def vllm_served(url: str) -> float:
    """vLLM's own count of finished requests (its /metrics)."""
    import re
    import urllib.request
    with urllib.request.urlopen(url + "/metrics", timeout=10) as res:
        text = res.read().decode()
    return sum(float(m) for m in re.findall(r'^vllm:request_success_total\{[^}]*\} ([0-9.e+]+)$', text, re.M))


def file_sizes(root: str) -> dict:
    """Every file under ``root``: relative path -> size."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            p = os.path.join(dirpath, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def next_token_datum(tokens):
    """A cross-entropy datum predicting ``tokens[1:]`` from ``tokens[:-1]`` (weights 1)."""
    import numpy as np
    from tinker import types
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]),
                                       "weights": np.ones(len(tokens) - 1, np.float32)})


def forward_logprobs(tc, tokens):
    """A training client's forward log-probs of ``tokens`` (next-token targets)."""
    return tc.forward([next_token_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
