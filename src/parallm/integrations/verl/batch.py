"""verl's batches as parallm's and parallm's outputs as verl's: the NO_PADDING (nested jagged) TensorDict rows padded
into ``[B, S]``, the micro-batch settings, the temperature, router-replay routes, and the outputs turned back into
verl's nested layout. Local work only (no collective): the engine runs the checks here inside parallm's agreement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu

__all__ = ["ROW_KEY", "ROUTED", "Prepared", "micro_batch", "micro_batching", "output_device", "prepare",
           "router_replay_mode"]

ROW_KEY = "verl_row"      # the batch entry carrying each row's index in verl's mini-batch


def _padded(data: TensorDict, pad_token_id: int):
    """verl's NO_PADDING batch (nested jagged ``input_ids`` / ``position_ids`` ``[B, j]``) as parallm's
    right-padded ``[B, S]`` ``input_ids``, ``attention_mask``, ``position_ids``, and the row lengths ``[B]``."""
    input_ids = data["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("parallm engine: verl's NO_PADDING batches (nested input_ids) only; got a dense tensor")
    lengths = input_ids.offsets().diff()
    b, s = lengths.numel(), int(lengths.max().item()) if lengths.numel() else 0
    ids = torch.nested.to_padded_tensor(input_ids, padding=pad_token_id, output_size=(b, s))
    position_ids = data["position_ids"]
    if position_ids.dim() == 3:
        raise ValueError("parallm engine: 3-D (multimodal rope) position_ids are not supported")
    pos = torch.nested.to_padded_tensor(position_ids, padding=0, output_size=(b, s))
    mask = (torch.arange(s, device=ids.device)[None, :] < lengths[:, None].to(ids.device)).long()
    return ids, mask, pos, lengths.cpu()


def _nested(padded: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """parallm's ``[b, S, ...]`` output, row r's first ``lengths[r]`` positions, as verl's nested jagged
    ``[b, j, ...]``."""
    flat = torch.cat([padded[r, :n] for r, n in enumerate(lengths)]) if lengths else padded.new_zeros(0)
    offsets = torch.tensor([0, *lengths], device=flat.device).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(flat, offsets)


ROUTED = "routed_experts"   # verl's TensorDict key for router replay (trainer, workers, Megatron engine)


def router_replay_mode(engine_config) -> str:
    """verl's ``router_replay.mode`` on an engine config (``"disabled"``, ``"R2"`` or ``"R3"``); a dataclass
    (``EngineRouterReplayConfig``) or a mapping (an OmegaConf node added with ``+...router_replay.mode=R2``)."""
    rr = getattr(engine_config, "router_replay", None)
    mode = rr.get("mode") if isinstance(rr, dict) else getattr(rr, "mode", None)
    mode = mode or "disabled"
    if mode not in ("disabled", "R2", "R3"):
        raise ValueError(f"parallm engine: router_replay.mode={mode!r}; verl's modes are 'disabled', 'R2', 'R3'")
    return mode


def _routes_padded(routed: torch.Tensor, lengths: torch.Tensor, s: int, *, short_ok: bool) -> torch.Tensor:
    """verl's ``routed_experts`` (nested jagged ``[B, j, L, k]``, rows as ``input_ids``: what verl's
    ``left_right_2_no_padding`` makes of the rollout's padded tensor, or what the R2 record returned) as
    parallm's right-padded ``[B, s, L, k]`` int64 (0 at padding: ignored there). ``short_ok`` (R3): a row one
    route short (autoregressive rollouts record none for the last generated token) gets ``0 .. k-1`` for its
    last token, a valid placeholder whose routing only reaches that position's own logits."""
    if not routed.is_nested:
        raise ValueError(f"parallm engine: routed_experts must be verl's nested jagged [B, j, layers, top_k] "
                         f"(left_right_2_no_padding makes it); got a dense {tuple(routed.shape)}")
    parts = list(routed.unbind())
    if len(parts) != lengths.numel():
        raise ValueError(f"parallm engine: routed_experts has {len(parts)} rows for {lengths.numel()} sequences")
    if parts[0].dim() != 3:
        raise ValueError(f"parallm engine: routed_experts rows must be [j, layers, top_k]; got "
                         f"{tuple(parts[0].shape)}")
    layers, k = parts[0].shape[1:]
    out = torch.zeros(len(parts), s, layers, k, dtype=torch.long)
    for r, (p, n) in enumerate(zip(parts, lengths.tolist())):
        if p.shape[0] == n - 1 and short_ok:
            p = torch.cat([p.to(torch.long), torch.arange(k, dtype=torch.long).expand(1, layers, k)])
        if p.shape[0] != n:
            raise ValueError(f"parallm engine: routed_experts row {r} has {p.shape[0]} routes for its {n} tokens"
                             + ("" if short_ok else " (router_replay.mode R2 replays what the forward-only "
                                                    "pass recorded: one route per token)"))
        out[r, :n] = p.to(torch.long)
    return out


def _temperature(data: TensorDict) -> float:
    t = data["temperature"] if "temperature" in data.keys() else 1.0
    if isinstance(t, torch.Tensor):
        t = t.reshape(-1)
        if t.numel() and not torch.all(t == t[0]):
            raise ValueError("parallm engine: per-sample temperatures differ within a mini-batch "
                             f"({sorted(set(t.tolist()))}); parallm's log-probs take one temperature per call")
        t = float(t[0]) if t.numel() else 1.0
    return float(t)


def micro_batching(data: TensorDict) -> dict:
    """verl's micro-batch settings as parallm's keyword: ``{"num_microbatches": B / micro_batch_size_per_gpu}``,
    or, with verl's dynamic batch size, ``{"max_tokens_per_microbatch": max_token_len_per_gpu}`` (parallm's
    token budget: the fewest bins of at most that many tokens, the count agreed over data-parallel replicas, as
    verl's ``rearrange_micro_batches`` does; the bins differ from verl's, which changes no gradient: verl's
    losses are sums over sequences normalised for the whole mini-batch)."""
    if tu.get_non_tensor_data(data=data, key="force_group_size", default=1) != 1:
        raise NotImplementedError("parallm engine: force_group_size > 1 (verl's reward-model pairs) is not "
                                  "supported")
    if tu.get_non_tensor_data(data=data, key="sp_size", default=1) != 1:
        raise NotImplementedError("parallm engine: ulysses sequence parallelism; use parallm's cp instead")
    if tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True):
        budget = data["max_token_len_per_gpu"]
        return {"max_tokens_per_microbatch": int(budget)}
    b = len(data)
    size = int(data["micro_batch_size_per_gpu"])
    if size < 1 or b % size:
        raise ValueError(f"parallm engine: the mini-batch of {b} rows on this data-parallel rank does not split "
                         f"into micro-batches of micro_batch_size_per_gpu={size}")
    return {"num_microbatches": b // size}


@dataclass
class Prepared:
    """One mini-batch as parallm takes it (:func:`prepare`): right-padded ``ids`` / ``mask`` / ``pos`` ``[B, S]``,
    the row ``lengths``, parallm's micro-batch keyword ``split``, the ``output`` kind (None: values), the
    ``temperature``, the replayed ``routes`` ``[B, S, L, k]`` (or None), whether to ``record`` routes, and this
    rank's ``tokens`` (``loss_mask`` summed)."""
    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    lengths: torch.Tensor
    split: dict
    output: str | None
    calculate_entropy: bool
    temperature: float
    routes: torch.Tensor | None
    record: bool
    tokens: float


def prepare(data: TensorDict, *, pad_token_id: int, value: bool, routing: str | None, short_ok: bool) -> Prepared:
    """Every check and conversion of verl's mini-batch that needs no collective: the engine runs it inside
    parallm's agreement (``run_local``), so a batch refused on one rank is refused on every rank at once.
    ``routing``: ``"replay"`` / ``"record"`` / None (the engine's decision); ``short_ok``: R3's one-short rows."""
    split = micro_batching(data)
    ids, mask, pos, lengths = _padded(data, pad_token_id)
    calculate_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
    output = None if value else ("logprobs+entropy" if calculate_entropy else "logprobs")
    routes = _routes_padded(data[ROUTED], lengths, ids.shape[1], short_ok=short_ok) if routing == "replay" else None
    tokens = float(data["loss_mask"].sum().to(torch.float64).item()) if "loss_mask" in data.keys() else 0.0
    return Prepared(ids, mask, pos, lengths, split, output, calculate_entropy, _temperature(data), routes,
                    routing == "record", tokens)


def output_device(model_output: dict) -> torch.device:
    """Where the model's outputs for verl's loss live (the parameters' device)."""
    return next(iter(model_output.values())).device


def micro_batch(data: TensorDict, rows: torch.Tensor, device) -> TensorDict:
    """Rows ``rows`` of verl's mini-batch (verl's ``index_select_tensor_dict``) on ``device``, the model
    output's device: verl's worker hands the engine CPU TensorDicts, and verl's losses combine the micro-batch
    with the outputs (``log_prob - old_log_prob``), as verl's FSDP and Megatron engines move each micro-batch."""
    return tu.index_select_tensor_dict(data, rows).to(device)
