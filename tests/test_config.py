from pathlib import Path

import pytest

from agentrl.config import Config, ConfigError, load_config

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
