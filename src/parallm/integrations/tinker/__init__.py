"""parallm as a Tinker-API server: the ``tinker`` SDK (0.38.x) and tinker-cookbook's training loops, unmodified,
train LoRA clients on a model split over parallm's ranks (``parallm serve-tinker --model M --tp 2 --port 8000``,
docs/tinker.md). Importing this package imports neither the SDK nor vLLM; the server needs the SDK
(``pip install 'parallm[tinker]'``: its request types and protobuf messages are the wire format).

One concern per module:

- :mod:`.launcher`: the command's options, starting the ranks; :mod:`.server`: one rank (build the model, then
  serve or follow);
- :mod:`.frontend`: what a request means (routes, API key, size, error bodies); :mod:`.http_app`: the HTTP
  server carrying it (aiohttp: keep-alive, async long polls); :mod:`.protocol`: the SDK's wire format (JSON request
  types, the protobuf of ``forward_backward`` and of its results, version check);
- :mod:`.service`: sessions, futures, per-client request order, listings; :mod:`.training_routes` and
  :mod:`.sampling_routes`: the routes that do work; :mod:`.futures`: request ids and long-polled results;
- :mod:`.dispatch`: rank 0 broadcasts each work item to every rank, errors reach every request, never a hang;
- :mod:`.trainer`: what every rank does per item; :mod:`.clients`: several LoRA clients on one model;
  :mod:`.full`: a full-fine-tuning client (LoRA rank 0) on a model of its own;
  :mod:`.batch`: datums -> parallm batches and the loss hook; :mod:`.losses`: Tinker's losses;
- :mod:`.sampling`: the sampling jobs and the vLLM (``vllm serve``) engine sampler; :mod:`.parallm_sampler`:
  parallm's own forwards; :mod:`.router`: several engines; :mod:`.remote_engine`: engines started elsewhere
  (``--engine-url``); :mod:`.checkpoints`: ``tinker://`` paths.
"""

from .launcher import add_arguments, main, run

__all__ = ["add_arguments", "main", "run"]
