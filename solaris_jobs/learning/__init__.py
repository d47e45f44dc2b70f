"""Training and the production-ordered replay: the FM, autoencoder and VM training loops (``training``), the
MovieLens model comparison behind the demo (``experiment``) and the replay that walks the refresh and the serving
client over a logged period (``replay``), so that models train on what is served.

May import: ``core``, ``models``, ``data``, ``online``, ``pipeline``.
"""
