"""Shared fixtures: one private Ray instance and one tiny model folder per test session.

Both are lazy: a test module that asks for neither never starts Ray or builds a model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# A model small enough that a forward pass is a millisecond on CPU.
TINY_SHAPE = dict(arch="llama", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                  max_position_embeddings=64)


@pytest.fixture(scope="session")
def ray_local():
    """A private two-CPU Ray instance (never a running `ray start` cluster), shut down at the end."""
    import ray

    if ray.is_initialized():  # another module's code (start_ray) got there first: share it
        yield ray
        return
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A Hugging Face folder (weights + char tokenizer) of a one-layer Llama."""
    from rlcore.engine.tiny_model import materialize_tiny

    return materialize_tiny(tmp_path_factory.mktemp("tiny"), seed=0, **TINY_SHAPE)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from rlcore.engine.model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def mlflow_store_dir(tmp_path_factory) -> Path:
    """A folder whose ``runs.db`` is one sqlite MLflow store shared by the tracking tests (creating its schema is
    the slow part: 3-5 s)."""
    return tmp_path_factory.mktemp("tracking")
