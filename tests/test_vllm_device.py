"""parallm.integrations.vllm beside a GPU trainer (issue 34, item 8), checked on CPU with CUDA's calls replaced by
recorders: the current device is restored after an in-process engine starts (vLLM's GPU worker makes
``cuda:<local rank>`` current), the engine is placed on the trainer's device (vLLM's one-process executor takes
``cuda:0`` otherwise), the push's read-ahead thread works on the caller's device and stream (a new thread starts on
device 0), and ``launch`` asks for a share of the free memory instead of vLLM's 0.92 of the whole device.
``scripts/gpu_smoke.sh`` runs the same on a GPU with a real engine.

Runs in the vLLM venv (``scripts/test.sh``); the executor check needs vLLM's module, the others do not.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from parallm.integrations.vllm import inprocess as launch_module
from parallm.integrations.vllm import push as push_module


class FakeCuda:
    """torch.cuda's device / stream calls for a process with 4 GPUs, the current device per thread as in CUDA
    (a new thread starts on device 0); every call recorded with its thread's name."""

    def __init__(self, monkeypatch, current: int):
        self.local = threading.local()
        self.main = threading.get_ident()
        self.start = current
        self.calls = []
        self.streams = {d: f"stream-of-cuda:{d}" for d in range(4)}
        for name in ("is_available", "current_device", "set_device", "current_stream", "stream", "mem_get_info"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self):
        return True

    def current_device(self):
        default = self.start if threading.get_ident() == self.main else 0
        return getattr(self.local, "device", default)

    def set_device(self, device):
        self.calls.append((threading.current_thread().name, "set_device", int(device)))
        self.local.device = int(device)

    def current_stream(self, device=None):
        return self.streams[self.current_device() if device is None else device]

    @contextlib.contextmanager
    def stream(self, s):
        self.calls.append((threading.current_thread().name, "stream", s))
        yield

    def mem_get_info(self, device=None):
        self.calls.append((threading.current_thread().name, "mem_get_info", device))
        return 40 * 2 ** 30, 140 * 2 ** 30


def test_launch_restores_the_current_device(monkeypatch):
    """vLLM makes cuda:0 current while the engine starts (its worker's set_device); the trainer's cuda:3 is
    current again afterwards, also when the start fails."""
    cuda = FakeCuda(monkeypatch, current=3)
    with launch_module._process_state_kept():
        torch.cuda.set_device(0)                     # what vLLM's worker does for local rank 0
        assert torch.cuda.current_device() == 0
    assert torch.cuda.current_device() == 3
    with pytest.raises(RuntimeError, match="engine failed"), launch_module._process_state_kept():
        torch.cuda.set_device(1)
        raise RuntimeError("engine failed")
    assert torch.cuda.current_device() == 3
    assert cuda.calls[-1][1:] == ("set_device", 3)


class FakeGenerator:
    """A CUDA device's default generator: its state is what ``manual_seed`` sets."""

    def __init__(self, seed):
        self.state = torch.tensor([seed], dtype=torch.uint8)

    def get_state(self):
        return self.state.clone()

    def set_state(self, state):
        self.state = state.clone()

    def manual_seed(self, seed):
        self.state = torch.tensor([seed % 256], dtype=torch.uint8)


def test_launch_restores_the_cuda_rng(monkeypatch):
    """vLLM's start-up reseeds every CUDA device's generator (``manual_seed`` -> ``manual_seed_all``); the
    trainer's CUDA RNG streams are what they were afterwards, on every device, also when the start fails."""
    FakeCuda(monkeypatch, current=1)
    gens = tuple(FakeGenerator(seed) for seed in (11, 22, 33, 44))
    monkeypatch.setattr(torch.cuda, "default_generators", gens)
    for failing in (False, True):
        try:
            with launch_module._process_state_kept():
                for g in gens:                           # what vLLM's seeding does to every device
                    g.manual_seed(0)
                if failing:
                    raise RuntimeError("engine failed")
        except RuntimeError:
            assert failing
        assert [int(g.get_state()[0]) for g in gens] == [11, 22, 33, 44]


def test_the_engine_goes_on_the_trainers_device(monkeypatch):
    """vLLM's one-process executor derives its worker's local rank (its CUDA device) from the device config,
    plain ``cuda`` for ``vllm.LLM``: 0 on every rank; while ``launch`` starts the engine it is the trainer's."""
    pytest.importorskip("vllm") if os.environ.get("PARALLM_REQUIRE_VLLM") != "1" else None
    from types import SimpleNamespace

    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    fake = SimpleNamespace(vllm_config=SimpleNamespace(device_config=SimpleNamespace(device="cuda")))
    original = UniProcExecutor._distributed_args
    assert original(fake)[2] == 0                    # the problem: cuda:0 whatever the trainer's device
    with launch_module._engine_on_device(3):
        method, rank, local_rank = UniProcExecutor._distributed_args(fake)
        assert (rank, local_rank) == (0, 3) and isinstance(method, str)
    assert UniProcExecutor._distributed_args is original
    with launch_module._engine_on_device(None):      # no CUDA: nothing changes
        assert UniProcExecutor._distributed_args is original


def test_gpu_memory_default(monkeypatch):
    """Half of what is free (not vLLM's 0.92 of the whole device, which a resident trainer never leaves free),
    rounded down so that vLLM's check (total x utilization <= free) passes; the caller's sizes win."""
    assert launch_module.gpu_memory_default(40 * 2 ** 30, 140 * 2 ** 30) == 0.142
    assert launch_module.gpu_memory_default(100, 100, share=1.0) == 1.0
    util = launch_module.gpu_memory_default(7_777_777, 80_000_000)
    assert 80_000_000 * util <= 0.5 * 7_777_777 < 80_000_000 * (util + 0.001)
    with pytest.raises(ValueError, match="0.00 GiB free of"):
        launch_module.gpu_memory_default(0, 2 ** 30)
    with pytest.raises(ValueError, match="share must be in"):
        launch_module.gpu_memory_default(1, 2, share=0)
    FakeCuda(monkeypatch, current=2)
    platform = pytest.importorskip("vllm.platforms").current_platform if os.environ.get(
        "PARALLM_REQUIRE_VLLM") != "1" else __import__("vllm.platforms", fromlist=["x"]).current_platform
    monkeypatch.setattr(type(platform), "is_cpu", lambda self=None: False, raising=False)
    kwargs = launch_module._engine_kwargs("/nonexistent", {"dtype": "float32"}, 2)
    assert kwargs["gpu_memory_utilization"] == 0.142 and "kv_cache_memory_bytes" not in kwargs
    assert launch_module._engine_kwargs("/nonexistent", {"kv_cache_memory_bytes": 1 << 30}, 2) == {
        "kv_cache_memory_bytes": 1 << 30, "skip_tokenizer_init": True}
    assert "gpu_memory_utilization" not in launch_module._engine_kwargs("/nonexistent", {}, None)


def test_read_ahead_runs_on_the_callers_device_and_stream(monkeypatch):
    """The push's read-ahead thread drives the export stream (its copies, its buffer fences on the current
    stream): on the caller's cuda:2 and its current stream, not on device 0's default stream where a new thread
    starts."""
    cuda = FakeCuda(monkeypatch, current=2)
    seen = []

    def stream():
        for k in range(3):
            seen.append((threading.current_thread().name, torch.cuda.current_device(),
                         torch.cuda.current_stream()))
            yield f"t{k}", torch.zeros(4)

    ahead = push_module._ReadAhead(stream(), limit=1 << 20)
    assert [name for name, _ in ahead] == ["t0", "t1", "t2"]
    ahead.close()
    assert seen == [("parallm-push-read-ahead", 2, "stream-of-cuda:2")] * 3, seen
    assert ("parallm-push-read-ahead", "stream", "stream-of-cuda:2") in cuda.calls
