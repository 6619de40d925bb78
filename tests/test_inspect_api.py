"""``parallm.inspect_checkpoint``: the library call behind ``parallm inspect`` (no process group, no CLI): the
report of a checkpoint and a layout, and its errors as Python exceptions (the CLI turns them into ``error:``)."""

from __future__ import annotations

import pytest

import helpers


def test_inspect_checkpoint_report_and_errors(tmp_path):
    import parallm
    from parallm.api.inspect import InspectError
    cfg = helpers.tiny_config("qwen2", num_hidden_layers=4)
    ckpt = helpers.save_checkpoint(helpers.make_hf_model(cfg, seed=1), str(tmp_path / "m"))
    report = parallm.inspect_checkpoint(ckpt, tp=2, pp=2)
    assert report["architecture"] == "Qwen2ForCausalLM" and report["problem"] is None
    assert report["valid_tp"] == [1, 2, 4] and 2 in report["pipelines"]
    layout = report["layout"]
    assert (layout["tp"], layout["pp"], layout["world"]) == (2, 2, 4) and len(layout["stages"]) == 2
    with pytest.raises(InspectError, match="tp=3"):
        parallm.inspect_checkpoint(ckpt, tp=3)
    with pytest.raises(ValueError):            # an InspectError is a ValueError ...
        parallm.inspect_checkpoint(ckpt, pp=3)
    with pytest.raises(parallm.CheckpointError, match="does not exist"):     # ... and a CheckpointError
        parallm.inspect_checkpoint(str(tmp_path / "missing"))
