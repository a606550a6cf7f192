"""bench/attention.py: the learner's core attention paths timed side by side (CPU dry run)."""

from __future__ import annotations

import pytest


def test_attention_bench_times_the_learners_core_attention_paths_side_by_side(tmp_path):
    """bench/attention.py (CPU dry run): every backend it ran has times, FLOP rate and its agreement
    with the reference backend; an unknown backend is refused by name."""
    import json

    from bench import attention

    # causal forward 2·L²·heads·dim, backward 2.5× that: 3.5 · 2 · 1024² · 12 · 128 FLOPs in 1 ms
    assert attention.attention_tflops(1024, 12, 128, 1e-3) == pytest.approx(3.5 * 2 * 1024**2 * 12 * 128 / 1e-3 / 1e12)
    out = tmp_path / "att.json"
    rows = attention.main(["--cpu", "--lengths", "128,256", "--iters", "2", "--json", str(out)])
    assert [(r["length"], r["backend"]) for r in rows] == [
        (n, b) for n in (128, 256) for b in ("sdpa-math", "sdpa-default", "sdpa-math+kvrep", "auto")]
    for r in rows:
        assert "error" not in r and r["forward_backward_ms"] > 0 and r["tflops"] > 0, r
        assert r["reference_backend"] == "sdpa-math"
        if not r.get("reference"):
            assert r["out_rel_err"] < 1e-4 and r["dq_rel_err"] < 1e-4, r  # float32: the same attention
    assert json.loads(out.read_text())["rows"] == rows
    # packed: 4 documents of 64 tokens a row, each attending within itself (a quarter of one
    # document's causal FLOPs); the same agreement with the reference
    packed = attention.main(["--cpu", "--lengths", "256", "--docs", "1,4", "--iters", "1"])
    assert [r["docs"] for r in packed] == [1] * 4 + [4] * 4
    assert all(r.get("reference") or r["out_rel_err"] < 1e-4 for r in packed), packed
    assert attention.attention_tflops(256, 12, 128, 1e-3, docs=4) == pytest.approx(
        attention.attention_tflops(64, 12, 128, 1e-3) * 4)
    with pytest.raises(SystemExit):
        attention.main(["--cpu", "--lengths", "8", "--docs", "9"])
    with pytest.raises(SystemExit):
        attention.main(["--cpu", "--backends", "flex,nope"])
