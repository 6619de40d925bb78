"""Reliability: bad inputs and dying ranks end in a clear error on every rank, within a time bound.

Every failing call must (a) raise on *every* rank (a rank that fails alone leaves its peers blocked in the next
collective), (b) name the culprit in its message, and (c) end within ``BOUND_S`` seconds on each rank (measured
inside the ranks). Four kinds of checks, each in as few spawns as possible (starting ranks costs seconds):

* the catalog: bad inputs through the public API (one 4-rank spawn, every case timed on every rank);
* the fuzz: safetensors files with corrupted headers (byte changes, truncations, absurd header lengths, a
  dtype the layout allows), loaded in slice and broadcast mode, all seeds in one 2-rank spawn; never a hang, a
  crash or a rank out of step;
* a rank killed (``os._exit``) in the middle of ``save_hf_weights(..., overwrite=True)``: the old checkpoint
  stays byte-identical and the survivors raise within the bound;
* a rank killed in the middle of ``load_hf_weights`` (broadcast: a receiver and the reader; slice): the survivors
  raise within the bound. Survivors wait for each other (a file barrier, not torch.distributed) before they
  exit, so a survivor that could only end because another survivor's process exited is caught as a hang.

Overlap with test_load_errors.py (which checks messages for state dicts and directories in both modes) is kept
to the cases the reliability catalog must time.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time

import pytest
import torch

from helpers import (write_ckpt, write_config, file_barrier, hf_state_dict, make_hf_model, nan_fill, padded_batch, run_ranks, run_ranks_allow_dead,
                     save_checkpoint, tiny_config, tree_digest)
from helpers import max_diff_real as helpers_max_diff

BOUND_S = 60.0          # a failing call must end within this many seconds on every rank
WORLD = 4
MODES = ("slice", "broadcast")
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

K0 = "model.layers.0.self_attn.k_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"
EMB = "model.embed_tokens.weight"
EXTRA = "model.layers.0.self_attn.q_norm.weight"


# -- building bad checkpoints --------------------------------------------------------------------------------

def _write_bytes_ckpt(path, data: bytes, config: dict) -> str:
    write_config(path, config)
    with open(os.path.join(path, SINGLE), "wb") as f:
        f.write(data)
    return str(path)


def _write_index(path, good_file: str, config: dict, weight_map_override: dict) -> str:
    """A sharded-style checkpoint: one real shard plus an index, with some entries redirected."""
    write_config(path, config)
    shard = "model-00001-of-00002.safetensors"
    shutil.copy(good_file, os.path.join(path, shard))
    from safetensors import safe_open
    with safe_open(good_file, framework="pt") as h:
        keys = list(h.keys())
    weight_map = {k: shard for k in keys}
    weight_map.update(weight_map_override)
    with open(os.path.join(path, INDEX), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(path)


def _header_len(data: bytes) -> int:
    return int.from_bytes(data[:8], "little")


def _with_header_len(data: bytes, n: int) -> bytes:
    return (n % 2 ** 64).to_bytes(8, "little") + data[8:]


# name -> (expected exception type, needles every rank's message must contain); per mode where "{mode}" appears
DIR_CASES = {
    "missing": ("CheckpointError", ["missing", DOWN1]),
    "unexpected": ("CheckpointError", ["unexpected", EXTRA, "strict=False"]),
    "misshaped": ("CheckpointError", [K0, "(16, 64)", "(32, 64)"]),
    "truncated": ("CheckpointError", [os.path.join("ckpt-truncated", SINGLE)]),
    "garbage-header": ("CheckpointError", [os.path.join("ckpt-garbage-header", SINGLE)]),
    "index-outside": ("CheckpointError", [INDEX, EMB, "../x.safetensors", "outside"]),
    "index-missing-file": ("CheckpointError", [INDEX, EMB, "model-00002-of-00002.safetensors", "does not exist"]),
    "pickle-refused": ("CheckpointError", ["pytorch_model.bin", "allow_pickle=True"]),
}

CATALOG = {
    # before init_parallel (torch.distributed is up, the parallel groups are not)
    "before-init/build_model": ("RuntimeError", ["build_model", "init_parallel"]),
    "before-init/load_hf_weights": ("RuntimeError", ["load_hf_weights", "init_parallel"]),
    "before-init/save_hf_weights": ("RuntimeError", ["save_hf_weights", "init_parallel"]),
    "before-init/forward": ("RuntimeError", ["forward", "init_parallel"]),
    "before-init/forward_backward": ("RuntimeError", ["forward_backward", "init_parallel"]),
    # parallel layout
    "world-not-tp-pp-dp": ("ValueError", ["world size 4", "tp*cp*pp*dp", "tp=3 x cp=1 x pp=1"]),
    "layers-not-pp": ("ValueError", ["3 layers", "pp=2"]),
    "layers-not-pp-vpp": ("ValueError", ["2 layers", "pp=2", "vpp=2"]),
    "unsupported-arch": ("ValueError", ["GemmaForCausalLM", "LlamaForCausalLM"]),
    "not-divisible-by-tp": ("ValueError", ["intermediate_size=90", "tp=4"]),
    # context parallelism
    "world-not-tp-cp-pp-dp": ("ValueError", ["world size 4", "cp=3"]),
    "ep-not-dp-cp": ("ValueError", ["ep=3", "dp=2 x cp=2"]),
    "cp-attn-unknown": ("ValueError", ["cp_attn", "'nope'", "ring"]),
    "cp-batch-differs/forward": ("ValueError", ["forward", "context-parallel", "rank 1's differs from rank 0's"]),
    "cp-batch-differs/forward_backward": ("ValueError", ["forward_backward", "context-parallel",
                                                         "rank 3's differs from rank 2's"]),
    # a sliding window counted over real tokens (packed / cp) where transformers counts positions: refused
    "window-hole/forward": ("ValueError", ["row 0", "padding between its real tokens", "sliding window of 4"]),
    # saving into a non-empty directory without overwrite=True
    "save-nonempty": ("FileExistsError", ["atomic", "target", "overwrite=True"]),
    # a loss_fn returning a non-scalar: the shape it got
    "loss-not-scalar": ("ValueError", ["loss_fn must return a scalar tensor", "got a tensor of shape (4, 10)"]),
    "loss-sum-not-scalar": ("ValueError", ["scalar loss_sum", "got a loss_sum of a tensor of shape (4,)"]),
}
for _name, _expect in DIR_CASES.items():
    for _mode in MODES:
        CATALOG[f"{_name}/{_mode}"] = _expect
for _mode in MODES:
    CATALOG[f"overflow-fp16/{_mode}"] = ("CheckpointError", ["overflow", DOWN1, "float16"])
for _mode in ("broadcast", "auto"):  # a state dict on rank 0 only, None elsewhere
    CATALOG[f"dict-rank0-missing/{_mode}"] = ("CheckpointError", ["missing", DOWN1])


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability")
    model = make_hf_model(tiny_config("llama"), seed=3)
    good = save_checkpoint(model, str(root / "good"))
    good_file = os.path.join(good, SINGLE)
    with open(os.path.join(good, "config.json")) as f:
        config = json.load(f)
    with open(good_file, "rb") as f:
        good_bytes = f.read()
    sd = hf_state_dict(model)
    dirs = {}

    def broken(name, fn):
        state = dict(sd)
        fn(state)
        dirs[name] = write_ckpt(root / f"ckpt-{name}", state, config)

    broken("missing", lambda s: s.pop(DOWN1))
    broken("unexpected", lambda s: s.__setitem__(EXTRA, torch.ones(16)))
    broken("misshaped", lambda s: s.__setitem__(K0, torch.randn(16, 64)))
    overflow = dict(sd)
    overflow[DOWN1] = overflow[DOWN1].clone()
    overflow[DOWN1][0, 0] = 1e6
    dirs["overflow"] = write_ckpt(root / "ckpt-overflow", overflow, config)
    dirs["truncated"] = _write_bytes_ckpt(root / "ckpt-truncated", good_bytes[:int(len(good_bytes) * 0.6)], config)
    n = _header_len(good_bytes)
    garbage = random.Random(0).randbytes(n)
    dirs["garbage-header"] = _write_bytes_ckpt(root / "ckpt-garbage-header",
                                               good_bytes[:8] + garbage + good_bytes[8 + n:], config)
    shutil.copy(good_file, root / "x.safetensors")  # exists, but outside the checkpoint directory
    dirs["index-outside"] = _write_index(root / "ckpt-index-outside", good_file, config,
                                         {EMB: "../x.safetensors"})
    dirs["index-missing-file"] = _write_index(root / "ckpt-index-missing-file", good_file, config,
                                              {EMB: "model-00002-of-00002.safetensors"})
    pickle_dir = write_config(root / "ckpt-pickle", config)
    torch.save(sd, os.path.join(pickle_dir, "pytorch_model.bin"))
    dirs["pickle-refused"] = dirs["pickle"] = pickle_dir
    unsupported = write_config(root / "gemma", dict(config, architectures=["GemmaForCausalLM"],
                                                   model_type="gemma"))
    layers3 = write_config(root / "layers3", dict(config, num_hidden_layers=3))
    split = write_config(root / "split-intermediate", dict(config, intermediate_size=90))
    window = write_ckpt(root / "window", sd, dict(config, architectures=["MistralForCausalLM"], model_type="mistral",
                                                  sliding_window=4))
    # the atomic-save target holds an older, valid checkpoint
    target = save_checkpoint(make_hf_model(tiny_config("llama"), seed=5), str(root / "atomic" / "target"))
    missing_sd = dict(sd)
    missing_sd.pop(DOWN1)
    ids, mask = padded_batch(config["vocab_size"])
    return dict(root=str(root), good=good, good_file=good_file, good_bytes=good_bytes, config=config, sd=sd,
                dirs=dirs, unsupported=unsupported, layers3=layers3, split=split, target=target, missing_sd=missing_sd,
                ids=ids, mask=mask, window=window)


# -- the catalog: one 4-rank spawn ---------------------------------------------------------------------------

def _catalog_rank(rank, world, s):
    import parallm
    out = {}

    def attempt(key, fn):
        t = time.monotonic()
        try:
            fn()
            err = None
        except Exception as e:  # noqa: BLE001
            err = (type(e).__name__, str(e))
        out[key] = (err, time.monotonic() - t)

    ids, mask = s["ids"], s["mask"]
    loss_fn = lambda o, i, m: o.float().mean()  # noqa: E731
    attempt("before-init/build_model", lambda: parallm.build_model(s["good"]))
    attempt("before-init/load_hf_weights", lambda: parallm.load_hf_weights([], s["good"]))
    attempt("before-init/save_hf_weights", lambda: parallm.save_hf_weights([], os.path.join(s["root"], "nope")))
    attempt("before-init/forward", lambda: parallm.forward([], ids, mask))
    attempt("before-init/forward_backward", lambda: parallm.forward_backward([], ids, mask, loss_fn=loss_fn))
    attempt("world-not-tp-pp-dp", lambda: parallm.init_parallel(tp=3))

    parallm.init_parallel(tp=1, pp=2)
    attempt("layers-not-pp", lambda: parallm.build_model(s["layers3"]))
    parallm.init_parallel(tp=1, pp=2, vpp=2)
    attempt("layers-not-pp-vpp", lambda: parallm.build_model(s["good"]))
    parallm.init_parallel(tp=1)
    attempt("unsupported-arch", lambda: parallm.build_model(s["unsupported"]))
    parallm.init_parallel(tp=4)
    attempt("not-divisible-by-tp", lambda: parallm.build_model(s["split"]))
    attempt("world-not-tp-cp-pp-dp", lambda: parallm.init_parallel(cp=3))
    attempt("ep-not-dp-cp", lambda: parallm.init_parallel(cp=2, ep=3))
    parallm.init_parallel(cp=2)       # cp groups [0, 1] and [2, 3]: each holds one batch
    attempt("cp-attn-unknown", lambda: parallm.build_model(s["good"], cp_attn="nope"))
    cp_chunks = parallm.build_model(s["good"])
    parallm.load_hf_weights(cp_chunks, s["good"])
    other = ids.clone()
    other[0, 3] = (other[0, 3] + 1) % s["config"]["vocab_size"]       # one token differs
    attempt("cp-batch-differs/forward", lambda: parallm.forward(cp_chunks, other if rank == 1 else ids, mask))
    attempt("cp-batch-differs/forward_backward", lambda: parallm.forward_backward(
        cp_chunks, ids, mask, loss_fn=loss_fn, position_ids=parallm.default_position_ids(mask) + (rank == 3)))
    with torch.no_grad():     # and the ranks are in step afterwards
        out["cp-after-error"] = parallm.forward(cp_chunks, ids, mask)
    cp_chunks = None      # freed
    win_chunks = parallm.build_model(s["window"], packed=True)     # cp2, a sliding window of 4
    parallm.load_hf_weights(win_chunks, s["window"])
    holed = mask.clone()
    holed[0, 4] = 0            # row 0: 9 real tokens over 10 positions, on the second CP group only
    attempt("window-hole/forward", lambda: parallm.forward(win_chunks, ids, holed if rank >= 2 else mask))
    win_chunks = None

    parallm.init_parallel(tp=2)  # dp=2: broadcast reaches replicas too
    chunks = parallm.build_model(s["good"])
    chunks16 = parallm.build_model(s["good"], dtype=torch.float16)
    dirs = s["dirs"]
    for mode in MODES:
        nan_fill(chunks)
        parallm.load_hf_weights(chunks, s["good"], mode=mode)
        with torch.no_grad():
            ref = parallm.forward(chunks, ids, mask)
        for name in DIR_CASES:
            attempt(f"{name}/{mode}", lambda: parallm.load_hf_weights(chunks, dirs[name], mode=mode))
        attempt(f"overflow-fp16/{mode}", lambda: parallm.load_hf_weights(chunks16, dirs["overflow"], mode=mode))
        # opt-outs load exactly what the safetensors checkpoint holds
        for key, kwargs, source in ((f"non-strict/{mode}", dict(strict=False), dirs["unexpected"]),
                                    (f"pickle-allowed/{mode}", dict(allow_pickle=True), dirs["pickle"])):
            nan_fill(chunks)
            attempt(key, lambda: parallm.load_hf_weights(chunks, source, mode=mode, **kwargs))
            with torch.no_grad():
                out[key + "/equal"] = bool(torch.equal(parallm.forward(chunks, ids, mask), ref))
    for mode in ("broadcast", "auto"):
        attempt(f"dict-rank0-missing/{mode}", lambda: parallm.load_hf_weights(
            chunks, s["missing_sd"] if rank == 0 else None, mode=mode))

    # atomic save: refused without overwrite (target untouched), then replaced with overwrite=True
    parallm.load_hf_weights(chunks, s["good"], mode="slice")
    before = tree_digest(s["target"])
    attempt("save-nonempty", lambda: parallm.save_hf_weights(chunks, s["target"]))
    out["save-nonempty/unchanged"] = tree_digest(s["target"]) == before
    attempt("save-overwrite", lambda: parallm.save_hf_weights(chunks, s["target"], overwrite=True))
    attempt("loss-not-scalar", lambda: parallm.forward_backward(chunks, ids, mask,
                                                                loss_fn=lambda o, i, m: o.float().mean(-1)))
    attempt("loss-sum-not-scalar", lambda: parallm.forward_backward(
        chunks, ids, mask, loss_fn=lambda o, i, m: (o.float().sum((1, 2)), 3)))

    # after all those errors the ranks are still in step: a good load and a forward give the reference
    nan_fill(chunks)
    parallm.load_hf_weights(chunks, s["good"], mode="broadcast")
    with torch.no_grad():
        out["final-equal"] = bool(torch.equal(parallm.forward(chunks, ids, mask), ref))
    out["cp-after-error-close"] = helpers_max_diff(out.pop("cp-after-error"), ref, mask) < 2e-5
    return out


@pytest.fixture(scope="module")
def catalog(ckpts):
    t = time.monotonic()
    res = run_ranks(_catalog_rank, WORLD, ckpts, timeout=180)
    print(f"catalog spawn: {time.monotonic() - t:.1f}s")
    for key in CATALOG:  # the catalog of messages (pytest -s shows it)
        for rank in (0, 1):
            err, elapsed = res[rank][key]
            print(f"{key} rank {rank} ({elapsed:.2f}s): {err}")
    return res


def _check_raised(results, key, etype, needles):
    failures = []
    for rank, res in enumerate(results):
        err, elapsed = res[key]
        if elapsed >= BOUND_S:
            failures.append(f"{key}: rank {rank} took {elapsed:.1f}s (bound {BOUND_S:.0f}s)")
        if err is None:
            failures.append(f"{key}: rank {rank} did not raise")
            continue
        name, msg = err
        if name != etype:
            failures.append(f"{key}: rank {rank} raised {name}, expected {etype}: {msg}")
        missing = [n for n in needles if n not in msg]
        if missing:
            failures.append(f"{key}: rank {rank} message lacks {missing}: {msg}")
    assert not failures, "\n".join(failures)


def _check_ok(results, key):
    errors = [(rank, res[key][0]) for rank, res in enumerate(results) if res[key][0] is not None]
    assert not errors, f"{key}: {errors}"
    assert all(res[key][1] < BOUND_S for res in results), [res[key][1] for res in results]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", list(CATALOG))
def test_catalog(catalog, key):
    etype, needles = CATALOG[key]
    _check_raised(catalog, key, etype, needles)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("opt_out", ["non-strict", "pickle-allowed"])
def test_opt_outs_load_exactly(catalog, opt_out, mode):
    """strict=False ignores the unexpected tensor; allow_pickle=True reads pytorch_model.bin; both give the same
    forward as the safetensors checkpoint, bit for bit (parameters were NaN before the load)."""
    key = f"{opt_out}/{mode}"
    _check_ok(catalog, key)
    assert all(res[key + "/equal"] for res in catalog), [res[key + "/equal"] for res in catalog]


@pytest.mark.timeout(300)
def test_atomic_save_basics(catalog, ckpts):
    """Refused save leaves the target as it was; an overwrite replaces it and leaves no temp dir beside it."""
    assert all(res["save-nonempty/unchanged"] for res in catalog)
    _check_ok(catalog, "save-overwrite")
    parent = os.path.dirname(ckpts["target"])
    assert sorted(os.listdir(parent)) == ["target"], os.listdir(parent)
    from safetensors.torch import load_file
    saved = {}
    for f in os.listdir(ckpts["target"]):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(ckpts["target"], f)))
    assert sorted(saved) == sorted(ckpts["sd"])
    assert all(torch.equal(saved[k], ckpts["sd"][k]) for k in saved)


@pytest.mark.timeout(300)
def test_ranks_in_step_after_catalog(catalog):
    assert all(res["final-equal"] for res in catalog)
    assert all(res["cp-after-error-close"] for res in catalog)   # the cp2 model after its errors


@pytest.mark.timeout(60)
def test_before_init_without_torch_distributed(ckpts, monkeypatch):
    """In a plain process (no torch.distributed at all): clear RuntimeErrors, immediately, no hang."""
    import torch.distributed as dist

    import parallm
    assert not dist.is_initialized()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="init_parallel"):
        parallm.build_model(ckpts["good"])
    with pytest.raises(RuntimeError, match="init_parallel"):
        parallm.load_hf_weights([], ckpts["good"])
    with pytest.raises(RuntimeError, match="RANK"):
        parallm.init_parallel(tp=1)
    assert time.monotonic() - t < 10
    assert not dist.is_initialized()


def _reinit_rank(rank, world, port):
    """Leave the spawn's process group, then let parallm create its own from the environment, three times over
    (destroy_parallel in between), checking each group with an all-reduce."""
    import torch.distributed as dist

    import parallm
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    sums = []
    for i in range(3):
        parallm.init_parallel(tp=world, timeout_s=30)
        x = torch.tensor([float(rank + i)])
        dist.all_reduce(x)
        sums.append(x.item())
        parallm.destroy_parallel()
        assert not dist.is_initialized()
    return sums


@pytest.mark.timeout(120)
def test_init_destroy_init_from_the_environment():
    """A process group parallm created from MASTER_ADDR / MASTER_PORT can be destroyed and created again in the
    same processes (once failed with "connection refused": the second group read the first one's addresses)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = run_ranks(_reinit_rank, 2, port, timeout=100)
    assert results == [[1.0, 3.0, 5.0]] * 2


# -- fuzz: corrupted safetensors headers, all seeds in one 2-rank spawn --------------------------------------

FUZZ_WORLD = 2


def _fuzz_cases(good_bytes: bytes) -> list[tuple[str, bytes]]:
    n, size = _header_len(good_bytes), len(good_bytes)
    header = good_bytes[8:8 + n]
    digits = [8 + i for i, c in enumerate(header) if chr(c).isdigit()]
    letters = [8 + i for i, c in enumerate(header) if chr(c).isalpha()]
    printable = b'{}[]":,. _0123456789abcdefghijklmnopqrstuvwxyzABCDEFGIUZ'
    cases = []
    # Random byte changes in the header: arbitrary bytes (the first two seeds also hit the length field), then
    # printable characters (past the UTF-8 check, into JSON parsing), digits (shapes, data_offsets), letters
    # (tensor names, dtypes, metadata).
    for seed in range(20):
        rng = random.Random(seed)
        data = bytearray(good_bytes)
        for _ in range(rng.randint(1, 3)):
            if seed < 6:
                pos = rng.randrange(0 if seed < 2 else 8, 8 + n)
                data[pos] = (data[pos] + rng.randrange(1, 256)) % 256
            elif seed < 10:
                pos = rng.randrange(8, 8 + n)
                data[pos] = rng.choice([c for c in printable if c != data[pos]])
            elif seed < 15:
                pos = rng.choice(digits)
                data[pos] = rng.choice([c for c in b"0123456789" if c != data[pos]])
            else:
                pos = rng.choice(letters)
                data[pos] = rng.choice([c for c in b"abcdefghijklmnopqrstuvwxyzFIU" if c != data[pos]])
        cases.append((f"flip-{seed}", bytes(data)))
    # a change safetensors still reads as the original tensors (the metadata's format value): must load, exactly
    at = good_bytes.index(b'"format":"pt"', 8)
    cases.append(("metadata-format", good_bytes[:at] + b'"format":"px"' + good_bytes[at + 13:]))
    # a dtype the header can claim without breaking the layout: F32 -> I32 (same size) on one tensor
    at = good_bytes.index(b'"F32"', 8)
    cases.append(("dtype-I32", good_bytes[:at] + b'"I32"' + good_bytes[at + 5:]))
    for seed in range(10):  # truncations: in the length field, in the header, in the data
        rng = random.Random(100 + seed)
        end = rng.randrange(0, 8) if seed < 2 else rng.randrange(8, 8 + n) if seed < 6 else rng.randrange(8 + n,
                                                                                                          size)
        cases.append((f"trunc-{seed}", good_bytes[:end]))
    for label, value in (("zero", 0), ("one", 1), ("seven", 7), ("n-1", n - 1), ("n+1", n + 1),
                         ("n+8", n + 8), ("rest", size - 8), ("size", size), ("2^27", 2 ** 27), ("2^32", 2 ** 32),
                         ("2^63-1", 2 ** 63 - 1), ("2^64-1", 2 ** 64 - 1)):
        cases.append((f"hlen-{label}", _with_header_len(good_bytes, value)))
    return cases


@pytest.fixture(scope="module")
def fuzz(ckpts):
    root = os.path.join(ckpts["root"], "fuzz")
    cases = []
    for i, (label, data) in enumerate(_fuzz_cases(ckpts["good_bytes"])):
        name = f"fuzz-{i:02d}-{label}"
        cases.append((name, _write_bytes_ckpt(os.path.join(root, name), data, ckpts["config"])))
    t = time.monotonic()
    res = run_ranks(_fuzz_rank, FUZZ_WORLD, ckpts, cases, timeout=180)
    print(f"fuzz spawn ({len(cases)} cases x {len(MODES)} modes): {time.monotonic() - t:.1f}s")
    return cases, res


def _safetensors_meta(path):
    from safetensors import safe_open
    with safe_open(path, framework="pt") as h:
        return {k: (tuple(h.get_slice(k).get_shape()), h.get_slice(k).get_dtype()) for k in h.keys()}


def _fuzz_rank(rank, world, s, cases):
    import torch.distributed as dist

    import parallm
    parallm.init_parallel(tp=2)
    chunks = parallm.build_model(s["good"])
    parallm.load_hf_weights(chunks, s["good"], mode="slice")
    with torch.no_grad():
        ref = parallm.forward(chunks, s["ids"], s["mask"])
    out = {"valid": {}, "loads": {}, "step": [], "loaded-equal": {}}
    if rank == 0:  # which corrupted files safetensors itself still reads as the original tensors
        want = _safetensors_meta(s["good_file"])
        for name, path in cases:
            try:
                out["valid"][name] = _safetensors_meta(os.path.join(path, SINGLE)) == want
            except Exception:  # noqa: BLE001
                out["valid"][name] = False
    for name, path in cases:
        for mode in MODES:
            nan_fill(chunks)  # a load that succeeds must fill every parameter with the checkpoint's values
            t = time.monotonic()
            try:
                parallm.load_hf_weights(chunks, path, mode=mode)
                err = None
            except Exception as e:  # noqa: BLE001
                err = (type(e).__name__, str(e))
            out["loads"][(name, mode)] = (err, time.monotonic() - t)
            where = [None] * world
            dist.all_gather_object(where, (name, mode, err is None))  # every rank reached the same point
            out["step"].append(all(w[:2] == (name, mode) for w in where))
            if all(w[2] for w in where):  # loaded everywhere: the model is the original one, bit for bit
                with torch.no_grad():
                    out["loaded-equal"][(name, mode)] = bool(torch.equal(parallm.forward(chunks, s["ids"], s["mask"]),
                                                                         ref))
    nan_fill(chunks)
    parallm.load_hf_weights(chunks, s["good"], mode="broadcast")
    with torch.no_grad():
        out["final-equal"] = bool(torch.equal(parallm.forward(chunks, s["ids"], s["mask"]), ref))
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", MODES)
def test_fuzz_corrupt_header(fuzz, mode):
    """Every corrupted header: a clean exception on every rank naming the file (or, where safetensors still reads
    the original tensors, a successful load everywhere), within the bound, all ranks in step."""
    cases, results = fuzz
    valid = results[0]["valid"]
    failures = []
    for name, path in cases:
        outcomes = [res["loads"][(name, mode)] for res in results]
        print(f"{name} [{mode}] valid={valid[name]}: " + " | ".join(  # the catalog of messages (pytest -s)
            f"rank {r} {el:.2f}s {str(err).replace(os.path.dirname(path) + os.sep, '')}"
            for r, (err, el) in enumerate(outcomes)))
        slow = [f"rank {r}: {el:.1f}s" for r, (_, el) in enumerate(outcomes) if el >= BOUND_S]
        if slow:
            failures.append(f"{name}: too slow: {slow}")
        if valid[name]:
            if any(err is not None for err, _ in outcomes):
                failures.append(f"{name}: safetensors reads it, but parallm raised: {outcomes}")
            elif not all(res["loaded-equal"].get((name, mode)) for res in results):
                failures.append(f"{name}: loaded without an error, but the forward differs from the original "
                                "checkpoint's")
            continue
        for rank, (err, _) in enumerate(outcomes):
            if err is None:
                failures.append(f"{name}: rank {rank} loaded without an error a file whose header no longer "
                                "describes the original tensors (names, shapes or dtypes differ)")
                continue
            etype, msg = err
            if etype != "CheckpointError" or name not in msg:
                failures.append(f"{name}: rank {rank}: {etype}: {msg}")
        if len({err[0] for err, _ in outcomes if err is not None}) > 1:
            failures.append(f"{name}: exception types differ across ranks: {[e for e, _ in outcomes]}")
    assert all(all(res["step"]) for res in results), "ranks fell out of step"
    assert all(res["final-equal"] for res in results), "a good load after the corrupted ones differs"
    assert not failures, "\n".join(failures)


# -- killed ranks --------------------------------------------------------------------------------------------

KILL_SPAWN_TIMEOUT_S = 90   # faulthandler ends a hung rank at 75 s, after the survivors' file barrier (61 s)


def _arm(patch: str, calls: int):
    """Make this process die (os._exit(1)) on the ``calls``-th call of ``patch``."""
    import parallm.checkpoint.loader as loader
    import parallm.checkpoint.saver as saver
    import torch.distributed as dist
    owner, attr = {"write_block": (saver, "_write_block"), "make_shard": (loader, "make_shard"),
                   "fill": (loader, "_fill_from_blocks"),
                   "recv": (dist, "recv")}[patch]
    original = getattr(owner, attr)
    count = [0]

    def dying(*args, **kwargs):
        count[0] += 1
        if count[0] >= calls:
            os._exit(1)
        return original(*args, **kwargs)
    setattr(owner, attr, dying)


def _killed_rank(rank, world, s, op, victim, patch, barrier_dir):
    import parallm
    parallm.init_parallel(tp=2)  # dp=2
    chunks = parallm.build_model(s["good"])
    parallm.load_hf_weights(chunks, s["good"], mode="slice")
    if rank == victim:
        _arm(patch, calls=3)  # dies midway: after some of its bytes are written
    t = time.monotonic()
    try:
        if op == "save":
            parallm.save_hf_weights(chunks, s["target"], overwrite=True)
        else:
            parallm.load_hf_weights(chunks, s["good"], mode=op)
        err = None
    except Exception as e:  # noqa: BLE001
        err = (type(e).__name__, str(e))
    elapsed = time.monotonic() - t
    survivors = [r for r in range(world) if r != victim]
    # stay alive until every survivor has ended (or the bound has passed), as a process that handles the error would
    all_done = file_barrier(barrier_dir, rank, survivors, deadline=t + BOUND_S + 1)
    return dict(err=err, elapsed=elapsed, all_done=all_done)


def _survivor_failures(outcomes, victim, label) -> list[str]:
    """What is wrong with the survivors (and the victim), as a list; prints each survivor's outcome."""
    failures, report = [], []
    if outcomes[victim] != ("dead", 1):
        failures.append(f"the victim rank {victim} did not die as planned: {outcomes[victim]}")
    for rank, (status, value) in enumerate(outcomes):
        if rank == victim:
            continue
        if status != "ok":
            failures.append(f"rank {rank}: {status} ({str(value)[-2000:]}) - hung past the faulthandler watchdog "
                            "or crashed")
            continue
        report.append(f"rank {rank}: {value['elapsed']:.1f}s {value['err']}")
        if value["err"] is None:
            failures.append(f"rank {rank} returned normally although rank {victim} died")
        elif not value["err"][1].strip():
            failures.append(f"rank {rank} raised {value['err'][0]} with an empty message")
        if value["elapsed"] >= BOUND_S:
            failures.append(f"rank {rank} took {value['elapsed']:.1f}s to raise (bound {BOUND_S:.0f}s)")
    print(f"{label}: " + "; ".join(report))
    return [f"{label}: {f}" for f in failures] + report if failures else []


@pytest.mark.timeout(240)
def test_killed_rank_during_save_keeps_old_checkpoint(ckpts, tmp_path):
    """A writer dies midway through save_hf_weights(overwrite=True): the older checkpoint in out_dir is
    byte-identical afterwards, no temp dir is left beside it, and the survivors raise within the bound."""
    target = save_checkpoint(make_hf_model(tiny_config("llama"), seed=6), str(tmp_path / "out" / "target"))
    before = tree_digest(target)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    victim = 1  # TP rank 1 of data-parallel replica 0: a writer (of its own shards' bytes)
    t = time.monotonic()
    outcomes = run_ranks_allow_dead(_killed_rank, WORLD, dict(ckpts, target=target), "save", victim,
                                    "write_block", str(barrier), timeout=KILL_SPAWN_TIMEOUT_S)
    print(f"killed save spawn: {time.monotonic() - t:.1f}s")
    failures = _survivor_failures(outcomes, victim, "killed save")
    after = tree_digest(target)
    if after != before:
        failures.append(f"the older checkpoint in out_dir changed: {sorted(set(before.items()) ^ set(after.items()))}")
    leftovers = sorted(set(os.listdir(tmp_path / "out")) - {"target"})
    if leftovers:
        failures.append(f"temp dirs left beside out_dir: {leftovers}")
    assert not failures, "\n".join(failures)


KILLED_LOADS = {
    "broadcast-receiver": ("broadcast", 1, "recv"),       # rank 1 dies on its 3rd receive
    "broadcast-reader": ("broadcast", 0, "make_shard"),   # rank 0 (the reader) dies cutting its 3rd shard
    "slice": ("slice", 2, "fill"),                        # rank 2 dies reading its 3rd parameter
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(KILLED_LOADS))
def test_killed_rank_during_load(ckpts, tmp_path, case):
    op, victim, patch = KILLED_LOADS[case]
    t = time.monotonic()
    outcomes = run_ranks_allow_dead(_killed_rank, WORLD, ckpts, op, victim, patch, str(tmp_path),
                                    timeout=KILL_SPAWN_TIMEOUT_S)
    print(f"killed load ({case}) spawn: {time.monotonic() - t:.1f}s")
    failures = _survivor_failures(outcomes, victim, f"killed load ({case})")
    assert not failures, "\n".join(failures)
