"""The flows that tie the layers to their callers: the refresh DAG's steps and backfills (``refresh_steps``), the
training DAG's steps (``training_steps``), the ``solaris`` CLI (``cli``) and the demo's refresh (``demo``). DAG
files and Spark entry points are thin wrappers over these.

May import: every layer.
"""
