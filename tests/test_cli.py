"""The ``parallm`` command line, end to end in subprocesses: demo, verify (good / broken checkpoints, crashed and
hung ranks, torchrun), inspect, and ``--help`` of every command.

Independent commands run concurrently (each subprocess pays the torch / megatron-core import once), so the file
stays well under a minute and a half on a 2-core machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import helpers

PY = sys.executable
TORCHRUN = os.path.join(os.path.dirname(PY), "torchrun")
DOWN1 = "model.layers.1.mlp.down_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"


def run_many(commands, *, timeout=240):
    """Run ``[(argv, extra_env), ...]`` concurrently; return [(returncode, stdout, stderr, seconds)]."""
    procs = []
    for argv, extra in commands:
        env = dict(os.environ, OMP_NUM_THREADS="1", **(extra or {}))
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        procs.append((subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env),
                      time.monotonic()))
    out = []
    for p, t0 in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            pytest.fail(f"{p.args} did not finish within {timeout} s:\n{stdout}\n{stderr}")
        out.append((p.returncode, stdout, stderr, time.monotonic() - t0))
    return out


def parallm(*args):
    return [PY, "-m", "parallm", *args]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A good tiny LLaMA checkpoint (4 layers, GQA, vocab 101, biases), one missing a tensor, one with a
    mis-shaped tensor."""
    root = tmp_path_factory.mktemp("cli")
    cfg = helpers.tiny_config("llama", num_hidden_layers=4, attention_bias=True)
    good = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=5), str(root / "good"))
    sd = load_file(os.path.join(good, "model.safetensors"))
    missing = str(root / "missing")
    shutil.copytree(good, missing)
    save_file({k: v for k, v in sd.items() if k != DOWN1}, os.path.join(missing, "model.safetensors"),
              metadata={"format": "pt"})
    shape = str(root / "shape")
    shutil.copytree(good, shape)
    save_file(dict(sd, **{K0: torch.zeros(16, 64)}), os.path.join(shape, "model.safetensors"),
              metadata={"format": "pt"})
    return dict(good=good, missing=missing, shape=shape, root=root)


def in_process(capsys, *args):
    """``parallm ARGS`` in this process (for the fast paths: help, usage errors): (exit code, stdout, stderr)."""
    from parallm.cli import main
    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.timeout(120)
def test_help_of_every_command(capsys):
    script = os.path.join(os.path.dirname(PY), "parallm")
    argv = ([script] if os.path.exists(script) else parallm()) + ["--help"]
    [(c0, top, _, _)] = run_many([(argv, None)])
    assert c0 == 0
    for cmd in ("demo", "verify", "inspect"):
        assert cmd in top
    c1, demo, _ = in_process(capsys, "demo", "--help")
    c2, verify, _ = in_process(capsys, "verify", "--help")
    c3, insp, _ = in_process(capsys, "inspect", "--help")
    assert (c1, c2, c3) == (0, 0, 0)
    assert "--quick" in demo and "--workdir" in demo and "torchrun" in demo
    for opt in ("--tp", "--pp", "--vpp", "--dp", "--packed", "--sequence-parallel", "--task", "--mode",
                "--timeout", "--device", "--lr", "--atol", "exit codes"):
        assert opt in verify, opt
    for opt in ("--tp", "--pp", "--vpp", "--json"):
        assert opt in insp, opt
    assert in_process(capsys,)[0] == 2                          # no command: usage, exit 2
    assert in_process(capsys, "verify", "x", "--tp", "0")[0] == 2  # argparse rejects it


@pytest.mark.timeout(180)
def test_demo_quick(tmp_path):
    out = tmp_path / "demo.json"
    [(code, stdout, stderr, seconds)] = run_many([(parallm("demo", "--quick", "--json", str(out)), None)])
    print(stdout, stderr, f"{seconds:.1f} s", sep="\n")
    assert code == 0, stdout + stderr
    assert "OK: 2 layout(s) match transformers" in stdout
    assert "max|Δ out|" in stdout and "load s" in stdout
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["rows"]) == 2
    for row in report["rows"]:
        print(row["layout"], {k: row[k] for k in ("d_out", "d_loss", "d_weights", "d_after")})
        # the command's own tolerances (--atol 1e-4) leave room for other machines; here, the suite's fp32 bound
        assert row["ok"] and row["reload"] and row["roundtrip"], row
        assert max(row["d_out"], row["d_loss"], row["d_after"], row["d_weights"]) < 2e-5, row
    assert {r["layout"] for r in report["rows"]} == {"tp2 dp2 slice", "tp2 pp2 packed+SP value"}
    assert "Traceback" not in stderr


@pytest.mark.timeout(240)
def test_verify_good_and_broken(ckpts, tmp_path, capsys):
    save = tmp_path / "saved"
    results = run_many([
        (parallm("verify", ckpts["good"], "--tp", "2", "--json", str(tmp_path / "v.json"), "--save-dir",
                 str(save)), None),
        (parallm("verify", ckpts["missing"], "--tp", "2"), None),
        # the ranks' loader (not the launcher's preflight) finds it, and every rank agrees on the error
        (parallm("verify", ckpts["shape"], "--tp", "2", "--no-preflight"), None),
    ])
    (good, gout, gerr, _), (miss, _, merr, _), (shp, _, serr, _) = results
    # layouts that do not split, bad option combinations: found before any rank starts
    tp3, _, terr = in_process(capsys, "verify", ckpts["good"], "--tp", "3")
    vpp, _, verr = in_process(capsys, "verify", ckpts["good"], "--vpp", "2")
    assert good == 0, gout + gerr
    assert "OK: 1 layout(s) match transformers" in gout
    row = json.loads((tmp_path / "v.json").read_text())["rows"][0]
    print(row["layout"], {k: row[k] for k in ("d_out", "d_loss", "d_weights", "d_after")})
    assert row["layout"] == "tp2" and row["ok"] and row["reload"] and row["roundtrip"], row
    assert max(row["d_out"], row["d_loss"], row["d_after"], row["d_weights"]) < 2e-5, row
    import transformers
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(save))  # --save-dir kept
    assert reloaded.config.num_hidden_layers == 4

    assert miss == 1
    assert "error:" in merr and "missing" in merr and DOWN1 in merr
    assert shp == 1
    assert K0 in serr and "(16, 64)" in serr and "(32, 64)" in serr
    assert tp3 == 1 and "tp=3" in terr and "num_attention_heads=4" in terr
    assert vpp == 2 and "--pp" in verr
    for text in (merr, serr, terr, verr):
        assert "Traceback" not in text
        assert len([ln for ln in text.splitlines() if ln.startswith("error:")]) == 1


@pytest.mark.timeout(240)
def test_verify_reports_dead_and_hung_ranks(ckpts):
    """A rank that dies or hangs ends the command with a message and exit 1; it never hangs."""
    results = run_many([
        (parallm("verify", ckpts["good"], "--tp", "2"), {"PARALLM_CLI_FAULT": "die:1"}),
        (parallm("verify", ckpts["good"], "--tp", "2", "--timeout", "15"), {"PARALLM_CLI_FAULT": "hang:1"}),
    ])
    (die, _, derr, _), (hang, _, herr, hsec) = results
    assert die == 1 and "rank 1 died" in derr, derr
    assert hang == 1 and "timed out after 15 s" in herr, herr
    assert hsec < 120
    assert "Traceback" not in derr + herr


@pytest.mark.timeout(180)
def test_verify_under_torchrun(ckpts):
    [(code, out, err, _)] = run_many([([TORCHRUN, "--nproc-per-node", "2", "-m", "parallm", "verify",
                                        ckpts["good"], "--tp", "2"], None)])
    assert code == 0, out + err
    assert "(torchrun)" in out and "OK: 1 layout(s) match transformers" in out
    assert out.count("OK:") == 1  # rank 0 alone prints


@pytest.mark.timeout(120)
def test_inspect(ckpts, capsys):
    results = run_many([
        (parallm("inspect", ckpts["good"], "--tp", "2", "--pp", "2"), None),
        (parallm("inspect", ckpts["good"], "--json"), None),
        (parallm("inspect", ckpts["missing"]), None),
    ])
    (c0, text, _, _), (c1, js, _, _), (c2, bad, _, _) = results
    assert c0 == 0
    assert "LlamaForCausalLM" in text and "valid tp      1, 2, 4" in text
    assert "pp 2 (vpp 2)" in text and "parameter memory per rank" in text
    assert "vocab 101 is padded" in text and "tp 2: 102" in text
    report = json.loads(js)
    assert c1 == 0 and report["architecture"] == "LlamaForCausalLM" and report["valid_tp"] == [1, 2, 4]
    assert report["pipelines"] == {"1": [], "2": [2], "4": []}
    cfg = report["config"]
    h, i, v, q, kv = cfg["hidden"], cfg["intermediate"], cfg["vocab"], 4 * 16, 2 * 16
    per_layer = 2 * h + h * (q + 2 * kv) + (q + 2 * kv) + q * h + h + 3 * h * i
    assert report["parameters"] == 2 * v * h + h + 4 * per_layer
    assert c2 == 1 and "PROBLEM" in bad and DOWN1 in bad
    # error paths (in process: they are about the message, not the launch)
    c3, _, tp3 = in_process(capsys, "inspect", ckpts["good"], "--tp", "3")
    assert c3 == 1 and "tp=3" in tp3 and "num_attention_heads=4" in tp3 and "Traceback" not in tp3
    c4, _, nowhere = in_process(capsys, "inspect", str(ckpts["root"] / "nowhere"))
    assert c4 == 1 and "does not exist" in nowhere
    c5, _, vpp = in_process(capsys, "inspect", ckpts["good"], "--pp", "2", "--vpp", "4")
    assert c5 == 1 and "pp=2 x vpp=4" in vpp
