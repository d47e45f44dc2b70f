"""The offline refresh pipeline: the Spark session (``spark``), the event source read once per run
(``event_source``), the refresh's transforms (the log's windows ``windows``, the request simulator
``simulator``, histories and counters ``history``, the verifier ``verifier``, pool and selection ``selection``, FM
inference ``inference``, the fallback tiers' embeddings ``aggregates``), the select step's interval state
(``interval_state``), the FAISS neighbour search (``knn``), the versioned models a run resolves (``model_refs``),
retention (``retention``) and the Spark steps as library functions the DAG, the CLI and the replay call (``jobs``,
with ``select_step`` and ``neighbours_step``; what they share in ``step_common``).

May import: ``core``, ``models``, ``data``.
"""
