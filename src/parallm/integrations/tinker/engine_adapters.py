"""What a vLLM sampler engine is given for a snapshot whose adapters include the output head (``lm_head``), so that
what it samples is exactly the snapshot (docs/tinker.md, "Sampling").

Facts (vLLM 0.32, checked): vLLM applies an ``lm_head`` LoRA only on model classes that list ``lm_head`` among
their ``embedding_modules`` (LLaMA, Qwen3, Qwen3-MoE, Mixtral, ...; exact there); on others (Qwen2, ...) it
refuses the adapter and its engine core dies. Its CPU build also adds the head delta of the adapter in the last
LoRA slot to requests sent *without* an adapter (a request without a LoRA has slot index -1, which the CPU
kernels read as the last slot): base-model requests are wrong once a head adapter is loaded.

So: a snapshot whose head factors are all zero (a ``train_unembed=False`` client, or one whose head B is still
zero) is given to the engine without them (a copy beside the snapshot, ``<dir>-engine``: exact, the head delta
is zero); one with a non-zero head is given as it is where the engine's model class supports head LoRA and
refused with the reason elsewhere; base-model requests go through an all-zero adapter without a head (never
through "no adapter") whenever the model holds head adapters.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading

import torch

__all__ = ["HeadSupport", "head_factors_zero", "stripped_copy", "zero_adapter"]

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _is_head(name: str) -> bool:
    return ".lm_head." in name or name.startswith("lm_head.")


def head_factors_zero(directory: str) -> bool | None:
    """None when the adapter has no head factors; else whether they are all zero."""
    from safetensors import safe_open
    with safe_open(os.path.join(directory, WEIGHTS), "pt") as f:
        heads = [k for k in f.keys() if _is_head(k)]
        if not heads:
            return None
        return all(not bool(f.get_tensor(k).any()) for k in heads)


def stripped_copy(src: str, dst: str, *, zero: bool = False) -> str:
    """``src`` without its head factors (and ``lm_head`` out of ``target_modules``) at ``dst``; ``zero``: every
    other tensor zeroed too (the base model as an adapter). Written beside and moved into place; kept if there."""
    if os.path.isdir(dst):
        return dst
    from safetensors.torch import load_file, save_file
    tensors = {k: (torch.zeros_like(v) if zero else v) for k, v in load_file(os.path.join(src, WEIGHTS)).items()
               if not _is_head(k)}
    with open(os.path.join(src, CONFIG)) as f:
        config = json.load(f)
    targets = config.get("target_modules")
    if isinstance(targets, list):
        config["target_modules"] = [t for t in targets if t != "lm_head"]
    tmp = dst + f".tmp-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(tensors, os.path.join(tmp, WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(tmp, CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    try:
        os.replace(tmp, dst)
    except OSError:                     # another thread made it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def zero_adapter(template: str, dst: str) -> str:
    """An all-zero adapter without head factors: what base-model requests are sent with (made anew)."""
    shutil.rmtree(dst, ignore_errors=True)
    return stripped_copy(template, dst, zero=True)


_PROBE = """
import json, sys
from vllm.model_executor.models.registry import ModelRegistry
cls = ModelRegistry._try_load_model_cls(sys.argv[1])
print("HEAD " + json.dumps(cls is not None and "lm_head" in (getattr(cls, "embedding_modules", None) or {})))
"""


class HeadSupport:
    """Whether vLLM's model class for ``arch`` applies LoRA on ``lm_head``: asked once, in a process of its own
    (importing vLLM's registry takes seconds), on a thread started with the engine; :meth:`get` waits for it."""

    def __init__(self, arch: str, python: str | None = None):
        self.arch, self.value, self.error = arch, None, None
        self._done = threading.Event()
        threading.Thread(target=self._ask, args=(python or sys.executable,), daemon=True,
                         name="tinker-vllm-head-probe").start()

    def _ask(self, python: str) -> None:
        try:
            out = subprocess.run([python, "-c", _PROBE, self.arch], capture_output=True, text=True, timeout=600,
                                 env=dict(os.environ, VLLM_LOGGING_LEVEL="ERROR"))
            line = next((x for x in out.stdout.splitlines() if x.startswith("HEAD ")), None)
            if line is None:
                self.error = (out.stderr.strip().splitlines() or ["no answer"])[-1]
            else:
                self.value = bool(json.loads(line[5:]))
        except Exception as e:  # noqa: BLE001 - the question stays open: refuse what needs the answer
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._done.set()

    def get(self, timeout: float = 600.0) -> bool:
        self._done.wait(timeout)
        return bool(self.value)
