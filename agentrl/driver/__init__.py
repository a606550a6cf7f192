"""driver/: the jobs a run is made of, and the loop that drives the actors.

``trainer`` (the asynchronous RL run: its actors in ``state``, its fault handling in ``supervision``,
its loop's modes in ``loop`` and ``fixed_lag``; refits are :mod:`agentrl.weights.sync`'s), ``pipeline``
(bootstrap -> SFT -> RL -> eval), ``sft``, ``evaluate``, ``watchdog`` (deadlines and stack reports),
``metrics`` and ``progress``. The top of the import order: nothing below imports it, bar the
watchdog's plain data. Names are imported on first use (``trainer`` imports Ray).
"""

from agentrl._lazy import lazy_exports

_EXPORTS = {
    "Trainer": "trainer", "train": "pipeline", "run_sft": "sft", "evaluate_model": "evaluate",
    "MetricsLogger": "metrics", "TrainProgress": "progress",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
