"""parallm as a verl training engine (verl 0.9.1's ``BaseEngine``; the contract is written down in docs/verl.md).

Registered with verl's ``EngineRegistry`` as backend ``"parallm"`` for ``model_type="language_model"`` (actor and
reference: log-probs and entropy) and ``"value_model"`` (critic: values), devices ``cpu`` and ``cuda``; verl's
config selects it with ``actor_rollout_ref.actor.strategy=parallm`` (``critic.strategy=parallm``). verl hands the
engine its FSDP engine config then (``FSDPActorConfig`` copies the strategy into it); parallm's own layout comes
from the environment variable ``PARALLM_VERL_CONFIG``, a JSON object read in every worker::

    PARALLM_VERL_CONFIG='{"tp": 2, "pp": 1, "vpp": null, "cp": 1, "ep": 1, "dtype": "float32",
                          "recompute": null, "packed": false}'

(verl's engine configs are dataclasses that refuse unknown keys, so a ``parallm`` block in the Hydra config
cannot reach the engine without a config class of parallm's own inside verl's config tree.)

What each verl call becomes:

* ``initialize``: ``parallm.init_parallel`` over verl's process group (once per process; a second engine in the
  same process, the reference policy, shares the layout), ``build_model`` + ``load_hf_weights`` from
  ``model_config.local_path``, ``build_optimizer`` (AdamW, verl's ``lr`` / ``betas`` / ``weight_decay``) and
  verl's own LR schedule (:class:`_Schedule`).
* ``forward_backward_batch``: verl's global token count (``loss_mask`` summed over the data-parallel group) and
  ``dp_size`` go into the batch as verl's FSDP engine puts them, verl's ``prepare_micro_batches`` splits it, and
  each micro-batch (verl's nested ``[b, j]`` tensors, padded here into ``[b, S]`` + ``attention_mask``) runs
  through ``parallm.forward_backward(..., num_microbatches=1, output="logprobs+entropy")`` whose ``loss_fn`` turns
  parallm's ``[b, S]`` outputs back into verl's nested ``log_probs`` / ``entropy`` / ``values`` and calls verl's
  ``loss_function(model_output=..., data=micro_batch, dp_group=...)``. verl's loss is already normalised by the
  global token count times ``dp_size``: the gradient verl wants is the sum over micro-batches, averaged over the
  data-parallel replicas, which is what one ``forward_backward`` call per micro-batch (gradients accumulate) and
  ``finalize_grads`` (average over dp) give. Outputs go through verl's ``postprocess_batch_func`` (order restored
  for dynamic batch sizes).
* ``optimizer_step``: ``finalize_grads``, ``clip_grad_norm_(clip_grad)``, the step only when the norm is finite.
* ``get_per_tensor_param``: ``parallm.export_hf_tensors`` (HF names, full tensors, collective: every rank iterates).
* checkpoints: ``parallm.save_checkpoint`` / ``load_checkpoint`` (any layout) with the LR schedule's state, and
  an HF export when verl's checkpoint config asks for ``hf_model``.

Waiting for issue 35 (parallm's batch / metrics / optimizer / offload API): per-sample tensors reaching
``loss_fn`` inside one ``forward_backward`` call (so several micro-batches could share one call and the pipeline
schedule at pp > 1), a ``torch.optim.Optimizer`` (verl's ``LambdaLR`` directly), and ``offload`` / ``onload``
(``to("cpu")`` of a CUDA model); see docs/verl.md.
"""

from __future__ import annotations

import json
import os
import shutil
import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

import parallm

__all__ = ["ParallmEngine", "ParallmEngineWithLMHead", "ParallmEngineWithValueHead", "register_engines",
           "parallm_options"]

_DEFAULTS = {"tp": 1, "pp": 1, "vpp": None, "cp": 1, "ep": 1, "dtype": "float32", "recompute": None,
             "packed": False, "attn_impl": "auto"}


def parallm_options() -> dict:
    """parallm's block for the engine: ``PARALLM_VERL_CONFIG`` (JSON) over the defaults; unknown keys refused."""
    raw = os.environ.get("PARALLM_VERL_CONFIG", "").strip()
    given = json.loads(raw) if raw else {}
    unknown = sorted(set(given) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"PARALLM_VERL_CONFIG: unknown key(s) {unknown}; known: {sorted(_DEFAULTS)}")
    return {**_DEFAULTS, **given}


class _Schedule:
    """verl's LR schedule driving parallm's optimizer. verl builds its schedules as ``torch.optim.lr_scheduler.
    LambdaLR``, which needs a ``torch.optim.Optimizer``; parallm's ``ParallelAdamW`` is not one yet (issue 35), so
    verl's scheduler runs on a one-parameter proxy SGD at the same base LR and each step copies its LR into
    parallm's optimizer (``set_lr``): verl's own warm-up / cosine arithmetic, no copy of it here."""

    def __init__(self, optimizer, optim_config, rank: int):
        from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
        self.optimizer = optimizer
        self._proxy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=optim_config.lr)
        total = optim_config.total_training_steps
        warmup = optim_config.lr_warmup_steps
        if warmup is None or warmup <= 0:
            warmup = int(optim_config.lr_warmup_steps_ratio * total)
        kind = optim_config.lr_scheduler_type
        if kind == "constant":
            self._sched = get_constant_schedule_with_warmup(optimizer=self._proxy, num_warmup_steps=warmup)
        elif kind == "cosine":
            self._sched = get_cosine_schedule_with_warmup(
                optimizer=self._proxy, num_warmup_steps=warmup, num_training_steps=total,
                min_lr_ratio=optim_config.min_lr_ratio, num_cycles=optim_config.num_cycles,
                zero_indexed_step=optim_config.zero_indexed_step)
        else:
            raise NotImplementedError(f"parallm engine: lr_scheduler_type={kind!r}; verl 0.9.1's FSDP engine "
                                      "knows 'constant' and 'cosine', and so does this one")
        self._sync()

    def _sync(self) -> None:
        self.optimizer.set_lr(self._proxy.param_groups[0]["lr"])

    def step(self) -> None:
        self._sched.step()
        self._sync()

    def get_last_lr(self) -> list[float]:
        return self._sched.get_last_lr()

    def state_dict(self) -> dict:
        return self._sched.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._sched.load_state_dict(state)
        self._proxy.param_groups[0]["lr"] = self._sched.get_last_lr()[0]
        self._sync()


def _padded(micro_batch: TensorDict, pad_token_id: int):
    """verl's NO_PADDING micro-batch (nested jagged ``input_ids`` / ``position_ids`` ``[b, j]``) as parallm's
    right-padded ``[b, S]`` ``input_ids``, ``attention_mask``, ``position_ids``, and the row lengths."""
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("parallm engine: verl's NO_PADDING batches (nested input_ids) only; got a dense tensor")
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    b, s = lengths.numel(), int(lengths.max().item()) if lengths.numel() else 0
    ids = torch.nested.to_padded_tensor(input_ids, padding=pad_token_id, output_size=(b, s))
    position_ids = micro_batch["position_ids"]
    if position_ids.dim() == 3:
        raise ValueError("parallm engine: 3-D (multimodal rope) position_ids are not supported")
    pos = torch.nested.to_padded_tensor(position_ids, padding=0, output_size=(b, s))
    mask = (torch.arange(s, device=ids.device)[None, :] < lengths[:, None].to(ids.device)).long()
    return ids, mask, pos, offsets


def _nested(padded: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """parallm's ``[b, S]`` output, row r's first ``len_r`` positions, as verl's nested jagged ``[b, j]``."""
    lengths = offsets.diff().tolist()
    flat = torch.cat([padded[r, :n] for r, n in enumerate(lengths)]) if lengths else padded.new_zeros(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets.to(flat.device))


def _temperature(micro_batch: TensorDict) -> float:
    t = micro_batch["temperature"] if "temperature" in micro_batch.keys() else 1.0
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() and not torch.all(t == t[0]):
            raise ValueError("parallm engine: per-sample temperatures differ within a micro-batch "
                             f"({sorted(set(t.tolist()))}); parallm's log-probs take one temperature per call")
        t = float(t[0]) if t.numel() else 1.0
    return float(t)


class ParallmEngine(BaseEngine):
    """A verl ``BaseEngine`` over parallm (see the module docstring for what each call does)."""

    task = "causal_lm"

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.options = parallm_options()
        self.mode = None
        self.chunks = None
        self.optimizer = None
        self.lr_scheduler = None
        self._saved: list[str] = []
        self._init_parallel()

    # -- layout ---------------------------------------------------------------------------------------------
    def _init_parallel(self) -> None:
        from parallm.parallel.state import _import_parallel_state, current_dims
        o = self.options
        ps = _import_parallel_state()
        if dist.is_initialized() and ps.model_parallel_is_initialized():
            d = current_dims()
            want = (o["tp"], o["pp"], o["vpp"] or 1, o["cp"], o["ep"])
            have = (d.tp, d.pp, d.vpp, d.cp, d.ep)
            if want != have:
                raise ValueError(f"parallm engine: this process already runs a parallm model at tp/pp/vpp/cp/ep "
                                 f"{have}; a second engine in it must use the same layout, not {want}")
        else:
            parallm.init_parallel(tp=o["tp"], pp=o["pp"], vpp=o["vpp"], cp=o["cp"], ep=o["ep"])
        self.dims = current_dims()

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "optimizer_offload", False))

    def is_mp_src_rank_with_outputs(self) -> bool:
        d = self.dims
        return d.tp_rank == 0 and d.cp_rank == 0 and d.pp_rank == d.pp - 1

    def get_data_parallel_rank(self) -> int:
        return self.dims.dp_rank

    def get_data_parallel_size(self) -> int:
        return self.dims.dp

    def get_data_parallel_group(self):
        return self.dims.dp_group

    # -- build ----------------------------------------------------------------------------------------------
    def initialize(self) -> None:
        o = self.options
        path = self.model_config.local_path
        dtype = getattr(torch, o["dtype"])
        self.chunks = parallm.build_model(path, task=self.task, dtype=dtype, packed=o["packed"],
                                          recompute=o["recompute"], attn_impl=o["attn_impl"])
        parallm.load_hf_weights(self.chunks, path, progress=False)
        self.pad_token_id = getattr(self.model_config.hf_config, "pad_token_id", None) or 0
        if not self.engine_config.forward_only:
            oc = self.optimizer_config
            if getattr(oc, "optimizer", "adamw").lower() != "adamw":
                raise NotImplementedError(f"parallm engine: optimizer {oc.optimizer!r}; parallm's is AdamW")
            self.optimizer = parallm.build_optimizer(self.chunks, lr=oc.lr, betas=tuple(oc.betas),
                                                     weight_decay=oc.weight_decay)
            self.lr_scheduler = _Schedule(self.optimizer, oc, self.dims.rank)

    # -- modes ----------------------------------------------------------------------------------------------
    def train_mode(self, **kwargs):
        return _Mode(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _Mode(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        here = {p.device.type for c in self.chunks for p in c.parameters()} if self.chunks else {"cpu"}
        if here == {torch.device(device).type}:
            return
        raise NotImplementedError(
            f"parallm engine: moving the model from {sorted(here)} to {device!r} needs parallm.offload / onload "
            "(issue 35); run with param_offload=False and optimizer_offload=False until then")

    # -- forward / backward ---------------------------------------------------------------------------------
    def _model_output(self, out, offsets, calculate_entropy: bool) -> dict:
        if self.task == "value":
            return {"values": _nested(out, offsets)}
        result = {"log_probs": _nested(out.logprobs, offsets)}
        if calculate_entropy:
            result["entropy"] = _nested(out.entropy, offsets)
        return result

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        group = self.get_data_parallel_group()
        batch_num_tokens = data["loss_mask"].sum().to(torch.float64).cpu() if "loss_mask" in data.keys() \
            else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(batch_num_tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=batch_num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(data=data, dp_group=group, same_micro_num_in_dp=True)
        output_lst = []
        for micro_batch in micro_batches:
            output_lst.append(self._micro_batch(micro_batch, loss_function, forward_only))
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def _micro_batch(self, micro_batch: TensorDict, loss_function, forward_only: bool) -> dict:
        ids, mask, pos, offsets = _padded(micro_batch, self.pad_token_id)
        temperature = _temperature(micro_batch)
        calculate_entropy = bool(tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False))
        output = None if self.task == "value" else "logprobs+entropy"
        dp_group = self.get_data_parallel_group()
        result = {"loss": 0.0, "metrics": {}}

        def run_loss(out):
            model_output = self._model_output(out, offsets, calculate_entropy)
            result["model_output"] = detach_tree(model_output)
            if loss_function is None:
                return None
            loss, metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=dp_group)
            result["loss"] = float(loss.detach().item())
            result["metrics"] = metrics
            return loss

        if forward_only:
            # parallm.forward returns the whole output on every rank (at pp > 1 broadcast from the last stage)
            out = parallm.forward(self.chunks, ids, mask, pos, output=output, temperature=temperature)
            run_loss(out)
            return result
        if loss_function is None:
            raise ValueError("parallm engine: forward_backward_batch(forward_only=False) needs a loss_function")

        def loss_fn(out, _ids, _mask):
            return run_loss(out)

        parallm.forward_backward(self.chunks, ids, mask, position_ids=pos, loss_fn=loss_fn, num_microbatches=1,
                                 output=output, temperature=temperature)
        return result

    # -- optimizer ------------------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        self.optimizer.zero_grad()

    def optimizer_step(self):
        parallm.finalize_grads(self.chunks)
        clip = self.optimizer_config.clip_grad
        norm = parallm.clip_grad_norm_(self.chunks, clip if clip is not None else float("inf"))
        if torch.isfinite(norm):
            self.optimizer.step()
        else:
            print(f"WARN: grad_norm is not finite: {norm}")
            self.optimizer.zero_grad()
        return float(norm.item())

    def lr_scheduler_step(self):
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    # -- weights for the rollout ----------------------------------------------------------------------------
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """HF-named full tensors (``parallm.export_hf_tensors``), on every rank; collective: every rank must
        iterate the generator to its end (verl's weight senders do)."""
        return parallm.export_hf_tensors(self.chunks), None

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        extra = {"lr_scheduler": self.lr_scheduler.state_dict()} if self.lr_scheduler is not None else None
        if extra is not None:
            extra = json.loads(json.dumps(extra))
        parallm.save_checkpoint(os.path.join(local_path, "parallm"), self.chunks, self.optimizer,
                                step=int(global_step), extra=extra, overwrite=True)
        contents = getattr(self.checkpoint_config, "save_contents", None) or []
        if "hf_model" in contents:
            parallm.save_hf_weights(self.chunks, os.path.join(local_path, "huggingface"), overwrite=True)
        self._saved.append(local_path)
        if max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep and self.dims.rank == 0:
            for old in self._saved[:-max_ckpt_to_keep]:
                shutil.rmtree(old, ignore_errors=True)
        self._saved = self._saved[-max_ckpt_to_keep:] if max_ckpt_to_keep else self._saved
        dist.barrier()

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        info = parallm.load_checkpoint(os.path.join(local_path, "parallm"), self.chunks, self.optimizer)
        extra = info.get("extra") or {}
        if self.lr_scheduler is not None and "lr_scheduler" in extra:
            self.lr_scheduler.load_state_dict(extra["lr_scheduler"])


class ParallmEngineWithLMHead(ParallmEngine):
    """Actor / reference: ``log_probs`` (and ``entropy`` when verl asks) per token, verl's nested layout."""

    task = "causal_lm"


class ParallmEngineWithValueHead(ParallmEngine):
    """Critic: ``values`` per token from parallm's value head (``task="value"``)."""

    task = "value"


class _Mode(BaseEngineCtx):
    def __init__(self, engine: ParallmEngine, mode: str, **kwargs):
        super().__init__(engine=engine, mode=mode, **kwargs)

    def __enter__(self):
        super().__enter__()
        for c in self.engine.chunks:
            c.train(self.mode == "train")

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None) \
                and self.engine.optimizer is not None:
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


_REGISTERED = []


def register_engines() -> None:
    """Register the two engines as backend ``"parallm"`` for cpu and cuda (once per process)."""
    if _REGISTERED:
        return
    EngineRegistry.register(model_type="language_model", backend="parallm", device=["cpu", "cuda"])(
        ParallmEngineWithLMHead)
    EngineRegistry.register(model_type="value_model", backend="parallm", device=["cpu", "cuda"])(
        ParallmEngineWithValueHead)
    register_fsdp_on_cpu()
    _REGISTERED.append(True)


def register_fsdp_on_cpu() -> None:
    """verl 0.9.1 registers its own FSDP engines (backends ``fsdp`` / ``fsdp2``) for devices ``cuda`` and ``npu``
    only, so on the CPU platform ``strategy=fsdp2`` finds no engine. Registers verl's own classes, unchanged,
    for ``cpu`` too (through the public registry), so verl's engine runs on the same CPU platform: the
    reference parallm's engine is compared with."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    for model_type, cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if "cpu" not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend, device="cpu")(cls)
