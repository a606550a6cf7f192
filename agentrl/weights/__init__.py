"""weights/: moving the learner's weights into the engines (refits), and the one owner of weight versions.

``transports``: every refit transport (object store, CUDA IPC, NCCL broadcast) over one flat layout,
knowing nothing of Ray or vLLM; ``vllm_worker``: the engine side, loaded into vLLM's workers by a
dotted path; ``store``: the staged weights a (re)starting engine loads (held by
:mod:`agentrl.actors.weights`); ``sync``: the driver's side, :class:`WeightService` (refits, which
version every engine serves, sleep and wake when colocated), the only module here that uses Ray.
Names are imported on first use.
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {
    "TRANSPORTS": "transports", "FlatSpec": "transports", "RefitPayload": "transports",
    "WeightGroup": "transports", "flatten_weights": "transports", "resolve_transport": "transports",
    "WeightSyncExtension": "vllm_worker", "WeightService": "sync", "Waits": "sync",
    "StagedWeights": "store",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
