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
"""
__version__ = "0.1.0"
