"""LoRA adapters in and out of the sharded model, in PEFT's format (the adapters themselves: model/layers/lora.py).

PEFT names (``PeftModel.save_pretrained`` with peft 0.21 on transformers 5): ``base_model.model.{module}.lora_A.weight``
``[r, in]`` and ``.lora_B.weight`` ``[out, r]`` per adapted HF module; for a MoE layer's routed experts (stacked 3-D
parameters, targeted through ``target_parameters``) ``base_model.model.model.layers.{i}.mlp.experts.lora_A.weight``
for the outer wrapper (``down_proj``: A ``[E r, I]``, expert-major, B ``[H, r E]``, column ``k E + e`` = expert e's
column k) and ``...experts.base_layer.lora_A.weight`` for the inner one (``gate_up_proj``, rank ``2 r``: A
``[E 2r, H]``, B ``[2 I, 2r E]``); a layer with one of the two has only the outer names (Gemma 4: the same under
``model.layers.{i}.experts.``, rank ``r`` on gate_up, its config's ``target_parameters`` ``experts.gate_up_proj`` /
``experts.down_proj``; the gemma4 wrapper's config also ``exclude_modules`` for the towers). The output head
(``lm_head`` targeted): ``base_model.model.lm_head.lora_A.weight`` ``[r, H]``, ``...lora_B.weight`` ``[V, r]``
(the vocabulary padding stripped). PEFT's own save of such an adapter also holds the head's base weight
(``base_model.model.lm_head.base_layer.weight``: its ``save_embedding_layers``); :func:`load_hf_adapter` checks
it against the loaded base and reads nothing else from it; :func:`save_hf_adapter` does not write it.

:func:`export_adapter_tensors` (collective) yields every factor whole on every rank; :func:`save_hf_adapter` writes
``adapter_config.json`` + ``adapter_model.safetensors`` (+ parallm's ``parallm_adapter.json``: the seed, kept out
of PEFT's config, which warns about keys it does not know); :func:`load_hf_adapter` reads them, every rank only its
own slices.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from ..errors import CheckpointError
from ..families import family_of
from ..model.layers.lora import (HEAD, PEFT_EXPERT_FAMILIES, LoraConfig, add_lora, global_entries,
                                 chunk_lora_entries, lora_config_of)
from ..model.layers.lora_gemma4 import GEMMA4_EXPERT_TARGETS, GEMMA4_FAMILIES, GEMMA4_VL_PEFT_EXCLUDE
from ..model.layers.lora_plan import V4_PEFT_EXCLUDE
from ..model.placement import placement_of
from ..model.sharding import Source
from ..parallel.comm import all_gather_single
from ..parallel.errors import gather_objects, run_local
from ..parallel.state import as_chunks, dims_of, require_initialized
from .saver import _move_into_place, check_target, make_tmp_beside

PREFIX = "base_model.model."
CONFIG_NAME = "adapter_config.json"
SIDECAR_NAME = "parallm_adapter.json"    # parallm's own fields (sidecar_dict), beside PEFT's config
WEIGHTS_NAME = "adapter_model.safetensors"


# -- names ----------------------------------------------------------------------------------------------------

def _peft_module(spec, name: str) -> str:
    """The module path PEFT names an adapter by, for HF checkpoint name ``name`` (the family's ``peft_renames``:
    transformers may hold a module under another path than the checkpoint's name)."""
    for old, new in family_of(spec).peft_renames:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _peft_layout(chunk, config):
    """The model's factors in PEFT's terms, in model order: ``[(peft_name, shape, [(ckpt_name, expert), ...],
    which, r)]``: a dense factor is one checkpoint tensor; an expert factor stacks every expert's."""
    spec, dims = chunk.spec, chunk.dims
    entries = global_entries(spec, chunk.table, chunk.task, dims, config, padded_vocab=chunk.padded_vocab_size)
    by_layer_experts: dict = {}
    for e, s, which in entries:
        if e.index is not None:
            by_layer_experts.setdefault(e.layer, set()).add(s.part)
    out, seen = [], {}
    for e, s, which in entries:
        if e.index is None:
            out.append((PREFIX + _peft_module(spec, e.hf[0]), e.shape, [(e.hf[0], None)], which, s.r))
            continue
        inner = s.part == "gate_up_proj" and len(by_layer_experts[e.layer]) == 2
        name = f"{PREFIX}{_peft_module(spec, s.module)}.{'base_layer.' if inner else ''}lora_{which}.weight"
        if name not in seen:
            seen[name] = len(out)
            out.append((name, None, [], which, s.r))
        slot = out[seen[name]]
        slot[2].append((e.hf[0], e.index))
        rows, cols = e.shape
        n = len(slot[2])
        out[seen[name]] = (name, (n * rows, cols) if which == "A" else (rows, n * cols), slot[2], which, s.r)
    return out


def peft_shapes(chunks) -> dict[str, tuple[int, ...]]:
    """PEFT name -> full shape of every factor of ``chunks``' adapters."""
    chunks = as_chunks(chunks)
    return {name: tuple(shape) for name, shape, _, _, _ in _peft_layout(chunks[0], _config(chunks))}


def _config(chunks) -> LoraConfig:
    config = lora_config_of(chunks)
    if config is None:
        raise ValueError("the model has no LoRA adapters (build_model(..., lora=...) or parallm.add_lora)")
    return config


def _assemble(parts: list[torch.Tensor], which: str) -> torch.Tensor:
    """Every expert's factor (in expert order) as PEFT stacks them: A rows expert-major, B columns rank-major."""
    if which == "A":
        return torch.cat(parts, dim=0)
    return torch.stack(parts, dim=-1).reshape(parts[0].shape[0], -1)


# -- out ------------------------------------------------------------------------------------------------------

def _gather_factors(chunks, dtype) -> dict[str, torch.Tensor]:
    """Checkpoint name -> whole factor (CPU), on every rank. Each TP group all-gathers its shards (one message);
    the ranks holding a factor first (TP rank 0 and data-parallel rank 0, of the expert-data-parallel group for
    experts) send it to everyone (gloo)."""
    dims = dims_of(chunks)
    local = []
    for entry, chunk in chunk_lora_entries(chunks):
        param = chunk.get_parameter(entry.local)
        layout = placement_of(param).layout
        tensor = param.detach()
        if entry.index is not None:
            tensor, layout = tensor[entry.index], layout.inner
        local.append((entry, tensor, layout))
    mine = {}
    flat = torch.cat([t.reshape(-1) for _, t, _ in local]) if local else None
    if dims.tp > 1 and flat is not None:
        every = torch.empty(dims.tp * flat.numel(), dtype=flat.dtype, device=flat.device)
        all_gather_single(every, flat, group=dims.tp_group)
        every = every.view(dims.tp, -1)
    for k, (entry, tensor, layout) in enumerate(local):
        expert = entry.index is not None
        holder = dims.tp_rank == 0 and ((dims.edp_rank == 0) if expert else (dims.dp_cp_rank == 0))
        if not holder:
            continue
        if dims.tp > 1:
            at = sum(t.numel() for _, t, _ in local[:k])
            shards = [every[r, at:at + tensor.numel()].view(tensor.shape) for r in range(dims.tp)]
            whole = layout.merge(shards)[0]
        else:
            whole = tensor
        mine[entry.hf[0]] = whole.to(device="cpu", dtype=dtype or whole.dtype).clone()
    out = {}
    for part in gather_objects(mine, what="export_adapter_tensors"):
        out.update(part)
    return out


def export_adapter_tensors(chunks, *, dtype: torch.dtype | None = None):
    """Yield ``(peft_name, tensor)`` for every factor of the model's adapters, whole (CPU tensors), on every rank,
    in model order: what ``PeftModel.save_pretrained`` writes (module docstring). Collective: every rank calls it
    and iterates to the end. ``dtype``: the tensors' dtype (default: the parameters')."""
    require_initialized("export_adapter_tensors")
    chunks = as_chunks(chunks)
    config = run_local(lambda: _config(chunks), what="export_adapter_tensors")
    factors = _gather_factors(chunks, dtype)
    for name, _, parts, which, _ in _peft_layout(chunks[0], config):
        if len(parts) == 1 and parts[0][1] is None:
            yield name, factors[parts[0][0]]
        else:
            yield name, _assemble([factors[n] for n, _ in parts], which)


def peft_config_dict(chunks) -> dict:
    """adapter_config.json of the model's adapters, as PEFT writes it for the same model (transformers 5's
    experts targeted by ``target_parameters``, their fused gate/up by rank and alpha patterns of 2 r, 2 alpha)."""
    chunks = as_chunks(chunks)
    chunk, config = chunks[0], _config(chunks)
    modules, params = set(), set()
    for name, _, parts, _, _ in _peft_layout(chunk, config):
        if parts[0][1] is None:
            modules.add(name.rsplit(".", 2)[0].rsplit(".", 1)[-1])
        else:        # ...experts.{e}.gate_up_proj.lora_A.weight; Gemma 4: "experts.gate_up_proj" (lora_gemma4)
            leaf = parts[0][0].split(".")[-3]
            params.add(f"experts.{leaf}" if chunk.spec.family in GEMMA4_FAMILIES else leaf)
    rank_pattern, alpha_pattern = dict(config.rank_pattern), dict(config.alpha_pattern)
    if "gate_up_proj" in params and chunk.spec.family in PEFT_EXPERT_FAMILIES:   # PEFT's conversion doubles it
        rank_pattern[r".*\.gate_up_proj"] = 2 * config.r
        alpha_pattern[r".*\.gate_up_proj"] = 2 * config.alpha
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM" if chunk.task == "causal_lm" else None,
        "base_model_name_or_path": getattr(chunk, "hf_source", None),
        "r": config.r, "lora_alpha": config.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(modules), "target_parameters": sorted(params) or None,
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "lora_bias": False,
        # DeepSeek-V4: the target leaves (kv_proj, gate_proj, q_b_proj) name compressor / indexer modules too,
        # which parallm never adapts; PEFT is told to leave them (and the grouped o_a_proj) alone
        # the gemma4 wrapper: its vision / audio towers' projections share the language model's leaf names
        **({"exclude_modules": V4_PEFT_EXCLUDE} if chunk.spec.v4 is not None else
           {"exclude_modules": GEMMA4_VL_PEFT_EXCLUDE} if chunk.spec.family == "gemma4_vl" else {}),
    }


def sidecar_dict(chunks) -> dict:
    """What parallm keeps beside PEFT's config (:data:`SIDECAR_NAME`): the adapters' seed and the
    ``target_modules`` as given to :class:`LoraConfig` (a regex or ``"all-linear"`` stays so). PEFT warns about
    any key of adapter_config.json it does not know ("Unexpected keyword arguments"), so none is added there."""
    config = _config(chunks)
    return {"seed": config.seed, "target_modules": config.to_dict()["target_modules"]}


def save_hf_adapter(chunks, out_dir, *, dtype: torch.dtype | None = None, overwrite: bool = False) -> None:
    """Write the adapters as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``) that
    ``PeftModel.from_pretrained(base, out_dir)`` loads without a warning, plus :data:`SIDECAR_NAME` (the
    adapters' seed and target_modules as configured, which :func:`load_hf_adapter` reads back). Collective; global
    rank 0 writes, into a temporary directory moved into place at the end (a non-empty ``out_dir`` needs
    ``overwrite=True``)."""
    require_initialized("save_hf_adapter")
    chunks = as_chunks(chunks)
    out_dir = os.path.abspath(os.fspath(out_dir))
    dims = dims_of(chunks)
    run_local(lambda: (_config(chunks), check_target(out_dir, overwrite) if dims.rank == 0 else None),
              what="save_hf_adapter")
    tensors = dict(export_adapter_tensors(chunks, dtype=dtype))

    run_local(lambda: write_peft_dir(out_dir, tensors, peft_config_dict(chunks), sidecar=sidecar_dict(chunks))
              if dims.rank == 0 else None, what="save_hf_adapter")


def write_peft_dir(out_dir: str, tensors: dict, config: dict, *, sidecar: dict | None = None) -> None:
    """``adapter_model.safetensors`` + ``adapter_config.json`` (+ ``sidecar`` as :data:`SIDECAR_NAME`) written
    into a temporary directory beside ``out_dir`` and moved into place (replacing ``out_dir``). Local, no
    collectives."""
    from safetensors.torch import save_file
    tmp = make_tmp_beside(out_dir)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(tmp, WEIGHTS_NAME),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        if sidecar is not None:
            with open(os.path.join(tmp, SIDECAR_NAME), "w") as f:
                json.dump(sidecar, f, indent=2)
        _move_into_place(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# -- in -------------------------------------------------------------------------------------------------------

def config_from_peft(peft: dict, chunk, sidecar: dict | None = None) -> LoraConfig:
    """The :class:`LoraConfig` of a PEFT adapter_config.json (its ``target_parameters`` mapped back to the experts'
    HF module names); anything parallm does not run (dropout, rsLoRA, DoRA, biases) is a CheckpointError.
    ``sidecar``: :data:`SIDECAR_NAME`'s contents (the seed); adapters saved before it existed carry the same
    fields as a ``"parallm"`` key of adapter_config.json, read when there is no sidecar."""
    for key, ok in (("lora_dropout", 0.0), ("use_rslora", False), ("use_dora", False), ("bias", "none"),
                    ("lora_bias", False), ("fan_in_fan_out", False)):
        if peft.get(key, ok) not in (ok, None) and not (key == "lora_dropout" and peft.get(key) == 0):
            raise CheckpointError(f"PEFT adapter with {key}={peft.get(key)!r}: parallm's LoRA runs {key}={ok!r} only")
    exclude = peft.get("exclude_modules")
    # the gemma4 wrapper: any exclusion (of its towers, which parallm never adapts); the file's factors must then
    # equal the model's adapters exactly (load_hf_adapter: missing / unexpected names refused)
    if exclude and not (chunk.spec.v4 is not None and exclude == V4_PEFT_EXCLUDE) \
            and chunk.spec.family != "gemma4_vl":
        raise CheckpointError(f"PEFT adapter with exclude_modules={exclude!r}: parallm reads only the exclusion its "
                              f"own DeepSeek-V4 and gemma4-wrapper adapters carry ({V4_PEFT_EXCLUDE!r}, "
                              f"{GEMMA4_VL_PEFT_EXCLUDE!r})")
    if peft.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"not a LoRA adapter (peft_type {peft.get('peft_type')!r})")
    targets = peft.get("target_modules") or []
    if isinstance(targets, str):
        raise CheckpointError("PEFT adapter with a regex target_modules: give parallm its config instead")
    targets = list(targets)
    params = peft.get("target_parameters") or []
    leaves = _expert_leaves(chunk)
    for p in params:
        if p not in leaves:
            raise CheckpointError(f"PEFT adapter targets parameter {p!r}, which this model's experts do not have")
        targets += leaves[p]
    rank_pattern = {k: v for k, v in (peft.get("rank_pattern") or {}).items() if k != r".*\.gate_up_proj"}
    alpha_pattern = {k: v for k, v in (peft.get("alpha_pattern") or {}).items() if k != r".*\.gate_up_proj"}
    seed = (sidecar if sidecar is not None else peft.get("parallm") or {}).get("seed", 0)
    return LoraConfig(int(peft["r"]), peft["lora_alpha"], tuple(dict.fromkeys(targets)), rank_pattern=rank_pattern,
                      alpha_pattern=alpha_pattern, seed=seed)


def _expert_leaves(chunk) -> dict[str, list[str]]:
    """``{"gate_up_proj": [gate leaf, up leaf], "down_proj": [down leaf]}`` of the model's per-expert rows (Gemma
    4: ``"experts.down_proj"`` and the bare leaf both map to parallm's ``"experts.down_proj"``: its bare
    ``"down_proj"`` names the dense MLP, see :mod:`parallm.model.layers.lora_gemma4`)."""
    if getattr(getattr(chunk, "spec", None), "family", None) in GEMMA4_FAMILIES:
        return {k: [full] for full in GEMMA4_EXPERT_TARGETS for k in (full, full.split(".")[-1])}
    out = {}
    for row in chunk.table:
        if row.per_expert and row.fused:
            key = row.fused[0].rsplit(".", 1)[-1]
            out[key] = [h.removesuffix(".weight").rsplit(".", 1)[-1] for h in row.hf]
    return out


class _PeftSource(Source):
    """One checkpoint tensor's rows / columns read from a PEFT file lazily; for a routed expert (``expert``,
    of ``count``) its factor inside the stacked PEFT tensor (A: rows ``[e r, (e + 1) r)``; B: columns
    ``k count + e``)."""

    def __init__(self, f, name: str, which: str, expert=None, count: int = 1):
        self.slice, self.which, self.expert, self.count = f.get_slice(name), which, expert, count
        rows, cols = self.slice.get_shape()
        if expert is None:
            self.shape = (rows, cols)
        else:
            self.shape = (rows // count, cols) if which == "A" else (rows, cols // count)
        self.dtype = None

    @property
    def is_floating(self) -> bool:
        return True

    def read(self, dim, start, stop):
        if self.expert is None:
            return self.slice[start:stop] if dim == 0 else self.slice[:, start:stop]
        e = self.expert
        if self.which == "A":
            r = self.shape[0]
            return self.slice[e * r + start:e * r + stop] if dim == 0 else self.slice[e * r:(e + 1) * r, start:stop]
        rows, r = self.shape
        block = self.slice[start:stop] if dim == 0 else self.slice[:, :]
        block = block.view(block.shape[0], r, self.count)[:, :, e]
        return block if dim == 0 else block[:, start:stop]


def _check_saved_head(f, name: str, chunks, peft_dir: str) -> None:
    """PEFT saves the head's base weight beside an lm_head adapter (``save_embedding_layers``) and loads it into the
    model's head. parallm takes the base from ``load_hf_weights`` only: the saved copy must be the model's head
    (its shape always; its values, this rank's vocabulary rows, when the base is loaded already)."""
    spec = chunks[0].spec
    shape = tuple(f.get_slice(name).get_shape())
    if shape != (spec.vocab_size, spec.hidden_size):
        raise CheckpointError(f"{peft_dir}: {name} is {shape}, the model's lm_head "
                              f"({spec.vocab_size}, {spec.hidden_size})")
    for chunk in chunks:
        if not (chunk.post_process and getattr(chunk, "weights_loaded", False)):
            continue
        per = chunk.padded_vocab_size // chunk.dims.tp
        start = chunk.dims.tp_rank * per
        real = chunk.real_vocab_columns if chunk.real_vocab_columns is not None else per
        weight = chunk.head_weight().detach()
        theirs = f.get_slice(name)[start:start + real].to(device=weight.device, dtype=weight.dtype)
        if not torch.equal(theirs, weight[:real]):
            raise CheckpointError(f"{peft_dir}: {name} (PEFT's copy of the head's base weight) differs from this "
                                  "model's lm_head: the adapter was saved on another base (parallm loads base "
                                  "weights from load_hf_weights only)")


def load_hf_adapter(chunks, peft_dir) -> LoraConfig:
    """Fill the adapters of ``chunks`` from a PEFT directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), each rank reading only its slices (the directory must be visible on every
    rank). A model without adapters gets them first, as the directory's config says (:func:`add_lora`); a model
    with adapters must have the same ones (same names and shapes, else CheckpointError naming them). Collective
    only for agreeing on errors. Returns the adapters' config."""
    from safetensors import safe_open
    require_initialized("load_hf_adapter")
    chunks = as_chunks(chunks)
    peft_dir = os.path.abspath(os.fspath(peft_dir))

    def read_config():
        path = os.path.join(peft_dir, CONFIG_NAME)
        if not os.path.isfile(path) or not os.path.isfile(os.path.join(peft_dir, WEIGHTS_NAME)):
            raise CheckpointError(f"{peft_dir} is not a PEFT adapter directory ({CONFIG_NAME} and {WEIGHTS_NAME} "
                                  "expected)")
        with open(path) as f:
            peft = json.load(f)
        sidecar = None
        if os.path.isfile(os.path.join(peft_dir, SIDECAR_NAME)):
            with open(os.path.join(peft_dir, SIDECAR_NAME)) as f:
                sidecar = json.load(f)
        return config_from_peft(peft, chunks[0], sidecar)
    config = run_local(read_config, what="load_hf_adapter")
    if lora_config_of(chunks) is None:
        run_local(lambda: add_lora(chunks, config), what="load_hf_adapter")
    config = lora_config_of(chunks)
    chunk0 = chunks[0]

    def fill():
        layout = _peft_layout(chunk0, config)
        where = {}
        for name, shape, parts, which, _ in layout:
            for k, (ckpt, expert) in enumerate(parts):
                where[ckpt] = (name, which, None if expert is None else k, len(parts))
        with safe_open(os.path.join(peft_dir, WEIGHTS_NAME), framework="pt") as f:
            present = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            expected = {name: tuple(shape) for name, shape, _, _, _ in layout}
            saved_head = PREFIX + HEAD + ".base_layer.weight"     # PEFT's save_embedding_layers copy of the head
            saved_head = saved_head if config.targets(HEAD) and saved_head in present else None
            missing = sorted(set(expected) - set(present))
            unexpected = sorted(set(present) - set(expected) - {saved_head})
            bad = [f"{k}: file {present[k]} vs model {expected[k]}" for k in sorted(set(present) & set(expected))
                   if present[k] != expected[k]]
            if missing or unexpected or bad:
                raise CheckpointError(f"{peft_dir}: adapter does not fit the model's adapters: "
                                      + " | ".join(x for x in (
                                          missing and "missing " + ", ".join(missing[:6]),
                                          unexpected and "unexpected " + ", ".join(unexpected[:6]),
                                          bad and "shapes differ: " + "; ".join(bad[:6])) if x))
            with torch.no_grad():
                for entry, chunk in chunk_lora_entries(chunks):
                    param = chunk.get_parameter(entry.local)
                    name, which, expert, count = where[entry.hf[0]]
                    lay = placement_of(param).layout
                    target = param.detach()
                    if entry.index is not None:
                        lay, target = lay.inner, target[entry.index]
                    src = _PeftSource(f, name, which, expert, count)
                    target.copy_(lay.shard([src], chunk.dims.tp_rank, chunk.dims.tp))
    def check_head():       # agreed on before any rank writes (each rank checks its own vocabulary rows)
        with safe_open(os.path.join(peft_dir, WEIGHTS_NAME), framework="pt") as f:
            name = PREFIX + HEAD + ".base_layer.weight"
            if config.targets(HEAD) and name in f.keys():
                _check_saved_head(f, name, chunks, peft_dir)
    run_local(check_head, what="load_hf_adapter")
    run_local(fill, what="load_hf_adapter")
    return config
