import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Qwen2 model made on the spot (agentrl bootstrap-tiny), shared by the session."""
    from agentrl.tiny import bootstrap_tiny

    return str(bootstrap_tiny(tmp_path_factory.mktemp("tiny") / "model"))
