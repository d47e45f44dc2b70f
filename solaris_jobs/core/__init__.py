"""The lowest layer: what every other layer agrees on. The run-time settings (``settings``), the event-log contract
and its pyarrow reader (``events``), the offline store's layout (``offline``: interval keys, atomic publish,
readers), the URIs of both as pyarrow file systems (``uris``), the point-in-time model inputs (``model_inputs``)
and the constants and version string shared by the models, the store and the serving client (``contract``).

May import: nothing else of SOLARIS (no Spark, torch or Feast at import time).
"""
