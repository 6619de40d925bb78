"""Device handling and kernel choices (issue: CUDA device 0 is falsy; ranks choosing different kernels; the
grouped GEMM's empty-group check; init_parallel's seed). No GPU here: CUDA devices are only named, never used,
and the CUDA-only queries are monkeypatched."""

import ast
import os

import pytest
import torch
import torch.distributed as dist

from helpers import run_ranks, tiny_config

import parallm
from parallm.model.layers import attention, moe
from parallm.model.kernels import kernel_mismatch
from parallm.parallel.state import as_device

SRC = os.path.join(os.path.dirname(__file__), os.pardir, "src", "parallm")


@pytest.mark.parametrize("given, want", [
    (None, torch.device("cpu")), ("cpu", torch.device("cpu")), (0, torch.device("cuda", 0)),
    (torch.device("cuda", 0), torch.device("cuda", 0)), (3, torch.device("cuda", 3)), ("cuda:1", torch.device("cuda", 1)),
])
def test_as_device_keeps_cuda_device_zero(given, want):
    assert as_device(given) == want


def test_as_device_refuses_a_bool():
    with pytest.raises(TypeError, match="device must be"):
        as_device(False)


def _falsy_device_defaults(source: str):
    """Lines of ``x or y`` expressions whose left side names a device or a device index (``device or "cpu"``,
    ``self.index or 0``): for CUDA device 0 they take the right side."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            left = node.values[0]
            name = left.id if isinstance(left, ast.Name) else left.attr if isinstance(left, ast.Attribute) else ""
            if "device" in name.lower() or name.lower() in ("dev", "index", "local_rank"):
                yield node.lineno


def test_no_falsy_device_idiom_in_the_tree():
    """``device or "cpu"`` turns CUDA device 0 (the int 0) into the CPU: nothing in the package may default a
    device that way (``parallel.state.as_device`` does it right). The check itself catches the idiom."""
    assert list(_falsy_device_defaults('d = device or "cpu"\ni = self.index or 0\nok = device if device else 1'))\
        == [1, 2]
    found = []
    for root, _, files in os.walk(SRC):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                lines = open(path, encoding="utf-8").read()
                found += [f"{os.path.relpath(path, SRC)}:{n}" for n in _falsy_device_defaults(lines)]
    assert not found, found


@pytest.mark.parametrize("device", [0, torch.device("cuda", 0)])
def test_choice_functions_see_cuda_device_zero_as_cuda(monkeypatch, device):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: asked.append(index) or (9, 0))
    sizes = (64, 128, 64)
    # grouped GEMM: the CUDA rules (bf16 only, capability of device 0), never the CPU's "supported"
    assert moe.grouped_mm_support(device, torch.float32, sizes) == \
        "on CUDA torch._grouped_mm has a grouped kernel for bfloat16 only, not torch.float32"
    assert moe.grouped_mm_support(device, torch.bfloat16, sizes) is None and asked == [0]
    # attention: the same choice for 0 as for cuda:0, and not the CPU's
    cuda0 = torch.device("cuda", 0)
    for packed in (False, True):
        got = attention.resolve_attn_impl("auto", packed=packed, device=device, dtype=torch.bfloat16)
        assert got == attention.resolve_attn_impl("auto", packed=packed, device=cuda0, dtype=torch.bfloat16)
    assert attention.block_kernel(None, device) == attention.block_kernel(None, cuda0)
    assert attention.block_kernel(None, device) != attention.block_kernel(None, "cpu")


def test_kernel_mismatch_names_the_rank_and_the_choice():
    same = {"Attention.backend": "sdpa", "Experts.kernel": "grouped_mm"}
    assert kernel_mismatch([same, dict(same)]) is None
    # pipeline stages hold different layer kinds: only shared keys are compared
    assert kernel_mismatch([{"Attention.backend": "sdpa"}, same]) is None
    problem = kernel_mismatch([same, same, {"Attention.backend": "sdpa", "Experts.kernel": "loop"}])
    assert "rank 2 chose Experts.kernel = 'loop', rank 0 chose 'grouped_mm'" in problem


def _differing_kernels(rank, world, ckpt):
    if rank == 1:     # this rank alone computes its experts with the loop
        os.environ[moe.KERNEL_ENV] = "loop"
    parallm.init_parallel(tp=2)
    try:
        with pytest.raises(ValueError) as err:
            parallm.build_model(ckpt)
        message = str(err.value)
        os.environ.pop(moe.KERNEL_ENV, None)
        chunks = parallm.build_model(ckpt)          # with the same choices the groups still work
        return message, parallm.model.kernels.kernel_choices(chunks)
    finally:
        parallm.destroy_parallel()


def test_build_model_refuses_kernels_that_differ_across_ranks(tmp_path):
    from parallm.verify import make_hf_model
    ckpt = str(tmp_path / "moe")
    make_hf_model(tiny_config("qwen3_moe"), seed=0).save_pretrained(ckpt)
    results = run_ranks(_differing_kernels, 2, ckpt)
    for message, choices in results:
        assert "build_model: rank 1 chose Experts.kernel = 'loop', rank 0 chose 'grouped_mm'" in message
        assert choices["Experts.kernel"] == "grouped_mm" and "Attention.backend" in choices


# -- the grouped GEMM's check ---------------------------------------------------------------------------------

_real_grouped_mm = torch._grouped_mm


class _LeakyGroupedMM(torch.autograd.Function):
    """torch._grouped_mm whose backward gives empty groups a small weight gradient (the SM100 report)."""

    @staticmethod
    def forward(ctx, a, b, offs):
        ctx.save_for_backward(a, b, offs)
        return _real_grouped_mm(a, b, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        a, b, offs = ctx.saved_tensors
        with torch.enable_grad():
            a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
            da, db = torch.autograd.grad(_real_grouped_mm(a2, b2, offs=offs), (a2, b2), grad)
        empty = offs.diff(prepend=offs.new_zeros(1)) == 0
        db = db.clone()
        db[empty] += 1e-3
        return da, db, None


def _leaky(a, b, offs=None):
    return _LeakyGroupedMM.apply(a, b, offs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_check_passes_on_a_correct_kernel(dtype):
    assert moe.empty_group_problem("cpu", dtype) is None


def test_grouped_mm_check_catches_gradients_of_empty_groups_and_falls_back(monkeypatch, caplog):
    monkeypatch.setattr(torch, "_grouped_mm", _leaky)
    assert "no token chose got a non-zero weight gradient" in moe.empty_group_problem("cpu", torch.float32)
    from parallm.model.layers import moe_kernels
    monkeypatch.setattr(moe_kernels, "PROBED_DEVICE_TYPES", ("cpu",))
    moe._choose_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="parallm"):
            assert moe._choose_kernel("cpu", torch.float32, (64, 128, 64), "auto") == "loop"
        assert "fails its check" in caplog.text
        with pytest.raises(ValueError, match="PARALLM_MOE_EXPERTS=grouped_mm, but an expert that no token chose"):
            moe._choose_kernel("cpu", torch.float32, (64, 128, 64), "grouped_mm")
        monkeypatch.setattr(torch, "_grouped_mm", _real_grouped_mm)
        moe._choose_kernel.cache_clear()
        assert moe._choose_kernel("cpu", torch.float32, (64, 128, 64), "auto") == "grouped_mm"
    finally:
        moe._choose_kernel.cache_clear()


# -- init_parallel's seed -------------------------------------------------------------------------------------

def test_init_parallel_leaves_the_rng_alone_unless_given_a_seed(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        torch.manual_seed(1234)
        torch.rand(3)
        state = torch.get_rng_state()
        parallm.init_parallel()
        assert torch.equal(torch.get_rng_state(), state) and torch.initial_seed() == 1234
        parallm.init_parallel(seed=7)
        assert torch.initial_seed() == 7
        first = torch.rand(4)
        parallm.init_parallel(seed=7)
        assert torch.equal(torch.rand(4), first)
        for bad in (-1, True, 1.5, "7"):
            with pytest.raises(ValueError, match="seed must be None or a non-negative integer"):
                parallm.init_parallel(seed=bad)
    finally:
        parallm.destroy_parallel()
        dist.destroy_process_group()
