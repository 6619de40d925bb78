"""parallm as a verl training engine (verl 0.9.1's ``BaseEngine``; the contract is written down in docs/verl.md).

Registered with verl's ``EngineRegistry`` as backend ``"parallm"`` for ``model_type="language_model"`` (actor and
reference: log-probs and entropy) and ``"value_model"`` (critic: values), devices ``cpu`` and ``cuda``. verl's
config selects it in two ways (docs/verl.md): parallm's own config groups (``model_engine=parallm`` in verl's PPO
trainer, ``engine=parallm optim=parallm`` in its SFT trainer; :mod:`.config`), whose engine config carries the
layout under verl's keys (``tensor_model_parallel_size`` ...); or ``actor_rollout_ref.actor.strategy=parallm``
(``critic.strategy=parallm``), where verl hands the engine its FSDP engine config and parallm's layout comes from
the environment variable ``PARALLM_VERL_CONFIG``, a JSON object read in every worker::

    PARALLM_VERL_CONFIG='{"tp": 2, "pp": 1, "vpp": null, "cp": 1, "ep": 1, "dtype": "float32",
                          "recompute": null, "packed": false, "attn_impl": "auto"}'

(with parallm's config groups the variable, when set, overrides the keys it names: :mod:`.options`).

What each verl call becomes:

* ``initialize``: ``parallm.init_parallel`` over verl's process group (once per process; a second engine in the
  same process, the reference policy, shares the layout), ``build_model`` + ``load_hf_weights`` from
  ``model_config.local_path``; unless ``forward_only``, ``build_optimizer`` (AdamW from verl's ``lr`` / ``betas``
  / ``weight_decay`` / ``override_optimizer_config["eps"]``, every parameter decayed as verl's FSDP engine's
  ``torch.optim.AdamW`` over ``module.parameters()`` does) and verl's own LR schedule functions
  (``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup``, torch ``LambdaLR``\\ s) on that
  optimizer, with the warm-up step count verl's FSDP engine computes; with verl's Megatron schedule keys
  (``lr_decay_style``, ``min_lr``, ...) megatron-core's ``OptimizerParamScheduler`` as verl's Megatron engine builds
  it, biases and norms not decayed (:mod:`.optim`). Then offloaded when verl's flags say so.
  ``model.override_config`` entries that would change the model are refused (:mod:`.overrides`).
* ``forward_backward_batch`` (training): verl's global token count (``loss_mask`` summed over the data-parallel
  group) and ``dp_size`` go into the batch as verl's FSDP engine puts them; the mini-batch (verl's nested
  ``[b, j]`` rows, padded here into ``[B, S]`` + ``attention_mask``, plus each row's index) runs through ONE
  ``parallm.forward_backward(chunks, batch, loss_fn=..., num_microbatches=B / micro_batch_size_per_gpu)`` call
  (verl's dynamic batch size: ``max_tokens_per_microbatch=max_token_len_per_gpu``), so at pp > 1 every
  micro-batch shares one pipeline schedule. Every check of the batch (:func:`.batch.prepare`) runs inside
  parallm's agreement first, so a batch refused on one rank is refused on every rank at once. ``loss_fn(out,
  mb)`` selects the micro-batch's rows of verl's TensorDict (verl's ``index_select_tensor_dict``), moved to the
  outputs' device as verl's engines move them, turns parallm's ``[b, S]`` outputs into verl's nested
  ``log_probs`` / ``entropy`` / ``values`` and calls verl's ``loss_function(model_output=..., data=micro_batch,
  dp_group=...)``. verl's losses are already normalised for the global mini-batch (verl's engines sum the
  micro-batch losses and average over data-parallel replicas), so ``loss_fn`` returns ``(loss, share)`` with
  ``share`` = the micro-batch's rows / the replica's rows: parallm's token-mean normalisation then divides by
  ``sum(share) = dp`` and the gradient is verl's ``sum_m grad(loss_m) / dp``, whatever the micro-batches.
  Per-micro-batch losses, metrics (verl's ``Metric`` objects, aggregated by verl) and, when verl asks, outputs
  come back through verl's ``postprocess_batch_func`` (rows back in verl's order), on the last pipeline stage:
  verl's output ranks (``is_mp_src_rank_with_outputs``).
* ``forward_backward_batch(forward_only=True)``: ``parallm.forward`` (log-probs, entropy or values on every
  rank), by verl's micro-batches (``num_microbatches`` at pp > 1; one call per micro-batch at pp = 1, where
  ``parallm.forward`` would run the batch whole; ``max_tokens_per_microbatch`` for the dynamic batch size).
* router replay (MoE), verl's ``router_replay.mode`` on the engine config (``EngineConfig.router_replay``, the
  field verl's Megatron and VeOmni engines read): ``"R2"``: the actor's forward-only pass (``compute_log_prob``,
  a batch without ``routed_experts``) records the experts every MoE layer routed each token with and returns them
  as ``model_output["routed_experts"]``, verl's layout (nested jagged int16 ``[b, j, num_moe_layers, top_k]``,
  what verl's trainer unions into the batch); the update replays the batch's ``routed_experts``. ``"R3"``: every
  actor pass replays the batch's ``routed_experts`` (the rollout's, one slot per decoder layer from vLLM; a row
  one route short, the last generated token's, gets a placeholder route: that row only feeds the logits of the
  position past the sequence's end, which verl's losses never read). Replay is ``parallm.forward`` /
  ``forward_backward``'s ``routed_experts`` (docs/moe.md "Router replay"); a forward-only engine (verl's
  reference policy) neither records nor replays, as verl's workers flag its pass off; a batch whose
  ``enable_routing_replay`` is ``False`` is not replayed either.
* ``optimizer_step``: ``finalize_grads``, ``clip_grad_norm_(clip_grad)``, the step only when the norm is finite.
  ``optimizer_zero_grad`` also forgets the token count of a ``forward_backward`` whose step never came.
* ``to`` / ``train_mode`` / ``eval_mode``: with ``param_offload`` / ``optimizer_offload`` on, a model on an
  accelerator is moved out with ``parallm.offload`` (storages freed, host copies kept) and back with
  ``parallm.onload``; a model living in host memory (the CPU platform) has nowhere to go and stays.
* ``get_per_tensor_param``: ``parallm.export_hf_tensors(copy=True)`` (HF names, full tensors, each the
  consumer's own; collective: every rank iterates). Every export holds the parameters on the device while it
  runs and leaves them offloaded again after, if they were (:mod:`.weights`).
* ``get_per_tensor_param_shard`` / ``get_per_tensor_param_delta_shard`` (verl's ``delta_sharded`` sparse sync):
  each rank's local shards and the changed elements in HF coordinates at the rollout's bf16, one contributor per
  element, gathered over the contributing ranks (:mod:`.delta`, over
  :func:`parallm.checkpoint.shards.hf_shard_map`); verl's ``prime_delta_snapshots`` snapshots the shards.
* checkpoints: ``parallm.save_checkpoint`` / ``load_checkpoint`` (any layout) with the LR schedule's state and
  the random generators, as verl's ``save_contents`` / ``load_contents`` say, and an HF export when they ask for
  ``hf_model`` (:mod:`.checkpoints`).

The code by concern: this module (the engine class: layout, build, modes and offload, forward / backward, optimizer
step), :mod:`.options` (``parallm_options``: parallm's own block), :mod:`.batch` (verl's batches as parallm's and
back), :mod:`.optim` (AdamW and verl's LR schedules), :mod:`.weights` (the rollout's weights) over :mod:`.delta`,
:mod:`.checkpoints`, :mod:`.overrides` (verl's ``override_config``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
from verl.workers.engine.utils import detach_tree, postprocess_batch_func

import parallm
from parallm.parallel.errors import run_local

from .batch import ROUTED, ROW_KEY, Prepared, _nested, micro_batch, output_device, prepare, router_replay_mode
from .optim import build_lr_scheduler, build_optimizer
from .checkpoints import Checkpoints
from .options import parallm_options
from .overrides import check_overrides
from .weights import RolloutWeights

__all__ = ["ParallmEngine", "ParallmEngineWithLMHead", "ParallmEngineWithValueHead", "register_engines",
           "parallm_options", "build_lr_scheduler"]


class ParallmEngine(RolloutWeights, Checkpoints, BaseEngine):
    """A verl ``BaseEngine`` over parallm (see the module docstring for what each call does)."""

    task = "causal_lm"

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.options = parallm_options(engine_config)
        self.router_replay = router_replay_mode(engine_config)
        self.mode = None
        self.chunks = None
        self.optimizer = None
        self.lr_scheduler = None
        self.device_type = None         # where the parameters live (set by initialize)
        self._saved: list[str] = []
        self._shards = None             # the delta export's shard map (.delta), built on first use
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
        if (getattr(self.model_config, "lora_rank", 0) or 0) > 0:
            raise NotImplementedError(f"parallm engine: LoRA (model.lora_rank={self.model_config.lora_rank}) is "
                                      "not supported by this engine; set lora_rank=0 (full fine-tuning)")
        path = self.model_config.local_path
        run_local(lambda: check_overrides(self.model_config), what="parallm engine: initialize")
        dtype = getattr(torch, o["dtype"])
        self.chunks = parallm.build_model(path, task=self.task, dtype=dtype, packed=o["packed"],
                                          recompute=o["recompute"], attn_impl=o["attn_impl"])
        parallm.load_hf_weights(self.chunks, path, progress=False)
        self.device_type = next(self.chunks[0].parameters()).device.type
        self.pad_token_id = getattr(self.model_config.hf_config, "pad_token_id", None) or 0
        if not self.engine_config.forward_only:
            self.optimizer = build_optimizer(self.chunks, self.optimizer_config)
            self.lr_scheduler = build_lr_scheduler(self.optimizer, self.optimizer_config)
        self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled,
                grad=self.is_param_offload_enabled)
        d = self.dims
        if d.rank == 0:        # one line per engine in the worker's log: what verl's config and parallm's block built
            print(f"parallm engine: {self.task} {path} at tp={d.tp} pp={d.pp} vpp={d.vpp} cp={d.cp} ep={d.ep} "
                  f"dp={d.dp}, {o['dtype']}, {'forward only' if self.engine_config.forward_only else 'training'}"
                  + "".join(f", {k}={o[k]}" for k in ("packed", "recompute") if o[k])
                  + (f", router_replay={self.router_replay}" if self.router_replay != "disabled" else ""),
                  flush=True)

    # -- modes and offload ----------------------------------------------------------------------------------
    def train_mode(self, **kwargs):
        return _Mode(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _Mode(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """``"cpu"``: ``parallm.offload`` of the chosen kinds (parameters, gradients, optimizer state) of a model
        that lives on an accelerator; the accelerator's name (verl's ``get_device_name()``): ``parallm.onload``
        of them. A model whose home is host memory stays where it is (there is nothing to free)."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if self.chunks is None or self.device_type == "cpu":
            return
        target = torch.device(device).type
        kinds = {"params": model, "grads": grad, "optimizer_state": optimizer and self.optimizer is not None}
        if target == "cpu":
            parallm.offload(self.chunks, self.optimizer, **kinds)
        elif target == self.device_type:
            parallm.onload(self.chunks, self.optimizer, **kinds)
        else:
            raise ValueError(f"parallm engine: to({device!r}); this model lives on {self.device_type}")

    @contextlib.contextmanager
    def _resident(self, kinds=("params", "grads", "optimizer_state")):
        """What of ``kinds`` is offloaded brought back for the block (a checkpoint, a weight export), then
        offloaded again as it was, also when the block fails or a generator running it is closed. Nested blocks
        (a weight export inside another) leave the restoring to the outermost."""
        from parallm.train.offload import _held
        held = _held(self.chunks) if self.chunks is not None else {}
        back = {k: k in kinds and bool(held.get(k)) for k in ("params", "grads", "optimizer_state")}
        if any(back.values()):
            parallm.onload(self.chunks, self.optimizer, **back)
        try:
            yield
        finally:
            if any(back.values()):
                parallm.offload(self.chunks, self.optimizer, **back)

    # -- forward / backward ---------------------------------------------------------------------------------
    def _model_output(self, out, lengths: list[int], calculate_entropy: bool) -> dict:
        if self.task == "value":
            return {"values": _nested(out, lengths)}
        if isinstance(out, parallm.TokenStats):
            result = {"log_probs": _nested(out.logprobs, lengths)}
            if calculate_entropy:
                result["entropy"] = _nested(out.entropy, lengths)
            return result
        return {"log_probs": _nested(out, lengths)}

    def _routing(self, data: TensorDict, forward_only: bool) -> str | None:
        """What this pass does with MoE routing, as verl 0.9.1's Megatron engine decides it
        (``forward_backward_batch``: ``record_r2_routes``, ``REPLAY_FORWARD``): ``"record"`` (R2, forward-only,
        no ``routed_experts`` in the batch), ``"replay"`` (R2 with ``routed_experts``; R3 always) or ``None``."""
        if self.router_replay == "disabled" or getattr(self.engine_config, "forward_only", False):
            return None
        if not tu.get_non_tensor_data(data=data, key="enable_routing_replay", default=True):
            return None
        if ROUTED in data.keys():
            return "replay"
        if self.router_replay == "R2" and forward_only:
            return "record"
        raise ValueError(f"parallm engine: router_replay.mode={self.router_replay} and this "
                         f"{'forward-only ' if forward_only else 'training '}batch carries no {ROUTED!r}: "
                         + ("R2 replays what the old-log-prob pass recorded (verl's trainer unions it into the "
                            "batch)" if self.router_replay == "R2" else
                            "R3 replays the rollout's experts (rollout.enable_rollout_routing_replay=True)"))

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        def local():          # every check of the batch, inside the agreement: refused on every rank at once
            if not forward_only and loss_function is None:
                raise ValueError("parallm engine: forward_backward_batch(forward_only=False) needs a loss_function")
            return prepare(data, pad_token_id=self.pad_token_id, value=self.task == "value",
                           routing=self._routing(data, forward_only), short_ok=self.router_replay == "R3")

        b = run_local(local, what="parallm engine: verl's batch")
        self._global_tokens(data, b.tokens)
        if forward_only:
            output_lst, indices = self._forward_only(data, loss_function, b)
            return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)
        return_model_output = bool(tu.get_non_tensor_data(data=data, key="return_model_output", default=False))
        dp_group = self.get_data_parallel_group()
        rows_here = len(data)
        captured = []      # (rows, {"loss", "metrics"[, "model_output"]}) per micro-batch, in schedule order

        def loss_fn(out, mb):
            rows = mb[ROW_KEY].cpu()
            model_output = self._model_output(out, b.lengths[rows].tolist(), b.calculate_entropy)
            micro = micro_batch(data, rows, output_device(model_output))
            loss, metrics = loss_function(model_output=model_output, data=micro, dp_group=dp_group)
            entry = {"loss": float(loss.detach().item()), "metrics": metrics}
            if return_model_output:
                entry["model_output"] = detach_tree(model_output)
            captured.append((rows.tolist(), entry))
            # verl's loss is normalised for the global mini-batch; the shares add up to 1 per replica, so
            # parallm's division by their sum over replicas is verl's average over data-parallel replicas
            return loss, rows.numel() / rows_here

        batch = {"input_ids": b.ids, "attention_mask": b.mask, "position_ids": b.pos,
                 ROW_KEY: torch.arange(len(data), dtype=torch.long)}
        if b.routes is not None:
            batch[ROUTED] = b.routes       # [B, S, L, k]: split with the micro-batches like the other rows
        parallm.forward_backward(self.chunks, batch, loss_fn=loss_fn, output=b.output, temperature=b.temperature,
                                 **b.split)
        indices = [rows for rows, _ in captured] if "max_tokens_per_microbatch" in b.split else None
        return postprocess_batch_func(output_lst=[entry for _, entry in captured], indices=indices, data=data)

    def _global_tokens(self, data: TensorDict, local: float) -> None:
        """verl's ``batch_num_tokens`` (``loss_mask`` summed over the data-parallel group, reduced on the group's
        device as verl's engines reduce it: an NCCL group serves no CPU tensor) and ``dp_size`` into ``data``."""
        from parallm.parallel.state import group_device
        group = self.get_data_parallel_group()
        tokens = torch.tensor(local, dtype=torch.float64, device=group_device(group))
        if self.dims.dp > 1:
            dist.all_reduce(tokens, op=dist.ReduceOp.SUM, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())

    def _forward_only(self, data, loss_function, prepared: Prepared):
        """Outputs of the whole mini-batch by verl's micro-batches; with a ``loss_function`` (verl's SFT
        evaluation) its loss per micro-batch (fixed size), or over the mini-batch at once (dynamic size).
        ``prepared.routes`` (``[B, S, L, k]``): replayed; ``prepared.record``: the routed experts come back as
        verl's ``routed_experts`` (nested int16 ``[b, j, L, k]``) in each micro-batch's ``model_output``."""
        ids, mask, pos, lengths, split = prepared.ids, prepared.mask, prepared.pos, prepared.lengths, prepared.split
        output, temperature, routes, record = prepared.output, prepared.temperature, prepared.routes, prepared.record
        calculate_entropy = prepared.calculate_entropy
        b = ids.shape[0]
        routed = None
        if "num_microbatches" in split and self.dims.pp == 1:
            m = split["num_microbatches"]
            route_parts = routes.tensor_split(m) if routes is not None else [None] * m
            parts = [parallm.forward(self.chunks, i, a, p, output=output, temperature=temperature,
                                     routed_experts=r, return_routed_experts=record)
                     for i, a, p, r in zip(ids.tensor_split(m), mask.tensor_split(m), pos.tensor_split(m),
                                           route_parts)]
            if record:
                routed = torch.cat([x[1] for x in parts])
                parts = [x[0] for x in parts]
            out = parallm.TokenStats(torch.cat([x.logprobs for x in parts]), torch.cat([x.entropy for x in parts])) \
                if isinstance(parts[0], parallm.TokenStats) else torch.cat(parts)
        else:
            out = parallm.forward(self.chunks, ids, mask, pos, output=output, temperature=temperature,
                                  routed_experts=routes, return_routed_experts=record, **split)
            if record:
                out, routed = out
        groups = [list(r) for r in torch.arange(b).tensor_split(split["num_microbatches"])] \
            if "num_microbatches" in split else [list(range(b))]
        groups = [[int(i) for i in g] for g in groups]
        output_lst = []
        for rows in groups:
            index = torch.tensor(rows, dtype=torch.long)
            piece = parallm.TokenStats(out.logprobs[index], out.entropy[index]) \
                if isinstance(out, parallm.TokenStats) else out[index]
            model_output = self._model_output(piece, lengths[index].tolist(), calculate_entropy)
            if routed is not None:
                model_output[ROUTED] = _nested(routed[index].to(torch.int16), lengths[index].tolist())
            entry = {"model_output": model_output, "loss": 0.0, "metrics": {}}
            if loss_function is not None:
                micro = micro_batch(data, index, output_device(model_output))
                loss, metrics = loss_function(model_output=model_output, data=micro,
                                              dp_group=self.get_data_parallel_group())
                entry["loss"], entry["metrics"] = float(loss.detach().item()), metrics
            output_lst.append(entry)
        return output_lst, (groups if "max_tokens_per_microbatch" in split else None)

    # -- optimizer ------------------------------------------------------------------------------------------
    def optimizer_zero_grad(self):
        """Zero the gradients and forget the token count a ``forward_backward`` left for ``finalize_grads``
        (a step abandoned between the two, e.g. by an exception in verl's post-processing, would otherwise
        divide the next step's gradients by both counts)."""
        self.optimizer.zero_grad()
        self.chunks[0].pending_tokens = None

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


# the engines are registered when this module is imported (the package imports it as soon as verl's engine
# package is, or this module imports that package itself)
register_engines()
