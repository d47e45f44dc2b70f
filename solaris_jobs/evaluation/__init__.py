"""The replay evaluation behind ``solaris evaluate``: what a ranker fed SOLARIS's features keeps of the FM's gain,
at what coverage, for how much FM compute, measured through the real pipeline (``solaris_jobs.learning.replay``).

Modules: ``metrics`` (losses, transfer ratio, the paired bootstrap; pure numpy), ``protocol`` (the time protocol
and the models trained before it), ``variants`` (the VM variants trained on what was served), ``curves`` (budget
and cadence derived from one replay), ``report`` (report.json, report.md and its plots), ``run`` (the whole
evaluation).

May import: every layer but ``flows`` and ``dev``.
"""
