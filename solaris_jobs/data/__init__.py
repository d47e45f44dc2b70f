"""Data sources that produce the event-log contract (``solaris_jobs.core.events``): MovieLens-100K (``movielens``),
ad-like synthetic traffic (``synth``), and the request simulator that guesses which candidates a user will be
ranked on next (``requests``).

May import: ``core``.
"""
