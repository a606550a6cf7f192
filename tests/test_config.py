import json
import warnings
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentrl.config import (
    FAST_OPTIONS,
    Config,
    ConfigError,
    MegatronConfig,
    load_config,
    resolve_fast_options,
)

CONFIGS = sorted(Path(__file__).resolve().parents[1].joinpath("configs").glob("*.yaml"))


def test_defaults_validate():
    cfg = load_config(None)
    assert isinstance(cfg, Config)
    assert cfg.loss.importance_sampling.type == "token_tis"


def test_dotted_overrides_parse_yaml_scalars():
    cfg = load_config(None, ["replay.max_staleness=0", "loss.importance_sampling.cap=3.5", "cluster.address=null"])
    assert cfg.replay.max_staleness == 0
    assert cfg.loss.importance_sampling.cap == 3.5
    assert cfg.cluster.address is None


def test_unknown_key_names_the_dotted_path_and_suggests():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["replay.max_stalenes=2"])
    msg = str(err.value)
    assert "replay.max_stalenes" in msg and "did you mean 'replay.max_staleness'" in msg


def test_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"rollout\.group_size"):
        load_config(None, ["rollout.group_size=many"])


def test_bad_literal_lists_allowed_values():
    with pytest.raises(ConfigError, match="token_tis"):
        load_config(None, ["loss.importance_sampling.type=magic"])


def test_cross_check_context_parallel_padding():
    with pytest.raises(ConfigError, match="pad_multiple"):
        load_config(None, ["learner.backend=megatron", "learner.num_gpus=2",
                           "learner.megatron.context_parallel_size=2", "packing.pad_multiple=3"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    notmap = tmp_path / "list.yaml"
    notmap.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(notmap)


def test_malformed_override():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config(None, ["replay.max_staleness"])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path):
    load_config(path)


def test_there_are_shipped_configs():
    assert CONFIGS, "configs/ holds no YAML"


def test_cuda_graphs_refuses_what_it_does_not_support():
    base = ["learner.backend=megatron", "learner.num_gpus=2", "learner.megatron.cuda_graphs=true"]
    load_config(None, base)  # TP = PP = CP = 1, flex: accepted
    for bad, key in (("learner.megatron.tensor_parallel_size=2", "tensor_parallel_size=2"),
                     ("learner.megatron.activation_checkpointing=true", "activation_checkpointing=True"),
                     ("learner.megatron.attention=sdpa", "attention=sdpa")):
        with pytest.raises(ConfigError, match=f"cuda_graphs.*{key}"):
            load_config(None, [*base, bad])


MEGATRON = ["learner.backend=megatron"]
ALL_ON = dict.fromkeys(FAST_OPTIONS, True)


def _fast(cfg: Config) -> dict[str, bool]:
    return {k: getattr(cfg.learner.megatron, k) for k in FAST_OPTIONS}


@pytest.mark.parametrize(
    ("layout", "expected"),
    [
        ([], ALL_ON),  # one GPU, attention auto: every fast option runs
        (["learner.megatron.attention=flex"], ALL_ON),
        (["learner.num_gpus=2", "learner.megatron.tensor_parallel_size=2"],
         {**ALL_ON, "cuda_graphs": False, "fused_logprobs": False}),
        (["learner.num_gpus=2", "learner.megatron.pipeline_parallel_size=2"], {**ALL_ON, "cuda_graphs": False}),
        (["learner.num_gpus=2", "learner.megatron.context_parallel_size=2", "packing.pad_multiple=4"],
         {**ALL_ON, "cuda_graphs": False, "flex_expand_kv": False}),
        (["learner.megatron.activation_checkpointing=true"],
         {**ALL_ON, "cuda_graphs": False, "keep_grad_logits": False}),
        (["learner.megatron.attention=sdpa"], {**ALL_ON, "cuda_graphs": False, "flex_expand_kv": False}),
    ],
    ids=["1gpu", "flex", "tp2", "pp2", "cp2", "act_ckpt", "sdpa"],
)
def test_fast_options_default_to_on_where_they_apply(layout: list[str], expected: dict[str, bool]) -> None:
    assert MegatronConfig.model_fields["cuda_graphs"].default == "auto"
    assert MegatronConfig.model_fields["attention"].default == "auto"
    assert _fast(load_config(None, [*MEGATRON, *layout])) == expected


def test_fast_options_true_and_false_still_force() -> None:
    off = load_config(None, [*MEGATRON, *(f"learner.megatron.{k}=false" for k in FAST_OPTIONS)])
    assert _fast(off) == dict.fromkeys(FAST_OPTIONS, False)
    kept = load_config(None, [*MEGATRON, "learner.megatron.activation_checkpointing=true",
                              "learner.megatron.keep_grad_logits=true"])
    assert kept.learner.megatron.keep_grad_logits is True
    with pytest.warns(UserWarning, match="fused_logprobs .*without effect"):
        load_config(None, [*MEGATRON, "learner.num_gpus=2", "learner.megatron.tensor_parallel_size=2",
                           "learner.megatron.fused_logprobs=true"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto never warns
        load_config(None, [*MEGATRON, "learner.num_gpus=2", "learner.megatron.tensor_parallel_size=2"])


def test_fast_options_follow_later_changes_unless_forced() -> None:
    cfg = load_config(None, MEGATRON)
    mc = cfg.learner.megatron
    mc.keep_grad_logits = False
    mc.activation_checkpointing = True
    assert (mc.cuda_graphs, mc.keep_grad_logits) == (False, False)
    mc.activation_checkpointing = False
    assert (mc.cuda_graphs, mc.keep_grad_logits) == (True, False)  # auto follows; the forced one stays
    mc.keep_grad_logits = "auto"
    assert mc.keep_grad_logits is True


@settings(max_examples=60, deadline=None)
@given(
    tp=st.sampled_from([1, 2]), pp=st.sampled_from([1, 2]), cp=st.sampled_from([1, 2]),
    ckpt=st.booleans(), attention=st.sampled_from(["auto", "flex", "sdpa", "te"]),
    forced=st.dictionaries(st.sampled_from(FAST_OPTIONS), st.booleans()),
)
def test_auto_resolves_to_a_valid_config(tp, pp, cp, ckpt, attention, forced) -> None:
    layout = [*MEGATRON, f"learner.num_gpus={tp * pp * cp}", f"learner.megatron.tensor_parallel_size={tp}",
              f"learner.megatron.pipeline_parallel_size={pp}", f"learner.megatron.context_parallel_size={cp}",
              f"learner.megatron.activation_checkpointing={ckpt}", f"learner.megatron.attention={attention}",
              "packing.pad_multiple=4"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            cfg = load_config(None, [*layout, *(f"learner.megatron.{k}={v}" for k, v in forced.items())])
        except ConfigError as err:  # only a forced cuda_graphs where it cannot run is refused
            assert forced.get("cuda_graphs") and "cuda_graphs needs" in str(err)
            assert not resolve_fast_options(load_config(None, layout).learner.megatron)["cuda_graphs"]
            return
    auto = resolve_fast_options(cfg.learner.megatron)
    assert _fast(cfg) == {k: forced.get(k, auto[k]) for k in FAST_OPTIONS}


def test_print_config_shows_the_resolved_options(capsys) -> None:
    from agentrl.cli import main

    root = Path(__file__).resolve().parents[1]
    for layout, graphs in (([], True), (["learner.megatron.activation_checkpointing=true"], False)):
        with pytest.raises(SystemExit):
            main(["train", str(root / "configs" / "quickstart.yaml"), *MEGATRON, *layout, "--print-config"])
        megatron = json.loads(capsys.readouterr().out)["learner"]["megatron"]
        assert megatron["cuda_graphs"] is graphs and megatron["fused_logprobs"] is True


def test_engine_eager_auto_follows_the_device() -> None:
    assert load_config(None, []).engine.enforce_eager is True  # CPU engine: no minutes of compiling
    assert load_config(None, ["engine.num_gpus=1"]).engine.enforce_eager is False  # GPU: compiled, CUDA graphs
    assert load_config(None, ["engine.num_gpus=1", "engine.enforce_eager=true"]).engine.enforce_eager is True
    assert load_config(None, ["engine.enforce_eager=false"]).engine.enforce_eager is False


@pytest.mark.parametrize("sleep", ["true", "false"])
def test_learner_graphs_auto_are_off_beside_colocated_engines(sleep: str) -> None:
    colocated = ["learner.backend=megatron", "learner.num_gpus=1", "engine.num_gpus=0.5",
                 "colocate.enabled=true", f"colocate.engine_sleep={sleep}"]
    assert load_config(None, ["learner.backend=megatron"]).learner.megatron.cuda_graphs is True
    assert load_config(None, colocated).learner.megatron.cuda_graphs is False
    forced = load_config(None, [*colocated, "learner.megatron.cuda_graphs=true"])
    assert forced.learner.megatron.cuda_graphs is True  # an explicit choice is kept


def test_overlap_steps_refused_with_sleeping_engines():
    gpu = ["colocate.enabled=true", "engine.num_gpus=0.5", "learner.num_gpus=1"]
    with pytest.raises(ConfigError, match="overlap_steps=true cannot run with colocate.engine_sleep"):
        load_config(None, ["train.overlap_steps=true", *gpu])
    assert load_config(None, ["train.overlap_steps=true", "colocate.engine_sleep=false", *gpu]).train.overlap_steps is True
    assert load_config(None, gpu).train.overlap_steps == "auto"  # auto resolves to off beside sleeping engines


def test_engine_expandable_segments_refused_with_sleeping_engines():
    gpu = ["colocate.enabled=true", "engine.num_gpus=0.5", "learner.num_gpus=1", "engine.expandable_segments=true"]
    with pytest.raises(ConfigError, match="engine.expandable_segments cannot run with colocate.engine_sleep"):
        load_config(None, gpu)
    assert load_config(None, [*gpu, "colocate.engine_sleep=false"]).engine.expandable_segments is True
