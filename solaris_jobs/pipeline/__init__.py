"""The offline refresh pipeline: the Spark session (``spark``), the event source read once per run
(``event_source``), the refresh's transforms (``precompute``: candidate selection, FM inference, aggregates), the
FAISS neighbour search (``knn``), the versioned models a run resolves (``model_refs``) and the Spark steps as
library functions the DAG, the CLI and the replay call (``jobs``).

May import: ``core``, ``models``, ``data``.
"""
