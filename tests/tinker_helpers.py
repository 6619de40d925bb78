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
    """``parallm serve-tinker`` in a subprocess (its own process group); ``url`` once ready."""

    def __init__(self, model: str, workdir: str, *, tp: int = 2, sampler: str = "parallm", lora_rank: int = 8,
                 extra=(), python: str | None = None, api_key: str | None = None, timeout: float = 420.0):
        self.ready = os.path.join(workdir, "ready.json")
        self.log_path = os.path.join(workdir, "server.log")
        cmd = [python or sys.executable, "-m", "parallm.integrations.tinker", "--model", model, "--tp", str(tp),
               "--port", "0", "--sampler", sampler, "--lora-rank", str(lora_rank), "--ready-file", self.ready,
               "--checkpoint-dir", os.path.join(workdir, "ckpt"), "--timeout", "120", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ, **SERVER_ENV),
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start; its log:\n{self.tail()}")
            time.sleep(0.5)
        with open(self.ready) as f:
            info = json.load(f)
        self.url, self.pid, self.sampler_pid = info["url"], info["pid"], info.get("sampler_pid")

    def tail(self, n: int = 4000) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
