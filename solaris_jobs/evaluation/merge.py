"""``solaris evaluate-merge``: one report from the reports of runs of the same evaluation that ran different seeds
(or sweep points) apart, e.g. ``solaris evaluate --seeds 1`` on a second machine.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from solaris_jobs.evaluation import report as rep
from solaris_jobs.evaluation.config import EvalConfig, movielens_config
from solaris_jobs.evaluation.targets import check_targets, seed_summary, sweep_point

# What may differ between reports of one evaluation run apart (one seed per machine or per session): which seeds
# and sweep points each ran, and the settings that only the first seed's curves use.
MERGE_INDEPENDENT = ("seeds", "sequence_shares", "curves", "budgets", "slow_cadence", "fast_cadence",
                     "fast_hours_before", "fast_hours_after", "sweep_variants", "sweep_seed")


class ReportMismatch(ValueError):
    """Reports that are not parts of one evaluation (other data, protocol or settings), or that repeat a seed."""


def merge_reports(paths, out: Path, expected_seeds: tuple | None = None) -> dict:
    """One report from the reports of runs of the same evaluation that ran different seeds (or sweep points) apart,
    e.g. ``solaris evaluate --seeds 1`` on a second machine: the per-seed results are kept as each run wrote them,
    and the summary and targets are recomputed over all of them. The data manifest, the protocol and every setting
    a seed's numbers depend on must be equal (``MERGE_INDEPENDENT`` may differ); a seed or sweep point given twice
    is an error. ``complete`` is true when the seeds are ``expected_seeds`` (default the dataset's default seeds)
    and every part had finished its seeds."""
    parts = _read_parts(paths)
    r0 = parts[0][1]
    seeds, sweep, where = _collect(parts)
    sweep_seeds = sorted({x["seed"] for x in sweep})
    notes = _complete_sweep(r0, seeds, sweep, sweep_seeds)
    default = movielens_config() if r0["dataset"] == "movielens" else EvalConfig()
    expected = tuple(expected_seeds) if expected_seeds is not None else default.seeds
    missing = sorted(set(default.sequence_shares) - {x["sequence_share"] for x in sweep})
    if sweep and missing:
        notes.append(f"the sweep lacks the sequence shares {', '.join(f'{m:g}' for m in missing)} of "
                     f"{', '.join(f'{m:g}' for m in default.sequence_shares)}")
    summaries = [seed_summary(r) for r in seeds]
    # A part that stopped early wrote only its finished seeds, so "complete" asks for the expected seeds only.
    report = {**{k: r0[k] for k in ("dataset", "protocol", "data")}, "config": _config(parts, seeds, sweep,
                                                                                        sweep_seeds),
              # ... and every part that ran sweep points finished them.
              "complete": sorted(where) == sorted(expected) and not notes
                          and all(r["complete"] for _, r in parts if r.get("sweep")),
              "seeds": [s["seed"] for s in seeds], "notes": notes,
              "summary": summaries, "targets": check_targets(summaries), "per_seed": seeds, "sweep": sweep,
              "merged_from": [_merged_from(p, r) for p, r in parts],
              "timings": {"total_s": round(sum((r.get("timings") or {}).get("total_s", 0) for _, r in parts), 1)}}
    rep.save(report, out)
    return report


def _read_parts(paths) -> list[tuple[Path, dict]]:
    parts = []
    for p in paths:
        p = Path(p)
        try:
            parts.append((p, json.loads(p.read_text())))
        except (OSError, ValueError) as e:
            raise ReportMismatch(f"{p}: not a readable report.json ({e})") from e
    if not parts:
        raise ReportMismatch("no report to merge")
    return parts


def _comparable(r: dict) -> dict:
    """What must be equal in every part: the data set, its manifest, the protocol and the settings a seed's numbers
    depend on."""
    cfg = {k: v for k, v in r["config"].items() if k not in MERGE_INDEPENDENT}
    data = r["data"]
    if cfg.get("data_per_seed"):        # each seed drew its own log: the generator and its settings must agree
        data = {"generator_version": data.get("generator_version"),
                "config": {k: v for k, v in data.get("config", {}).items() if k != "seed"}}
    return {"dataset": r["dataset"], "config": cfg, "protocol": r["protocol"], "data": data}


def _collect(parts: list[tuple[Path, dict]]) -> tuple[list, list, dict]:
    """(seed results by seed, sweep points, the part of each seed), once each part is checked against the first.

    Raises:
        ReportMismatch: a part of another evaluation; a seed or a sweep point given twice; sweep points of
            more than one seed.
    """
    p0, r0 = parts[0]
    want = _comparable(r0)
    seeds, sweep, where = [], [], {}
    for p, r in parts:
        got = _comparable(r)
        for section in want:
            if got[section] != want[section]:
                a, b = want[section], got[section]
                keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)) if isinstance(a, dict) else []
                raise ReportMismatch(f"{p}: {section} differs from {p0}'s ({', '.join(keys) or section}): not parts "
                                     "of one evaluation")
        for s in r["per_seed"]:
            if s["seed"] in where:
                raise ReportMismatch(f"seed {s['seed']} is in both {where[s['seed']]} and {p}")
            where[s["seed"]] = p
            seeds.append(s)
        for point in r.get("sweep", []):
            if any(x["sequence_share"] == point["sequence_share"] for x in sweep):
                raise ReportMismatch(f"{p}: sweep point {point['sequence_share']} is given twice")
            sweep.append(point)
    seeds.sort(key=lambda s: s["seed"])
    # Every sweep point runs at one seed (``sweep_seed``): points of other seeds are not one sweep.
    sweep_seeds = sorted({x["seed"] for x in sweep})
    if len(sweep_seeds) > 1:
        raise ReportMismatch(f"sweep points ran at seeds {sweep_seeds}: one sweep runs at one seed")
    return seeds, sweep, where


def _complete_sweep(r0: dict, seeds: list, sweep: list, sweep_seeds: list) -> list[str]:
    """Adds the headline's share to a sweep run apart from the headline (``--seeds none`` leaves it out: its point
    is the headline run of the sweep's seed) and sorts the sweep; the notes on what is missing."""
    notes = []
    share0 = r0["config"]["synth"]["sequence_share"]
    if sweep and not any(x["sequence_share"] == share0 for x in sweep):
        head = [s for s in seeds if s["seed"] == sweep_seeds[0]]
        if head:
            sweep.append(sweep_point(share0, head[0], (head[0].get("data") or r0["data"])["positive_rate"]))
        else:
            notes.append(f"the sweep's headline share {share0:g} is missing: no part holds the headline run of "
                         f"seed {sweep_seeds[0]}")
    sweep.sort(key=lambda x: x["sequence_share"])
    return notes


def _config(parts: list[tuple[Path, dict]], seeds: list, sweep: list, sweep_seeds: list) -> dict:
    """The merged settings: those that may differ between parts come from the part with the lowest seed (it ran
    the curves), not from whichever part was named first; the seeds and shares are the merged ones."""
    base = min(((r["per_seed"][0]["seed"] if r["per_seed"] else math.inf, k) for k, (_, r) in enumerate(parts)))
    config = {**parts[base[1]][1]["config"], "seeds": [s["seed"] for s in seeds],
              "sequence_shares": [x["sequence_share"] for x in sweep],
              "curves": any(s.get("curves") for s in seeds)}
    if sweep_seeds:
        config["sweep_seed"] = sweep_seeds[0]
    return config


def _merged_from(p: Path, r: dict) -> dict:
    return {"path": str(p), "seeds": [s["seed"] for s in r["per_seed"]],
            "sweep": [x["sequence_share"] for x in r.get("sweep", [])],
            "complete": r["complete"], "config": {k: r["config"].get(k) for k in MERGE_INDEPENDENT},
            "timings": r.get("timings")}
