"""Shared fixtures: real MovieLens-100K and small synthetic data sets, built once per session."""
from __future__ import annotations

from pathlib import Path

import pytest
from filelock import FileLock

from solaris_jobs.core.settings import Settings
from solaris_jobs.data import movielens, synth
from tests.support import ML_CFG, ML_END, ML_START, train_tiny_models


def built_once(tmp_path_factory, worker_id: str, name: str, build) -> Path:
    """A folder of read-only inputs (data, checkpoints) built once for the whole run: under pytest-xdist the first
    worker to ask builds it in the run's shared temporary folder while the others wait on a file lock, then all
    read the same files (the suite runs on 2 workers: `make test`)."""
    if worker_id == "master":
        path = tmp_path_factory.mktemp(name)
        build(path)
        return path
    path = tmp_path_factory.getbasetemp().parent / name
    with FileLock(f"{path}.lock"):
        if not (path / ".built").exists():
            path.mkdir(exist_ok=True)
            build(path)
            (path / ".built").touch()
    return path


@pytest.fixture(scope="session")
def movielens_root(tmp_path_factory, worker_id):
    """MovieLens-100K from the recbole wheel (downloaded once into ~/.cache/solaris)."""
    return built_once(tmp_path_factory, worker_id, "ml100k", movielens.build)


@pytest.fixture(scope="session")
def synth_cfg():
    # Half the default activity keeps the log small (about 40K rows); the label calibration is the default's.
    return synth.SynthConfig(users=300, items=300, days=3, seed=7, chunk_users=100, session_rate=0.6)


@pytest.fixture(scope="session")
def synth_root(tmp_path_factory, worker_id, synth_cfg):
    return built_once(tmp_path_factory, worker_id, "synth", lambda root: synth.generate(synth_cfg, root))


@pytest.fixture(scope="session")
def spark():
    """One local Spark session for the whole suite (starting one takes 7-16 s here)."""
    from solaris_jobs.pipeline.spark import spark_session
    session = spark_session("solaris-tests", "local[2]", {"spark.sql.shuffle.partitions": "4",
                                                           "spark.ui.enabled": "false",
                                                           "spark.default.parallelism": "2"})
    yield session
    session.stop()


@pytest.fixture(scope="session")
def ml_models(movielens_root, tmp_path_factory, worker_id):
    return built_once(tmp_path_factory, worker_id, "ml_tiny_models", lambda out: train_tiny_models(movielens_root, out))


@pytest.fixture(scope="session")
def synth_models(synth_root, tmp_path_factory, worker_id):
    return built_once(tmp_path_factory, worker_id, "synth_tiny_models",
                      lambda out: train_tiny_models(synth_root, out, max_train_rows=None))


@pytest.fixture(scope="session")
def ml_run(spark, movielens_root, ml_models, tmp_path_factory):
    """One refresh (selection, FM inference, aggregates, neighbours) of a MovieLens hour, in-process: the settings
    and the stats."""
    from solaris_jobs.pipeline import jobs
    s = Settings(data=str(movielens_root), offline=str(tmp_path_factory.mktemp("ml_offline")), models=str(ml_models),
                 precompute=ML_CFG)
    return s, jobs.run(spark, s, ML_START, ML_END)
