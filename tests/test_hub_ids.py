"""Hub ids resolved from the local Hugging Face cache (never the network), and saved directories that can be
served as they are (the source's tokenizer / generation files copied).

The cache is a fake one built in tmp with the real layout (``models--org--name/{blobs,refs,snapshots}``, the
snapshot's files symlinks into ``blobs/``), holding a tiny Qwen2 saved by transformers (sharded, so the index
points at symlinked shards) and a tokenizer built locally with ``tokenizers``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket

import pytest
import torch

import helpers

REPO = "tiny-org/tiny-qwen2"
COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def make_tokenizer_files(path: str) -> None:
    """A byte-level BPE tokenizer of 101 tokens (the tiny model's vocabulary) trained here, saved by
    transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja), and a generation_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=101, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[:60], show_progress=False)
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(path)
    GenerationConfig(max_new_tokens=7, eos_token_id=2, bos_token_id=1).save_pretrained(path)


def make_checkpoint(path: str, *, seed: int) -> str:
    """A tiny Qwen2 (biases, untied, every weight non-trivial) saved in two shards, with its tokenizer."""
    cfg = helpers.tiny_config("qwen2")
    model = helpers.make_hf_model(cfg, seed=seed)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    make_tokenizer_files(path)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return path


def add_to_cache(cache: str, repo: str, src: str, commit: str, refs=("main",)) -> str:
    """``src``'s files as the Hub cache holds them: content in ``blobs/<sha256>``, the snapshot's files symlinks
    to them, ``refs/<ref>`` holding the commit. Returns the snapshot directory."""
    root = os.path.join(cache, "models--" + repo.replace("/", "--"))
    snap = os.path.join(root, "snapshots", commit)
    os.makedirs(os.path.join(root, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(root, "refs"), exist_ok=True)
    for dirpath, _, files in os.walk(src):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, src)
            with open(full, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            blob = os.path.join(root, "blobs", digest)
            if not os.path.exists(blob):
                shutil.copyfile(full, blob)
            link = os.path.join(snap, rel)
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(os.path.relpath(blob, os.path.dirname(link)), link)
    for ref in refs:
        with open(os.path.join(root, "refs", ref), "w") as f:
            f.write(commit)
    return snap


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """(cache directory, main snapshot, v1 snapshot, the main checkpoint as saved by transformers)."""
    base = tmp_path_factory.mktemp("hub")
    main = make_checkpoint(str(base / "main"), seed=0)
    v1 = make_checkpoint(str(base / "v1"), seed=1)
    cache = str(base / "cache")
    snap_main = add_to_cache(cache, REPO, main, COMMIT_MAIN)
    snap_v1 = add_to_cache(cache, REPO, v1, COMMIT_V1, refs=("v1",))
    return cache, snap_main, snap_v1, main


class NoNetwork:
    """Records (and refuses) every attempt to resolve a host or open a connection from Python (local Unix
    sockets, which multiprocessing's forkserver uses to start ranks, pass)."""

    def __init__(self, monkeypatch):
        self.calls = []

        def refuse(what, original=None):
            def fn(*args, **kwargs):
                if original is not None and args[0].family == socket.AF_UNIX:
                    return original(*args, **kwargs)
                self.calls.append((what, args[1:] if original is not None else args[:1]))
                raise OSError(f"network disabled in this test ({what})")
            return fn
        monkeypatch.setattr(socket.socket, "connect", refuse("connect", socket.socket.connect))
        monkeypatch.setattr(socket.socket, "connect_ex", refuse("connect_ex", socket.socket.connect_ex))
        monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
        monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))


def test_hub_ids_resolve_from_the_cache_without_network(hub, tmp_path, monkeypatch):
    from parallm.checkpoint.hf_dir import hf_hub_cache, resolve_checkpoint
    from parallm.errors import CheckpointError
    cache, snap_main, snap_v1, main = hub
    for var in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    net = NoNetwork(monkeypatch)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    assert hf_hub_cache() == cache
    assert os.path.samefile(resolve_checkpoint(REPO), snap_main)
    assert os.path.samefile(resolve_checkpoint(REPO, revision="v1"), snap_v1)
    assert os.path.samefile(resolve_checkpoint(REPO, revision=COMMIT_V1), snap_v1)
    # HF_HOME is honoured (its hub/ folder) when HF_HUB_CACHE is not set, read at call time
    monkeypatch.delenv("HF_HUB_CACHE")
    home = tmp_path / "hf_home"
    home.mkdir()
    os.symlink(cache, home / "hub")
    monkeypatch.setenv("HF_HOME", str(home))
    assert hf_hub_cache() == str(home / "hub")
    assert os.path.samefile(resolve_checkpoint(REPO), snap_main)
    # absent: an id the cache lacks, a revision it lacks; the error names the id, the revision and the cache
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("tiny-org/absent")
    assert "'tiny-org/absent'" in str(e.value) and str(home / "hub") in str(e.value), e.value
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint(REPO, revision="v9")
    assert "revision v9" in str(e.value) and str(home / "hub") in str(e.value), e.value
    assert net.calls == [], net.calls
    # a local directory spelled like the id takes priority (and a revision makes no sense for it)
    monkeypatch.chdir(tmp_path)
    local = tmp_path / REPO
    shutil.copytree(main, local)
    assert resolve_checkpoint(REPO) == REPO
    with pytest.raises(ValueError, match="applies to Hub ids"):
        resolve_checkpoint(REPO, revision="v1")
    # paths that are not spelled like ids pass through for the caller's own error
    assert resolve_checkpoint(str(tmp_path / "nowhere")) == str(tmp_path / "nowhere")


def test_hf_checkpoint_reads_a_sharded_snapshot_of_symlinks(hub):
    """The index's shards are symlinks into blobs/: still inside the directory (the name is what counts)."""
    from parallm.checkpoint.hf_dir import HFCheckpoint
    _, snap_main, _, main = hub
    a, b = HFCheckpoint(snap_main), HFCheckpoint(main)
    assert sorted(a.keys()) == sorted(b.keys())
    assert len(set(a.weight_map.values())) > 1
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(a.source(name).read(0, 0, a.source(name).shape[0]), b.source(name).read(0, 0, 64))


def rank_hub(rank, world, cache, snap_main, main, out):
    import transformers

    import parallm
    from parallm.errors import CheckpointError
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HOME"):
        os.environ.pop(var, None)
    os.environ["HF_HUB_CACHE"] = cache
    parallm.init_parallel(tp=2)
    calls = []

    def refuse(*args, **kwargs):
        calls.append(args[1:])
        raise OSError("network disabled in this test")
    socket.socket.connect = refuse          # python-level connections only (gloo's are made in C++)
    socket.getaddrinfo = refuse

    by_id = parallm.build_model(REPO)
    parallm.load_hf_weights(by_id, REPO)
    by_path = parallm.build_model(snap_main)
    parallm.load_hf_weights(by_path, snap_main)
    sd_id, sd_path = parallm.save_hf_weights(by_id), parallm.save_hf_weights(by_path)
    assert by_id[0].hf_source == os.path.abspath(snap_main)
    if rank == 0:
        helpers.assert_same_state(sd_id, sd_path)
        original = transformers.AutoModelForCausalLM.from_pretrained(main, dtype=torch.float32)
        helpers.assert_same_state(sd_id, helpers.hf_state_dict(original))

    # a missing id: a CheckpointError on every rank naming the id and the cache searched
    for call in (lambda: parallm.build_model("tiny-org/absent"),
                 lambda: parallm.load_hf_weights(by_id, "tiny-org/absent")):
        with pytest.raises(CheckpointError) as e:
            call()
        assert "'tiny-org/absent'" in str(e.value) and cache in str(e.value), e.value

    # the saved directory serves as it is: tokenizer, chat template, generation config; transformers loads both
    parallm.save_hf_weights(by_id, os.path.join(out, "by_id"))
    # a model that never saw a directory (config dict + state dict) has no source: weights and config only,
    # unless source= names one (a Hub id here)
    cfg = json.load(open(os.path.join(snap_main, "config.json")))
    bare = parallm.build_model(cfg)
    parallm.load_hf_weights(bare, sd_id if rank == 0 else None)
    assert bare[0].hf_source is None
    parallm.save_hf_weights(bare, os.path.join(out, "bare"))
    parallm.save_hf_weights(bare, os.path.join(out, "bare_sourced"), source=REPO)
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        parallm.save_hf_weights(bare, os.path.join(out, "never"), source=os.path.join(out, "nowhere"))
    assert not os.path.exists(os.path.join(out, "never"))
    parallm.save_checkpoint(os.path.join(out, "train_ckpt"), by_id, step=3)
    assert calls == [], calls
    if rank == 0:
        src_tok = transformers.AutoTokenizer.from_pretrained(main)
        text = "hello lazy fox"
        chat = [{"role": "user", "content": "quick dog"}]
        for name in ("by_id", "bare_sourced"):
            d = os.path.join(out, name)
            for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
                assert open(os.path.join(d, f), "rb").read() == open(os.path.join(main, f), "rb").read(), (name, f)
            tok = transformers.AutoTokenizer.from_pretrained(d)
            assert tok(text).input_ids == src_tok(text).input_ids
            assert tok.apply_chat_template(chat, tokenize=False) == src_tok.apply_chat_template(chat, tokenize=False)
            gen = transformers.GenerationConfig.from_pretrained(d)
            assert gen.max_new_tokens == 7 and gen.eos_token_id == 2
            model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
            helpers.assert_same_state(helpers.hf_state_dict(model), sd_id)
        assert sorted(os.listdir(os.path.join(out, "bare"))) == ["config.json", "model.safetensors"]
    return True


def test_build_load_save_by_hub_id_and_the_command_line(hub, tmp_path, monkeypatch, capsys):
    from parallm.cli import main as cli
    cache, snap_main, _, main = hub
    helpers.run_ranks(rank_hub, 2, cache, snap_main, main, str(tmp_path))
    for var in ("HF_HUB_OFFLINE", "HF_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", cache)
    net = NoNetwork(monkeypatch)
    # inspect: a Hub id, a revision, a missing id (one line naming the cache)
    assert cli(["inspect", REPO, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == snap_main and report["architecture"] == "Qwen2ForCausalLM"
    assert cli(["inspect", REPO, "--revision", "v1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["path"].endswith(COMMIT_V1)
    assert cli(["inspect", "tiny-org/absent"]) == 1
    err = capsys.readouterr().err
    assert "'tiny-org/absent'" in err and cache in err, err
    # convert --source: the training checkpoint's weights plus the source's tokenizer files, servable
    out = str(tmp_path / "converted")
    assert cli(["convert", str(tmp_path / "train_ckpt"), out, "--source", REPO]) == 0
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert open(os.path.join(out, f), "rb").read() == open(os.path.join(main, f), "rb").read(), f
    import transformers
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hello lazy fox").input_ids == transformers.AutoTokenizer.from_pretrained(main)(
        "hello lazy fox").input_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    original = transformers.AutoModelForCausalLM.from_pretrained(main, dtype=torch.float32)
    helpers.assert_same_state(helpers.hf_state_dict(model), helpers.hf_state_dict(original))
    assert cli(["convert", str(tmp_path / "train_ckpt"), str(tmp_path / "c2"), "--source", "tiny-org/absent"]) == 1
    assert cache in capsys.readouterr().err and not os.path.exists(tmp_path / "c2")
    # verify: the ranks load the cached snapshot (the launching process resolved the id)
    assert cli(["verify", REPO, "--tp", "2", "--quiet", "--json", str(tmp_path / "v.json")]) == 0, capsys.readouterr()
    row = json.loads((tmp_path / "v.json").read_text())["rows"][0]
    assert row["ok"] and row["model"] == "tiny-qwen2" and row["roundtrip"] and row["reload"], row
    assert cli(["verify", "tiny-org/absent"]) == 1 and cache in capsys.readouterr().err
    assert net.calls == [], net.calls
