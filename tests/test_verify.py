"""parallm.verify, the one harness the tests, the command line and the benchmarks share: its launcher ends every
run (results, a raising / dying / hanging rank named as the root cause), its comparisons see what they should,
and check_layout both passes a correct layout and fails a wrong gradient."""

from __future__ import annotations

import os
import time

import pytest
import torch

import helpers
from parallm import verify
from parallm.verify import SpawnError


def _rank(rank, world, mode):
    import torch.distributed as dist
    if rank == 1 and mode == "raise":
        raise ValueError("rank one is broken: 7 != 8")
    if rank == 1 and mode == "die":
        os._exit(5)
    if mode == "hang":
        # both ranks past the rendezvous first: rank 0 ending at once could leave rank 1 still connecting its gloo
        # mesh to it, which then fails ("connectFullMesh failed") instead of hanging (seen under load)
        dist.barrier()
    if rank == 1 and mode == "hang":
        while True:
            time.sleep(3600)
    if mode == "unpicklable":
        return lambda: None
    if mode != "hang":
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return dict(rank=rank, total=t.item(), env=(os.environ["RANK"], os.environ["WORLD_SIZE"]),
                    threads=torch.get_num_threads())
    return "rank 0 done"


@pytest.mark.timeout(200)
def test_spawn_results_and_every_way_a_rank_fails():
    assert verify.spawn(_rank, 2, "ok", timeout=60) == [
        dict(rank=r, total=3.0, env=(str(r), "2"), threads=1) for r in range(2)]

    with pytest.raises(SpawnError) as e:
        verify.spawn(_rank, 2, "raise", timeout=60)
    c = e.value.culprit
    assert (c.rank, c.status, c.error_type) == (1, "error", "ValueError")
    assert e.value.summary == "rank 1: rank one is broken: 7 != 8"  # parallm's own types: the message speaks
    assert "Traceback" in str(e.value) and "_rank" in str(e.value) and "7 != 8" in str(e.value)

    with pytest.raises(SpawnError) as e:
        verify.spawn(_rank, 2, "die", timeout=60)
    assert (e.value.culprit.rank, e.value.culprit.status, e.value.culprit.exitcode) == (1, "dead", 5)
    assert "rank 1 died (exit code 5)" in e.value.summary

    t = time.monotonic()
    with pytest.raises(SpawnError) as e:
        verify.spawn(_rank, 2, "hang", timeout=10)
    assert time.monotonic() - t < 10 + 15  # the deadline, then kill + join
    assert e.value.timed_out and [o.status for o in e.value.outcomes] == ["ok", "hang"]
    assert e.value.summary.startswith("timed out after 10 s: rank(s) [1] did not finish")

    with pytest.raises(SpawnError, match="cannot be sent back"):
        verify.spawn(_rank, 2, "unpicklable", timeout=60)


@pytest.mark.timeout(120)
def test_spawn_outcomes_lets_survivors_end_by_themselves():
    dead, hung = verify.spawn_outcomes(_rank, 2, "die", timeout=60), verify.spawn_outcomes(_rank, 2, "hang", timeout=8)
    assert dead[1].status == "dead" and dead[1].exitcode == 5
    assert dead[0].status == "error" and dead[0].lost_peer  # rank 0's all_reduce lost its peer and raised
    assert [(o.status, o.value) for o in hung] == [("ok", "rank 0 done"), ("hang", None)]


def test_comparisons_see_what_they_should():
    ids, mask = verify.padded_batch(50, batch=8, seq=10, seed=3)
    rows = mask.tolist()
    assert rows[0] == [1] * 10 and rows[4] == [1] * 10                # full rows
    assert rows[1] == [0] * 3 + [1] * 7 and rows[5] == rows[1]        # left padding, 30 %
    assert rows[2] == [1] * 6 + [0] * 4                                # right padding, 40 %
    assert rows[3] == [0] + [1] * 7 + [0] * 2                          # both sides
    assert (ids[mask == 0] == 0).all() and ids.max() < 50

    a = torch.zeros(2, 3)
    b = a.clone()
    b[1, 0] = 5.0                   # a padded position: never compared
    b[0, 2] = 0.25
    m = torch.tensor([[1, 1, 1], [0, 1, 1]])
    assert verify.max_diff_real(a, b, m) == 0.25

    x = {"w": torch.ones(2, 2), "v": torch.zeros(3)}
    assert verify.compare_states(x, {k: t.clone() for k, t in x.items()}) == (True, 0.0, "")
    off = dict(x, w=x["w"] + torch.tensor([[0.0, 1e-7], [0.0, 0.0]]))
    same, worst, what = verify.compare_states(off, x)
    assert not same and 0 < worst < 2e-7 and what == "1 tensor(s) differ, most: w"
    same, worst, what = verify.compare_states({"w": x["w"]}, dict(x, u=torch.ones(1, 4)))
    assert not same and worst == float("inf") and "missing u, v" in what
    assert verify.compare_states({"w": torch.ones(2, 3)}, {"w": x["w"]})[2] == "w: shape (2, 3) vs (2, 2)"

    model = verify.make_hf_model(verify.tiny_config("qwen2", tie_word_embeddings=True), seed=4)
    state = verify.hf_state(model)
    assert "lm_head.weight" not in state and len(state) == len(model.state_dict()) - 1
    for name, t in state.items():    # every weight non-trivial: no norm stays at 1, no bias at 0
        assert not torch.equal(t, torch.ones_like(t)) and not torch.equal(t, torch.zeros_like(t)), name


def _check_rank(rank, world, honest, sabotaged):
    import parallm
    rows = [verify.check_layout(honest)]
    parallm.finalize_grads = lambda chunks: None   # a wrong gradient: replicas no longer averaged
    rows.append(verify.check_layout(sabotaged))
    return rows


@pytest.mark.timeout(240)
def test_check_layout_passes_a_correct_layout_and_fails_a_wrong_gradient(tmp_path):
    cfg = helpers.tiny_config("llama", num_hidden_layers=2, attention_bias=True)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=2), str(tmp_path / "m"))
    honest = verify.Check(ckpt, str(tmp_path / "s1"), tp=2, label="m")
    sabotaged = verify.Check(ckpt, str(tmp_path / "s2"), tp=2, label="m", lr=0.05)
    rows = helpers.run_ranks(_check_rank, 4, honest, sabotaged)
    assert rows[1:] == [[None, None]] * 3                 # rank 0 alone reports
    good, bad = rows[0]
    for row in (good, bad):
        print(row["layout"], {k: row[k] for k in ("d_out", "d_loss", "d_weights", "d_after", "lr")})
    assert good["layout"] == "tp2 dp2" and good["ok"], good
    assert good["d_out"] < 2e-5 and good["d_loss"] < 2e-5 and good["d_after"] < 2e-5 and good["d_weights"] < 1e-6
    assert good["roundtrip"] and good["reload"] and good["lr"] > 0 and abs(good["update"] - verify.AUTO_UPDATE) < 1e-9
    assert not bad["ok"] and bad["lr"] == 0.05
    assert bad["d_out"] < 2e-5 and bad["roundtrip"] and bad["reload"]      # loading was right ...
    assert bad["d_weights"] > 10 * sabotaged.tolerances()[1]                # ... the step was not


def _check_rows(rank, world, honest, sabotaged):
    import parallm
    rows = [verify.check_layout(c) for c in honest]
    parallm.finalize_grads = lambda chunks: None   # a wrong gradient: replicas no longer averaged
    rows += [verify.check_layout(c) for c in sabotaged]
    return rows


@pytest.mark.timeout(300)
def test_check_layout_in_bf16_at_cp_and_an_uneven_split(tmp_path):
    """Check's dtype (transformers runs in it too), cp and pipeline split: honest layouts pass with the bf16
    defaults (round trip and reload still bit-exact), a wrong gradient fails in bf16 as in fp32."""
    cfg = helpers.tiny_config("llama", num_hidden_layers=4, attention_bias=True)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=2), str(tmp_path / "m"))
    honest = [verify.Check(ckpt, str(tmp_path / "a"), tp=2, dtype="bfloat16", label="m"),
              verify.Check(ckpt, str(tmp_path / "b"), cp=2, pp=2, split={"layers_per_stage": [1, 3]}, label="m"),
              verify.Check(ckpt, str(tmp_path / "c"), cp=2, tp=2, dtype="bfloat16", label="m")]
    sabotaged = [verify.Check(ckpt, str(tmp_path / "d"), tp=2, dtype="bfloat16", label="m")]
    rows = helpers.run_ranks(_check_rows, 4, honest, sabotaged)[0]
    for row in rows:
        print(row["layout"], row["layers"], {k: row[k] for k in ("d_out", "d_loss", "d_weights", "d_after")})
    bf16, split, cp, bad = rows
    assert [r["layout"] for r in rows] == ["tp2 dp2 bf16", "tp1 cp2 pp2 split 1,3", "tp2 cp2 bf16", "tp2 dp2 bf16"]
    for row in (bf16, split, cp):
        assert row["ok"] and row["roundtrip"] and row["reload"], row
    assert split["layers"] == [1, 3] and split["dtype"] == "float32"
    assert max(split["d_out"], split["d_loss"], split["d_after"]) < 2e-5 and split["d_weights"] < 1e-6
    assert (bf16["atol"], bf16["weights_atol"]) == verify.TOLERANCES["bfloat16"]
    assert 0 < bf16["d_out"] < 0.1 and bf16["d_weights"] < 1e-3 and cp["d_weights"] < 1e-3
    assert not bad["ok"] and bad["roundtrip"] and bad["d_out"] == bf16["d_out"]     # loading was right ...
    assert bad["d_weights"] > 2 * bad["weights_atol"] and bad["d_after"] > 10 * bad["atol"]   # ... the step not


def test_stepped_difference_allows_one_rounding_step_in_bf16():
    want = {"w": torch.tensor([1.0, 0.3, -0.01, 0.0], dtype=torch.bfloat16)}
    one_step = {"w": torch.tensor([1.0078125, 0.30078125, -0.01, 0.0], dtype=torch.bfloat16)}   # +1 ulp each
    assert verify.stepped_difference(one_step, want, torch.bfloat16)[0] == 0.0
    far = {"w": torch.tensor([1.0, 0.3, -0.02, 0.0], dtype=torch.bfloat16)}
    d, what = verify.stepped_difference(far, want, torch.bfloat16)
    assert d > 0.009 and "w" in what
    assert verify.stepped_difference(one_step, want, torch.float32)[0] == pytest.approx(0.0078125)


@pytest.mark.timeout(300)
def test_verify_command_cp_dtype_and_split(tmp_path, capsys):
    from parallm.cli import main
    import json
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=4)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=3), str(tmp_path / "q"))

    def run(*args):
        try:
            code = main(["verify", ckpt, "--quiet", *args])
        except SystemExit as e:
            code = e.code
        out = capsys.readouterr()
        return code, out.out, out.err

    out = tmp_path / "v.json"
    code, sout, serr = run("--cp", "2", "--pp", "2", "--layers-per-stage", "3,1", "--dtype", "bfloat16",
                           "--json", str(out))
    assert code == 0, sout + serr
    row = json.loads(out.read_text())["rows"][0]
    assert row["layout"] == "tp1 cp2 pp2 bf16 split 3,1" and row["layers"] == [3, 1] and row["ok"], row
    assert "in bfloat16" in sout and "outputs and loss 0.1" in sout, sout
    code, _, err = run("--pp", "2", "--layers-per-stage", "2,3")         # the launcher's preflight
    assert code == 1 and "adds up to 5" in err, err
    code, _, err = run("--layers-per-stage", "2,2")
    assert code == 2 and "--pp > 1" in err, err
    code, _, err = run("--dtype", "float16")
    assert code == 2 and "invalid choice" in err, err


def _verify_mtp_rank(rank, world, checks, ckpt):
    import parallm
    rows = [verify.check_layout(checks[0])]
    # a loader that corrupts one MTP tensor after loading: the check must say so
    real = parallm.load_hf_weights

    def corrupting(chunks, *args, **kwargs):
        report = real(chunks, *args, **kwargs)
        for c in chunks:
            if hasattr(c, "carried_mtp"):
                with torch.no_grad():
                    c.carried_mtp[0].add_(1.0)
        return report
    parallm.load_hf_weights = corrupting
    rows.append(verify.check_layout(checks[1]))
    return rows


@pytest.mark.timeout(300)
def test_check_layout_carries_and_checks_mtp_tensors(tmp_path):
    """A Qwen3-Next checkpoint holding MTP tensors (transformers drops them): verify builds from the directory,
    so they are carried, checked against the checkpoint's bytes (loaded, unchanged by the step, saved), and left
    out of the comparisons with transformers; a corrupted one fails the row."""
    from test_qwen3_5 import add_mtp, hybrid_config, make_model
    cfg = hybrid_config("qwen3_next")
    ckpt = str(tmp_path / "m")
    mtp = add_mtp(ckpt, helpers.hub_state_dict(make_model(cfg, seed=4), ckpt), seed=5)
    checks = [verify.Check(ckpt, str(tmp_path / "a"), tp=2, label="m"),
              verify.Check(ckpt, str(tmp_path / "b"), tp=2, label="m")]
    good, bad = helpers.run_ranks(_verify_mtp_rank, 2, checks, ckpt)[0]
    print(good["notes"], bad["notes"])
    assert good["ok"] and good["mtp_tensors"] == len(mtp) and good["roundtrip"] and good["reload"], good
    assert not bad["ok"] and not bad["mtp_ok"] and any("not loaded bit for bit" in n for n in bad["notes"])
    assert bad["d_out"] < 2e-5 and bad["roundtrip"]          # the rest of the model was right
