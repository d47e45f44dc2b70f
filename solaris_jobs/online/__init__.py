"""The online store and its serving client: the Feast feature views (``views``) and store settings
(``store_config``), Feast's byte layout (``feast_format``) and Redis's wire protocol (``resp``), the bulk writers
(``writer``) and ``materialize``, the tiered reader a ranker calls (``reader.FeatureReader``), the miss queue and
its drain (``misses``), coverage as the reader resolves it (``coverage``) and a ranker integration (``ranker``).

May import: ``core``; ``models`` only in ``ranker`` (the serving hot path, ``reader``, loads no torch).
"""
