"""Losses, the transfer ratio and the paired bootstrap over users (pure numpy).

TR (Meta's LoopFM definition, DESIGN.md): the share of the FM's improvement over the VM that a variant keeps,
``TR = (L_VM - L_X) / (L_VM - L_FM)`` for a loss L (BCE here). Intervals come from a paired bootstrap over users:
one set of user resamples is drawn and every variant's loss is computed on the same resample, so that differences
and ratios are computed per resample; a TR is only quoted when the lower bound of ``L_VM - L_FM`` is above 0 (a
ratio over a gap that may be nothing is not a result).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

EPS = 1e-7


def row_bce(y: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Per-row binary cross-entropy of probabilities ``p`` for labels ``y`` in {0, 1}."""
    p = np.clip(np.asarray(p, np.float64), EPS, 1 - EPS)
    y = np.asarray(y, np.float64)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def auc(y: np.ndarray, p: np.ndarray) -> float:
    """ROC AUC (rank formula, ties averaged); NaN when one class is absent."""
    from scipy.stats import rankdata
    y = np.asarray(y)
    pos = int((y == 1).sum())
    neg = len(y) - pos
    if not pos or not neg:
        return float("nan")
    r = rankdata(p)
    return float((r[y == 1].sum() - pos * (pos + 1) / 2) / (pos * neg))


def transfer_ratio(l_vm, l_x, l_fm):
    """TR = (L_VM - L_X) / (L_VM - L_FM); arrays broadcast (per bootstrap resample). NaN where L_VM == L_FM."""
    gap = np.asarray(l_vm, np.float64) - np.asarray(l_fm, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(gap != 0, (np.asarray(l_vm, np.float64) - np.asarray(l_x, np.float64)) / gap, np.nan)


class PairedBootstrap:
    """Resamples of users (with replacement), shared by every variant.

    Args:
        users: (n,) the user of each evaluated row.
        n_boot: resamples.
        seed: the resamples are a function of the seed and the users only.
    """

    def __init__(self, users: np.ndarray, n_boot: int = 1000, seed: int = 0):
        self.uniq, self.inv = np.unique(np.asarray(users), return_inverse=True)
        U = len(self.uniq)
        rng = np.random.default_rng(seed)
        # (B, U) how often each user is drawn in each resample.
        self.counts = np.zeros((n_boot, U), np.float64)
        for b in range(n_boot):
            self.counts[b] = np.bincount(rng.integers(0, U, U), minlength=U)
        self.rows_per_user = np.bincount(self.inv, minlength=U).astype(np.float64)

    def mean(self, values: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        """(B,) the mean of per-row ``values`` (over ``mask`` rows) in each resample."""
        v = np.asarray(values, np.float64)
        w = np.ones(len(v)) if mask is None else np.asarray(mask, np.float64)
        s = np.bincount(self.inv, weights=v * w, minlength=len(self.uniq))
        n = np.bincount(self.inv, weights=w, minlength=len(self.uniq))
        with np.errstate(invalid="ignore", divide="ignore"):
            return (self.counts @ s) / (self.counts @ n)


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The percentile interval of bootstrap samples (NaNs ignored)."""
    s = np.asarray(samples, np.float64)
    s = s[np.isfinite(s)]
    if not len(s):
        return float("nan"), float("nan")
    a = (1 - level) / 2
    return float(np.quantile(s, a)), float(np.quantile(s, 1 - a))


def summarize_losses(losses: dict[str, np.ndarray], users: np.ndarray, labels: np.ndarray, probs: dict,
                     baseline: str = "vm", reference: str = "fm", mask: np.ndarray | None = None,
                     boot: PairedBootstrap | None = None, kd: str | None = None, solaris: str | None = None,
                     factor: float = 1.5, floor: str | None = None) -> dict:
    """BCE, AUC and TR with paired-bootstrap intervals for every variant over the rows in ``mask``.

    Args:
        losses: variant -> per-row BCE (all rows); ``baseline`` and ``reference`` must be among them.
        probs: variant -> per-row probability (for AUC).
        kd, solaris: with both, ``criterion`` holds the bound of TR_solaris - factor x TR_kd.
        floor: a trivial predictor among ``losses`` (the training positive rate): TRs are quoted only when the
            baseline beats it too (a ratio over a baseline that barely works is not a result).

    Returns:
        {"rows", "users", "gap": L_VM - L_FM with interval, "tr_quoted": lower bound of the gap > 0,
         "variants": {name: {"bce", "bce_ci", "auc", "tr", "tr_ci"}}, "criterion": {...} or None}.
    """
    m = np.ones(len(users), bool) if mask is None else np.asarray(mask, bool)
    out = {"rows": int(m.sum()), "users": int(len(np.unique(np.asarray(users)[m]))), "variants": {}}
    if not m.any():
        out.update(gap=None, tr_quoted=False, criterion=None)
        return out
    boot = boot or PairedBootstrap(users)
    means = {k: boot.mean(v, m) for k, v in losses.items()}
    point = {k: float(v[m].mean()) for k, v in losses.items()}
    gap_s = means[baseline] - means[reference]
    gap_ci = interval(gap_s)
    quoted = bool(gap_ci[0] > 0)
    if floor is not None:
        over = interval(means[floor] - means[baseline])
        out["baseline_beats_floor"] = {"value": point[floor] - point[baseline], "ci": over, "met": bool(over[0] > 0)}
        quoted = quoted and bool(over[0] > 0)
    out["gap"] = {"value": point[baseline] - point[reference], "ci": gap_ci,
                  "relative": (point[baseline] - point[reference]) / point[baseline]}
    out["tr_quoted"] = quoted
    trs = {}
    for k in losses:
        trs[k] = transfer_ratio(means[baseline], means[k], means[reference])
        out["variants"][k] = {"bce": point[k], "bce_ci": interval(means[k]),
                              "auc": auc(labels[m], probs[k][m]) if k in probs else None,
                              "tr": float(transfer_ratio(point[baseline], point[k], point[reference]))
                              if quoted else None,
                              "tr_ci": interval(trs[k]) if quoted else None}
    # dBCE(X) = L_VM - L_X: a difference, defined whatever the FM's gap (nothing is divided).
    for k in losses:
        out["variants"][k].update(dbce=point[baseline] - point[k], dbce_ci=interval(means[baseline] - means[k]))
    out["dbce_quantiles"] = {k: quantiles(means[baseline] - means[k]) for k in losses}
    if kd and solaris:
        stat = (means[baseline] - means[solaris]) - factor * (means[baseline] - means[kd])
        out["dbce_criterion"] = {
            "statistic": f"dBCE({solaris}) - {factor} x dBCE({kd})",
            "value": (point[baseline] - point[solaris]) - factor * (point[baseline] - point[kd]),
            "ci": interval(stat), "quantiles": quantiles(stat)}
    out["criterion"] = None
    if kd and solaris and quoted:
        diff = trs[solaris] - factor * trs[kd]
        lo, hi = interval(diff)
        # A ratio over a KD that does not transfer is no result: then the absolute TRs are (met is None).
        kd_transfers = transfers(out["variants"][kd]["tr_ci"])
        out["criterion"] = {"statistic": f"TR({solaris}) - {factor} x TR({kd})",
                            "value": out["variants"][solaris]["tr"] - factor * out["variants"][kd]["tr"],
                            "ci": (lo, hi), "kd_transfers": kd_transfers,
                            "met": bool(lo > 0) if kd_transfers else None}
    return out


def quantiles(samples: np.ndarray, n: int = 101) -> list[float]:
    """A seed's resample distribution kept compactly in its report: ``n`` evenly spaced quantiles, which
    ``across_seeds`` draws from as equally likely resamples (NaNs dropped)."""
    s = np.asarray(samples, np.float64)
    s = s[np.isfinite(s)]
    return [round(float(q), 8) for q in np.quantile(s, np.linspace(0, 1, n))] if len(s) else []


def transfers(tr_ci) -> bool:
    """Whether a TR interval is above 0: the condition for quoting any ratio over that variant (KD)."""
    return bool(tr_ci and tr_ci[0] is not None and tr_ci[0] > 0)


def pair_ceiling(log_users, log_items, log_ts, users, items, ts, first_cutoff: int, every: int) -> np.ndarray:
    """Per row (users, items, ts; microseconds), whether its pair had been shown (is in the log) before the last
    refresh at or before the row's time: refreshes at ``first_cutoff + k * every``. The share of such rows is the
    pair-coverage ceiling of the data: no refresh can have embedded a pair it never saw."""
    first = pd.DataFrame({"u": log_users, "i": log_items, "t": log_ts}).groupby(["u", "i"])["t"].min()
    seen = first.reindex(pd.MultiIndex.from_arrays([np.asarray(users), np.asarray(items)])).to_numpy()
    ts = np.asarray(ts, np.int64)
    last_refresh = first_cutoff + (ts - first_cutoff) // every * every
    return np.nan_to_num(seen, nan=np.inf) < last_refresh


SEEDS_AND_USERS = ("two-stage percentile bootstrap: each resample draws the seeds with replacement, then for each "
                   "drawn seed one of that seed's paired user resamples, and averages the statistic over the drawn "
                   "seeds")


def across_seeds(per_seed: list[np.ndarray], points: list[float], n_boot: int = 10_000, seed: int = 0,
                 level: float = 0.95) -> dict:
    """A statistic's mean over seeds with an interval that holds both the seed's variance (its data draw and its
    models) and the users' (each seed's own paired user resamples).

    Args:
        per_seed: per seed, (B_s,) the statistic in each of that seed's user resamples (``PairedBootstrap``).
        points: per seed, the statistic on all of that seed's rows.

    Returns:
        {"value": mean of ``points``, "ci": [lo, hi], "seeds": S, "method": ``SEEDS_AND_USERS``}.
    """
    if len(per_seed) != len(points) or not points:
        raise ValueError(f"across_seeds: {len(per_seed)} seeds of resamples for {len(points)} point values")
    samples = [np.asarray(s, np.float64) for s in per_seed]
    rng = np.random.default_rng(seed)
    drawn = rng.integers(0, len(samples), (n_boot, len(samples)))                 # (B, S) seeds drawn
    pick = rng.random((n_boot, len(samples)))                                     # one user resample per draw
    values = np.empty((n_boot, len(samples)))
    for s, arr in enumerate(samples):
        where = drawn == s
        values[where] = arr[np.minimum((pick[where] * len(arr)).astype(np.int64), len(arr) - 1)]
    lo, hi = interval(values.mean(axis=1), level)
    return {"value": float(np.mean(points)), "ci": [lo, hi], "seeds": len(samples), "method": SEEDS_AND_USERS}
