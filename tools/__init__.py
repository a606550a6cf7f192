"""Diagnostics: each script answers one question about a model, a run or a component (its
docstring's first line says which). Benchmarks, which print ratios measured side by side, are in
``bench/``. A package so that ``tools.slow_envs:SlowCalculator-v0`` imports (and ships to Ray
workers) like any env module."""
