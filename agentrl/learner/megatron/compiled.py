"""``torch.compile`` for the learner's own kernels: any micro-batch length, never silently eager.

Packed micro-batches come in many lengths (any multiple of 128 up to the token budget) and every
kernel runs with and without grad. Compiled with ``dynamic=False``, RMSNorm, RoPE and FlexAttention
recompiled for each new length and grad mode until dynamo's recompile limit (8); past it dynamo
runs the function *eagerly*, and eager FlexAttention materializes the [heads, t, t] score matrix
(3 GiB at 8192 tokens): a slow step at best, out of memory at worst. Here, instead:

* automatic dynamic shapes (``dynamic=None``): the first length compiles with static shapes, the
  first *other* length recompiles with the length symbolic, and that graph serves every length
  after it. Per function and input layout that is at most 2 graphs per grad mode, whatever the
  lengths (``tests/test_megatron_compile.py`` counts them);
* ``fullgraph=True``: a graph break, or reaching the recompile limit, raises
  (``torch._dynamo.exc.Unsupported`` / ``FailOnRecompileLimitHit``) instead of running eagerly;
* FlexAttention sees the length as ``n * 128`` (q/k/v viewed as [1, h, n, 128, d]), so its
  symbolic-length kernels still know that the length divides their tiles (``IS_DIVISIBLE``: no
  bounds checks), as the static ones do; grouped (GQA) and repeated K/V heads are separate
  functions, so a head count never turns symbolic;
* ``recompile_limit`` raised to :data:`RECOMPILE_LIMIT` (if lower): the graphs above, times the
  input layouts of one function (RMSNorm on hidden states and on q/k heads; RoPE on q and k), are
  at most 16; the rest is headroom for a process that builds more than one model shape.

Only CUDA tensors go through here; CPU callers use the eager functions (FlexAttention has no CPU
backward).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention as _flex

__all__ = ["RECOMPILE_LIMIT", "compiled", "flex_attention"]

RECOMPILE_LIMIT = 32
BACKEND: Any = "inductor"  # tests count graphs with a dynamo CompileCounter here
DYNAMIC: bool | None = None  # torch.compile's ``dynamic``; bench/learner.py --static-compile sets False (A/B)
_COMPILED: dict[Callable, Callable] = {}


def compiled(fn: Callable) -> Callable:
    """``fn`` under ``torch.compile(fullgraph=True, dynamic=None)``, made once per function."""
    if fn not in _COMPILED:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
        _COMPILED[fn] = torch.compile(fn, fullgraph=True, dynamic=DYNAMIC, backend=BACKEND)
    return _COMPILED[fn]


def reset() -> None:
    """Forget the compiled functions (tests: a new ``BACKEND``); dynamo's caches are reset too."""
    _COMPILED.clear()
    torch._dynamo.reset()


_TILE = 128  # what torch's FlexAttention lowering checks the lengths against for IS_DIVISIBLE


def _tiles(x: Tensor) -> Tensor:
    """[1, h, t, d] -> [1, h, t / 128, 128, d] (a view) when 128 divides t, else ``x``."""
    t = x.shape[2]
    return x.unflatten(2, (t // _TILE, _TILE)) if t % _TILE == 0 else x


def _untile(x: Tensor) -> Tensor:
    return x.flatten(2, 3) if x.dim() == 5 else x


def _flex_gqa(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    return _flex(_untile(q), _untile(k), _untile(v), block_mask=block_mask, scale=scale, enable_gqa=True)


def _flex_mha(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    return _flex(_untile(q), _untile(k), _untile(v), block_mask=block_mask, scale=scale)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any, scale: float) -> Tensor:
    """Compiled FlexAttention: ``q`` [1, Hq, t, D] against ``k``/``v`` [1, Hkv, T, D] -> [1, Hq, t, D].

    Grouped-query attention when ``Hq != Hkv``. Any lengths; see the module doc for what is
    compiled how.
    """
    fn = compiled(_flex_gqa if q.shape[1] != k.shape[1] else _flex_mha)
    return fn(_tiles(q), _tiles(k), _tiles(v), block_mask, scale)
