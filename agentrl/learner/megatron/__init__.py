"""Megatron-Core learner backend (``learner.backend: megatron``).

Modules: ``convert`` (HF <-> Megatron weights, pure torch), ``model`` (GPTModel from an HF config),
``attention`` (packed document-causal core attention), ``logprobs`` (vocab-parallel chunked
logprobs), ``parallel`` (distributed setup), ``weights`` / ``checkpoint`` (loading, gathering,
saving), ``learner`` (``MegatronLearner``), ``cp_attention`` (context parallelism), ``graphs`` (CUDA
graphs of the decoder), ``compiled`` (torch.compile of the learner's kernels: any length, never eager).
Nothing is imported here, so ``convert`` works without Megatron-Core installed.
"""

__all__: list[str] = []
