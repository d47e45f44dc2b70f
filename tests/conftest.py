"""Shared fixtures: real MovieLens-100K and small synthetic data sets, built once per session."""
from __future__ import annotations

import pandas as pd
import pytest

from solaris_jobs.data import movielens, synth
from solaris_jobs.settings import PrecomputeConfig, Settings, SimulatorConfig


@pytest.fixture(scope="session")
def movielens_root(tmp_path_factory):
    """MovieLens-100K from the recbole wheel (downloaded once into ~/.cache/solaris)."""
    root = tmp_path_factory.mktemp("ml100k")
    movielens.build(root)
    return root


@pytest.fixture(scope="session")
def synth_cfg():
    # Half the default activity keeps the log small (about 40K rows); the label calibration is the default's.
    return synth.SynthConfig(users=300, items=300, days=3, seed=7, chunk_users=100, session_rate=0.6)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory, synth_cfg):
    root = tmp_path_factory.mktemp("synth")
    synth.generate(synth_cfg, root)
    return root


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for the whole suite (starting one takes 7-16 s here)."""
    from solaris_jobs.spark import spark_session
    session = spark_session("solaris-tests", "local[2]", {"spark.sql.shuffle.partitions": "4",
                                                           "spark.ui.enabled": "false",
                                                           "spark.default.parallelism": "2"})
    yield session
    session.stop()


def train_tiny_models(root, out, history_len=10, max_train_rows=20_000):
    """Small FM, AE and VM checkpoints (seconds to train) for the pipeline tests: fm.pt, ae.pt, vm.pt."""
    from solaris_jobs import training
    data = training.load_dataset(str(root), history_len=history_len, max_train_rows=max_train_rows)
    cfg = training.TrainConfig(epochs=1, history_len=history_len, max_train_rows=max_train_rows)
    training.train_fm(data, out / "fm.pt", cfg, d_model=16, n_layers=1, d_interaction=32)
    training.train_ae(data, out / "fm.pt", out / "ae.pt", cfg, d_code=8)
    training.train_vm(data, out / "vm.pt", cfg)
    return out


@pytest.fixture(scope="session")
def ml_models(movielens_root, tmp_path_factory):
    return train_tiny_models(movielens_root, tmp_path_factory.mktemp("ml_tiny_models"))


@pytest.fixture(scope="session")
def synth_models(synth_root, tmp_path_factory):
    return train_tiny_models(synth_root, tmp_path_factory.mktemp("synth_tiny_models"), max_train_rows=None)


ML_END = pd.Timestamp("1998-03-01T00:00:00Z")
ML_START = ML_END - pd.Timedelta(hours=1)
ML_CFG = PrecomputeConfig(lookback_days=None, active_hours=24 * 14, history_len=10, batch_size=256,
                          simulator=SimulatorConfig(n_candidates=60, n_popular=30))


@pytest.fixture(scope="session")
def ml_run(spark, movielens_root, ml_models, tmp_path_factory):
    """One refresh (selection, FM inference, aggregates, neighbours) of a MovieLens hour, in-process: the settings
    and the stats."""
    from solaris_jobs import jobs
    s = Settings(data=str(movielens_root), offline=str(tmp_path_factory.mktemp("ml_offline")), models=str(ml_models),
                 precompute=ML_CFG)
    return s, jobs.run(spark, s, ML_START, ML_END)
