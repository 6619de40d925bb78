"""The real kernel libraries' Triton kernels on CPU, through Triton's interpreter (``TRITON_INTERPRET=1``),
called the way parallm calls them (issue 55, item 7).

What runs here is parallm's own wrapper of each library call (``KERNELS["fla"]`` / ``KERNELS["mamba_ssm"]``:
argument order, ``[1, T, ...]`` layouts, ``cu_seqlens`` / ``seq_idx``, dtypes), checked against parallm's torch
kernel on a small packed stream of three documents:

- fla's ``causal_conv1d`` (Gated DeltaNet's short conv, ``cu_seqlens``): runs, equal to the torch kernel.
- mamba-ssm's ``mamba_chunk_scan_combined`` (Mamba-2's SSD scan, ``seq_idx``): runs, equal to the torch kernel.
- fla's ``chunk_gated_delta_rule`` (Gated DeltaNet's recurrence, ``cu_seqlens``, grouped values): runs, equal to
  the torch kernel, only with ``range`` rebound in ``fla.ops.common.chunk_delta_h`` (:func:`_tensor_range`):
  its ``for i_t in range(NT): i_t.to(tl.int64)`` gets a Python int from the interpreter's ``range``
  (``InterpreterError: AttributeError("'int' object has no attribute 'to'")``, fla 0.4.2, 0.5.2, 0.6.0).
- causal-conv1d's ``causal_conv1d_fn`` (Mamba-2's conv) is a CUDA C++ extension, not Triton: nothing to
  interpret; not tested here.

Needs the kernels venv (``scripts/setup_kernels_cpu.sh``: Triton 3.6, numpy < 2.3 (numpy 2.3+ refuses
``int()`` of the interpreter's 1-element program ids), fla, and mamba-ssm's Python package without its CUDA
extension). Everything else skips with the reason. Run it alone (``TRITON_INTERPRET`` must be set before Triton
is first imported; this module sets it): ``python -m pytest tests/test_kernels_interpreted.py``.

Shims, none touching a kernel's math: every ``triton.autotune`` keeps only its first config (the
interpreter cannot benchmark: no active driver), and ``torch.cuda.device(None)`` (mamba-ssm's launch guard for a
CPU tensor) is a no-op context; and the ``range`` above.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

if "triton" not in sys.modules and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytestmark = pytest.mark.timeout(600)


def _interpreter():
    """Why Triton's interpreter cannot run here, or None (the autotune pin installed)."""
    try:
        import triton
        from triton.runtime.autotuner import Autotuner
    except Exception as e:  # noqa: BLE001
        return f"triton is not installed ({e!r}); run scripts/setup_kernels_cpu.sh"
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton was imported before TRITON_INTERPRET=1 was set: run this file alone"
    if not getattr(Autotuner, "_parallm_one_config", False):
        init = Autotuner.__init__

        def one_config(self, fn, arg_names, configs, *args, **kwargs):
            init(self, fn, arg_names, list(configs)[:1], *args, **kwargs)

        Autotuner.__init__ = one_config
        Autotuner._parallm_one_config = True
    del triton
    return None


WHY_NOT = _interpreter()


def _import(name, attr):
    if WHY_NOT:
        return None, WHY_NOT
    try:
        return getattr(importlib.import_module(name), attr), None
    except Exception as e:  # noqa: BLE001
        return None, f"{name} cannot be imported ({e!r}); run scripts/setup_kernels_cpu.sh"


def _mamba_scan():
    if WHY_NOT:
        return None, WHY_NOT
    # mamba-ssm's package __init__ imports its CUDA selective scan; built with MAMBA_SKIP_CUDA_BUILD it is absent,
    # and only the Triton SSD kernels are used here
    if "selective_scan_cuda" not in sys.modules:
        try:
            import selective_scan_cuda  # noqa: F401
        except ImportError:
            sys.modules["selective_scan_cuda"] = types.ModuleType("selective_scan_cuda")
    return _import("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")


FLA_CONV, NO_FLA_CONV = _import("fla.modules.convolution", "causal_conv1d")
FLA_RULE, NO_FLA_RULE = _import("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")
MS_SCAN, NO_MS_SCAN = _mamba_scan()
if os.environ.get("PARALLM_REQUIRE_KERNELS") == "1":      # scripts/test.sh in .venv-kernels: a missing library fails
    missing = [str(why) for lib, why in ((FLA_CONV, NO_FLA_CONV), (FLA_RULE, NO_FLA_RULE), (MS_SCAN, NO_MS_SCAN))
               if lib is None]
    if missing:
        raise ImportError("PARALLM_REQUIRE_KERNELS=1 but: " + "; ".join(missing))

CU = torch.tensor([0, 23, 24, 90])      # three documents: one longer than a chunk, one of a single token
TOTAL = int(CU[-1])


@pytest.fixture
def cpu_launch(monkeypatch):
    """mamba-ssm wraps each launch in ``torch.cuda.device(t.device.index)``: None on CPU."""
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())


@pytest.mark.skipif(FLA_CONV is None, reason=str(NO_FLA_CONV))
def test_fla_causal_conv1d(monkeypatch):
    from parallm.model.layers import gated_deltanet as gdn
    monkeypatch.setattr(gdn, "_fla_conv", FLA_CONV)
    g = torch.Generator().manual_seed(0)
    channels, width = 24, 4
    x = torch.randn(TOTAL, channels, generator=g)
    weight = torch.randn(channels, 1, width, generator=g) * 0.5
    got = gdn.KERNELS["fla"].conv(x, weight, CU)
    want = gdn.KERNELS["torch"].conv(x, weight, CU)
    assert got.shape == want.shape == (TOTAL, channels)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-5)


def _tensor_range(*bounds):
    """``range`` yielding the interpreter's int32 scalars, as compiled Triton's loop index is: fla's
    ``chunk_delta_h`` calls ``i_t.to(tl.int64)`` on it, which a Python int (the interpreter's plain ``range``)
    lacks."""
    import builtins

    from triton.runtime.interpreter import interpreter_semantic
    for i in builtins.range(*(int(b) for b in bounds)):
        yield interpreter_semantic.to_tensor(i, False)


@pytest.mark.skipif(FLA_RULE is None, reason=str(NO_FLA_RULE))
def test_fla_chunk_gated_delta_rule(monkeypatch):
    import fla.ops.common.chunk_delta_h as chunk_delta_h
    from triton.runtime.errors import InterpreterError

    from parallm.model.layers import gated_deltanet as gdn
    monkeypatch.setattr(gdn, "_fla_chunk", FLA_RULE)
    monkeypatch.setattr(chunk_delta_h, "range", _tensor_range, raising=False)
    g = torch.Generator().manual_seed(1)
    hk, hv, d = 2, 4, 16                   # grouped values: parallm repeats the key heads for fla
    q = torch.randn(TOTAL, hk, d, generator=g)
    k = torch.randn(TOTAL, hk, d, generator=g)
    v = torch.randn(TOTAL, hv, d, generator=g)
    decay = -torch.rand(TOTAL, hv, generator=g)
    beta = torch.rand(TOTAL, hv, generator=g)
    try:
        got = gdn.KERNELS["fla"].rule(q, k, v, decay, beta, CU)
    except InterpreterError as e:
        pytest.fail(f"interpreter error: {e}")
    want = gdn.KERNELS["torch"].rule(q, k, v, decay, beta, CU)    # normalises, scales, groups itself
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.skipif(MS_SCAN is None, reason=str(NO_MS_SCAN))
@pytest.mark.parametrize("groups", [1, 2])
def test_mamba_chunk_scan_combined(monkeypatch, cpu_launch, groups):
    from parallm.model.layers import mamba2
    monkeypatch.setattr(mamba2, "_ms_scan", MS_SCAN)
    g = torch.Generator().manual_seed(2)
    heads, headdim, state, chunk = 4, 8, 16, 16
    x = torch.randn(TOTAL, heads, headdim, generator=g)
    dt = torch.rand(TOTAL, heads, generator=g) * 0.5 + 0.01     # after softplus and clamp, as the layer passes
    a = -torch.rand(heads, generator=g) - 0.1
    b = torch.randn(TOTAL, groups, state, generator=g)
    c = torch.randn(TOTAL, groups, state, generator=g)
    d = torch.randn(heads, generator=g)
    got = mamba2.KERNELS["mamba_ssm"].scan(x, dt, a, b, c, d, CU, chunk=chunk)
    want = mamba2.KERNELS["torch"].scan(x, dt, a, b, c, d, CU, chunk=chunk)
    assert got.dtype == torch.float32 and got.shape == want.shape == (TOTAL, heads, headdim)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
