"""The fallback tiers the product serves, chosen once on seed 0's validation rows (#40) and then fixed
(``solaris_jobs.online.reader.DEFAULT_TIERS``, which ``EvalConfig.tiers`` and every ``FeatureReader`` take).

Declared before it ran: seed 0 of the headline configuration, every fallback tier served, the same replay the
headline's first seed runs (so the headline reuses it when every tier is kept); the all-tiers VM (``solaris``) and
the equal-input VM whose served codes are zeroed (``tiers_only``: tier flags, ages and counts kept) trained on their
grids as in the headline. A tier is kept where its value on its own validation rows (``scoring.tier_values``:
``BCE(tiers_only) - BCE(solaris)`` on the rows it served, paired bootstrap over users) has a 95% lower bound above
0. No test row is scored (``run.choose_tiers`` runs it). The table goes into
``benchmarks/results/tier_choice_synth.json``.
"""
from __future__ import annotations

import json
from pathlib import Path

from solaris_jobs.online.reader import FALLBACKS

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "tier_choice_synth.json"
VARIANTS = ("tiers_only", "solaris")
METHOD = " ".join(__doc__.split("\n\n")[1].split())


def choose(values: dict) -> tuple:
    """The fallback tiers whose value on their own validation rows has a lower bound above 0, in fallback order."""
    return tuple(t for t in FALLBACKS if (values.get(t) or {}).get("carries_value"))


def committed() -> dict | None:
    """The committed choice (``RESULT``), or None before it has run."""
    return json.loads(RESULT.read_text()) if RESULT.exists() else None
