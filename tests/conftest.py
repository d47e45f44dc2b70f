"""Shared fixtures: real MovieLens-100K and small synthetic data sets, built once per session."""
from __future__ import annotations

import pytest

from solaris_jobs.data import movielens, synth


@pytest.fixture(scope="session")
def movielens_root(tmp_path_factory):
    """MovieLens-100K from the recbole wheel (downloaded once into ~/.cache/solaris)."""
    root = tmp_path_factory.mktemp("ml100k")
    movielens.build(root)
    return root


@pytest.fixture(scope="session")
def synth_cfg():
    return synth.SynthConfig(users=400, items=300, days=3, seed=7, chunk_users=150)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory, synth_cfg):
    root = tmp_path_factory.mktemp("synth")
    synth.generate(synth_cfg, root)
    return root
