"""The replay evaluation behind ``solaris evaluate``: what a ranker fed SOLARIS's features keeps of the FM's gain,
at what coverage, for how much FM compute, measured through the real pipeline (``solaris_jobs.learning.replay``).

Modules: ``metrics`` (losses, transfer ratio, the paired bootstrap; pure numpy), ``protocol`` (the time protocol
and the models trained before it), ``config`` (``EvalConfig``, its presets, the refresh settings a replay runs
with), ``windows`` (the protocol's windows over what was served: coverage, the ceiling, FM compute per row),
``replays`` (a seed's cached replays and ``SeedContext``), ``variants`` (the VM variants trained on what was
served), ``scoring`` (the variants' losses and TRs on the test rows), ``curves`` (budget and cadence derived from
one replay), ``seed_curves`` (a seed's budget and cadence curves), ``seed`` (one seed's run), ``targets`` (the
targets and the per-seed summaries), ``report`` (report.json, report.md and its plots), ``run`` (the whole
evaluation), ``merge`` (one report from runs of other seeds).

May import: every layer but ``flows`` and ``dev``.
"""
