"""SOLARIS: speculative precomputation of foundation-model embeddings for a fast ranker.

The library is grouped by layer; a layer imports only the layers below it and no import, inside functions too, forms a
cycle (``tests/test_layout.py`` checks):

    core        settings, the event contract, the offline layout, model inputs, shared constants
    dev         local Airflow and free ports (dev only)                                     -> core
    models/     (top-level package) the torch modules and their checkpoint format          -> core
    data        MovieLens, synthetic traffic, the request simulator                        -> core
    online      Feast views, writers, materialize, the serving client, the miss queue      -> core (+ models: ranker)
    pipeline    Spark session, event source, the refresh's transforms, KNN, model refs     -> core, models, data
    learning    training, the production-ordered replay                        -> core, models, data, online, pipeline
    evaluation  ``solaris evaluate``                                               -> the same and learning
    flows       the DAG steps, the training flow, the CLI, the demo                        -> everything

The module paths of the flat layout before it (``solaris_jobs.serving``, ``solaris_jobs.jobs``, ...) still import:
each is the same module object as its new home (``MOVED``), so ranker code written against them does not break.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__version__ = "0.1.0"

# Old flat module -> its home in the layered layout.
MOVED = {
    "settings": "core.settings", "events": "core.events", "offline": "core.offline", "features": "core.model_inputs",
    "candidates": "data.requests",
    "spark": "pipeline.spark", "event_source": "pipeline.event_source", "precompute": "pipeline.precompute",
    "jobs": "pipeline.jobs", "neighbours": "pipeline.knn", "model_refs": "pipeline.model_refs",
    "feature_views": "online.views", "store_config": "online.store_config", "feast_format": "online.feast_format",
    "online_write": "online.writer", "materialize": "online.materialize", "serving": "online.reader",
    "ranker": "online.ranker",
    "training": "learning.training", "experiment": "learning.experiment", "replay": "learning.replay",
    "orchestration": "flows.refresh_steps", "training_flow": "flows.training_steps", "cli": "flows.cli",
    "demo_refresh": "flows.demo", "airflow_local": "dev.airflow_local",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """``import solaris_jobs.<old>`` gives the module at its new path (imported once, one module object)."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.partition(".")
        if prefix == __name__ and name in MOVED:
            real = importlib.util.find_spec(self._new(fullname))
            return importlib.util.spec_from_loader(fullname, self, origin=real.origin)
        return None

    @staticmethod
    def _new(fullname: str) -> str:
        return f"{__name__}.{MOVED[fullname.partition('.')[2]]}"

    def create_module(self, spec):
        module = importlib.import_module(self._new(spec.name))
        spec.loader_state = module.__spec__         # the import system sets __spec__ to the alias's: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state  # already executed under its new name

    def get_code(self, fullname):
        """``python -m solaris_jobs.<old>`` runs the new module."""
        spec = importlib.util.find_spec(self._new(fullname))
        return spec.loader.get_code(spec.name)


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())     # before any path finder: an old path always means the new module
