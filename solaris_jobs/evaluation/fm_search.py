"""The FM's recipe, searched once on seed 0's validation slice (#40) and then fixed (``ModelsConfig``'s defaults).

Declared before it ran (``PLAN``), so that the FM gets at least the tuning each ranker gets (a 6-point grid):

- Rows: about 300K training rows sampled from ``[t0, fm_valid_from)`` of seed 0's log; every point validates on
  the same sample of ``[fm_valid_from, t1)`` (the slice the final fit early-stops on), labels 30 min late as in the
  refresh. Each point trains at most 3 epochs, early-stopped on that slice (patience 1).
- A coordinate search from the recipe the evaluation used before (learning rate 2e-3, no weight decay, dropout 0.1,
  ``history_len`` 50, no target x user product): each stage tries its values with every other setting at the best
  so far and keeps the best validation BCE; the stages in order: the trunk's target x user product, the learning
  rate (1e-3, 4e-3), weight decay (1e-2), dropout (0).
- ``history_len``: 50 against 100 at the best recipe, each at model seeds 0 and 1, chosen by the mean validation BCE;
  200 is tried (at both seeds) only if 100 beats 50 by more than the seed spread (the larger of the two recipes'
  differences between their seeds).

Every point is cached under ``<out>/fm_search/`` as it ends, so an interrupted search resumes; points committed
under ``benchmarks/results/fm_search_points/`` (copied there as they end: the search takes hours) count as cached,
so a fresh clone resumes too. The table goes into ``benchmarks/results/fm_search_synth.json`` and into each report's
``config.fm_search``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

from solaris_jobs.evaluation.protocol import ModelsConfig, Protocol, data_version, source_hash

logger = logging.getLogger(__name__)

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "fm_search_synth.json"
POINTS = RESULT.parent / "fm_search_points"        # points committed as they end (the same names as the cache's)
FM_CODE = ("models.fm", "models.common", "solaris_jobs.learning.training", "solaris_jobs.core.model_inputs")
FAMILY_CODE = {"transformer": (), "gru4rec": ("models.gru4rec", "models.checkpoint")}   # beyond FM_CODE
RECIPE_KEYS = ("fm_lr", "fm_weight_decay", "fm_dropout", "fm_target_user", "history_len")


@dataclass(frozen=True)
class SearchPlan:
    rows: int = 300_000
    epochs: int = 3
    patience: int = 1
    start: tuple = (("fm_lr", 2e-3), ("fm_weight_decay", 0.0), ("fm_dropout", 0.1), ("fm_target_user", False),
                    ("history_len", 50))
    stages: tuple = (("fm_target_user", (True,)), ("fm_lr", (1e-3, 4e-3)), ("fm_weight_decay", (1e-2,)),
                     ("fm_dropout", (0.0,)))
    history_lens: tuple = (50, 100)
    longer: int = 200                  # tried only if the longest of history_lens wins by more than the spread
    seeds: tuple = (0, 1)
    family: str = "transformer"        # the FM family searched (models.checkpoint.FM_FAMILIES)

    def key(self) -> dict:
        """The plan as it keys a point: the transformer's without ``family`` (its points were cached and committed
        before there were families, under these names)."""
        out = {k: v for k, v in self.__dict__.items() if k != "family"} | {"start": list(self.start)}
        return out if self.family == "transformer" else out | {"family": self.family}


PLAN = SearchPlan()
# Every family gets the same search (the same start, stages, lengths and seeds) at the same widths, so that each FM
# is tuned as much as the other and as much as each ranker.
PLANS = {"transformer": PLAN, "gru4rec": replace(PLAN, family="gru4rec")}


def result_path(family: str = "transformer") -> Path:
    """Where a family's search table is committed (the transformer's is ``RESULT``)."""
    return RESULT if family == "transformer" else RESULT.with_name(f"{RESULT.stem}_{family}.json")


def recipe_of(models: ModelsConfig) -> dict:
    return {k: getattr(models, k) for k in RECIPE_KEYS}


def point_name(plan: SearchPlan, recipe: dict, seed: int, protocol: dict, data: str, code: str,
               label_delay_minutes: float, base: ModelsConfig) -> str:
    """A point's cache name: a digest of everything its result depends on."""
    key = {"recipe": recipe, "seed": seed, "plan": plan.key(), "protocol": protocol, "data": data, "code": code,
           "label_delay_minutes": label_delay_minutes,
           "widths": {k: getattr(base, k) for k in ("d_model", "n_layers", "d_interaction", "batch_size")}}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


def search(root: Path, protocol: Protocol, out: Path, base: ModelsConfig, label_delay_minutes: float,
           plan: SearchPlan = PLAN) -> dict:
    """Runs ``plan`` on the log at ``root`` (cached per point under ``out``) and returns the table: every point's
    recipe, seed, per-epoch validation BCE and best epoch, the stage that tried it, and the chosen recipe."""
    from solaris_jobs.learning import training
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    code = source_hash(FM_CODE + FAMILY_CODE[plan.family])
    loaded: dict[int, object] = {}
    points: list[dict] = []

    def data_at(history_len: int):
        if history_len not in loaded:
            loaded.clear()          # one history length in memory at a time
            d = training.load_dataset(str(root), history_len, max_train_rows=plan.rows, seed=0,
                                      cuts=(protocol.fm_valid_from, protocol.t1),
                                      label_delay_minutes=label_delay_minutes)
            loaded[history_len] = d
        return loaded[history_len]

    def run(recipe: dict, seed: int, stage: str) -> float:
        name = point_name(plan, recipe, seed, protocol.to_dict(), data_version(root), code, label_delay_minutes, base)
        path, kept = out / f"point-{name}.json", POINTS / f"point-{name}.json"
        if path.exists() or kept.exists():
            rec = json.loads((path if path.exists() else kept).read_text())
        else:
            m = replace(base, **recipe, fm_epochs=plan.epochs, fm_patience=plan.patience, fm_family=plan.family)
            data = data_at(m.history_len)
            t0 = time.perf_counter()
            model = training.build_fm(data, m.fm_train(seed), **m.fm_args())
            fit = training.fit(model, data, m.fm_train(seed), f"fm search {stage}")
            rec = {"recipe": recipe, "seed": seed, "stage": stage,
                   "valid_bce": min(r["valid_bce"] for r in fit["history"]), "best_epoch": fit["best_epoch"],
                   "epochs": [{k: r[k] for k in ("epoch", "train_bce", "valid_bce", "valid_auc", "seconds")}
                              for r in fit["history"]],
                   "train_rows": len(data.train), "valid_rows": int((data.valid.label >= 0).sum()),
                   "seconds": round(time.perf_counter() - t0, 1)}
            path.write_text(json.dumps(rec, indent=1) + "\n")
        logger.info("fm search %s (seed %d): %s -> valid BCE %.5f (epoch %d)", stage, seed, json.dumps(recipe),
                    rec["valid_bce"], rec["best_epoch"])
        points.append({**rec, "stage": stage})
        return rec["valid_bce"]

    best = dict(plan.start)
    best_bce = run(best, plan.seeds[0], "start")
    for name, values in plan.stages:
        for v in values:
            r = {**best, name: v}
            b = run(r, plan.seeds[0], name)
            if b < best_bce:
                best, best_bce = r, b
    # history_len: each length at every seed, chosen by the mean; the longer one only past the seed spread.
    mean_of, spread = {}, 0.0
    for length in plan.history_lens:
        got = [best_bce if (length == best["history_len"] and s == plan.seeds[0])
               else run({**best, "history_len": length}, s, "history_len") for s in plan.seeds]
        mean_of[length] = sum(got) / len(got)
        spread = max(spread, max(got) - min(got))
    lengths = list(plan.history_lens)
    if mean_of[lengths[0]] - mean_of[lengths[-1]] > spread:
        got = [run({**best, "history_len": plan.longer}, s, "history_len") for s in plan.seeds]
        mean_of[plan.longer] = sum(got) / len(got)
    chosen = {**best, "history_len": min(mean_of, key=mean_of.get)}
    return {"family": plan.family,
            "plan": {**plan.__dict__, "start": dict(plan.start), "stages": [list(s) for s in plan.stages]},
            "protocol": protocol.to_dict(), "data": data_version(root), "code": code,
            "label_delay_minutes": label_delay_minutes, "points": points,
            "history_len_mean_valid_bce": {str(k): v for k, v in mean_of.items()}, "seed_spread": spread,
            "chosen": chosen}


def committed(family: str = "transformer") -> dict | None:
    """A family's committed search (``result_path``), or None before it has run."""
    path = result_path(family)
    return json.loads(path.read_text()) if path.exists() else None


def models_for(base: ModelsConfig, family: str) -> ModelsConfig:
    """``base`` with FM ``family`` and that family's recipe (``settings.FM_RECIPES``: what its search chose, held
    equal to the committed table by tests/test_settings.py; a family not searched yet has its plan's start, and the
    report's ``config.fm_search`` is then None), except where ``base`` sets a recipe field apart from the default
    family's (``--quick``'s shorter history stays)."""
    from solaris_jobs.core.settings import FM_RECIPES
    if family not in FM_RECIPES:
        raise ValueError(f"no FM recipe for family {family!r}: {sorted(FM_RECIPES)}")
    default = FM_RECIPES["transformer"]
    return replace(base, fm_family=family, **{k: v if getattr(base, k) == default[k] else getattr(base, k)
                                              for k, v in FM_RECIPES[family].items()})
