"""The evaluation's report: ``report.json``, and beside it the readable ``report.md`` with PNG plots (matplotlib,
Agg) and ``report.html``, the same report as one self-contained page (the table and the plots inline, nothing to
fetch); and the few lines a terminal shows of it (``headline_table``)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from solaris_jobs.core.contract import TIERS
from solaris_jobs.evaluation.metrics import transfers
from solaris_jobs.evaluation.targets import MIN_SEEDS

logger = logging.getLogger(__name__)

LABELS = {"vm": "VM", "vm_kd": "VM + KD", "tiers_only": "VM + tier/age only (embeddings zeroed)",
          "pair": "VM + SOLARIS, pair tier", "pair_agg": "VM + SOLARIS, pair + aggregate",
          "solaris": "VM + SOLARIS, all tiers", "solaris_kd": "VM + SOLARIS all tiers + KD",
          "oracle": "VM + FM code for every row (100% coverage oracle)", "fm": "FM",
          "base_rate": "base rate (training positive rate)"}
SHORT = {"vm_kd": "KD", "tiers_only": "tiers/age only", "pair": "pair tier", "pair_agg": "pair + aggregate",
         "solaris": "all tiers", "solaris_kd": "all tiers + KD", "oracle": "oracle (FM online)"}
ORDER = ("base_rate", "vm", "vm_kd", "tiers_only", "pair", "pair_agg", "solaris", "solaris_kd", "oracle", "fm")


def _f(x, nd=4) -> str:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return "-"
    return f"{x:.{nd}f}"


def _ci(ci, nd=3) -> str:
    if not ci or ci[0] is None:
        return ""
    return f" [{_f(ci[0], nd)}, {_f(ci[1], nd)}]"


def _plots(report: dict, out: Path) -> dict:
    """The report's figures, written under ``out``: {name: file name}, in the order the report shows them."""
    import matplotlib
    matplotlib.use("Agg")
    if not report["per_seed"]:          # a sweep run alone (``--seeds none``): its table is the report
        return {}
    first = report["per_seed"][0]
    curves = first.get("curves")
    files = {"tiers_over_time": _plot_tiers_over_time(report, first, out)}
    if curves and curves.get("budget"):
        files["coverage_vs_budget"] = _plot_coverage_vs_budget(curves["budget"], out)
        files["tr_vs_coverage"] = _plot_tr_vs_coverage(curves["budget"], out)
    files["coverage_vs_cadence"] = _plot_coverage_vs_cadence(curves, out)
    files["tr_per_variant"] = _plot_tr_per_variant(report, out)
    return {k: f for k, f in files.items() if f is not None}


def _plot_tiers_over_time(report: dict, first: dict, out: Path) -> str | None:
    """Tier shares over time (served training day and test day) of the first seed; None without intervals."""
    import matplotlib.pyplot as plt
    cov = first["headline"]["coverage"]
    per = cov["served_training"].get("per_interval", []) + cov["test"].get("per_interval", [])
    if not per:
        return None
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = np.arange(len(per))
    bottom = np.zeros(len(per))
    for t in TIERS:
        if t not in per[0]:
            continue            # a report written before the tier existed (user_state: #40)
        v = np.array([p[t] for p in per])
        ax.bar(x, v, bottom=bottom, width=1.0, label=t)
        bottom += v
    n_train = len(cov["served_training"].get("per_interval", []))
    ax.axvline(n_train - 0.5, color="k", lw=1)
    ax.text(n_train, 1.02, "test", fontsize=8)
    ax.set_ylim(0, 1.08)
    return _finish(fig, ax, out / "tiers_over_time.png",
                   "Tier served per row, through FeatureReader (seed %d)" % first["seed"],
                   f"refresh interval from t1 ({report['config']['cadence']} each)",
                   "share of served rows", fontsize=7, ncol=4, loc="lower right")


def _plot_coverage_vs_budget(pts: list[dict], out: Path) -> str:
    """Pair and any-tier coverage, and the pair ceiling, against FM inferences per served row (the budget curve)."""
    import matplotlib.pyplot as plt
    fmr = [p["fm"]["per_row"] for p in pts]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(fmr, [p["coverage"]["shares"]["pair"] for p in pts], "o-", label="pair tier")
    ax.plot(fmr, [p["coverage"]["any_tier"] for p in pts], "s-", label="any tier")
    ax.plot(fmr, [p["coverage"]["ceiling"] for p in pts], "k--", lw=1, label="pair ceiling")
    if all(x and x > 0 for x in fmr):
        ax.set_xscale("log", base=2)
    return _finish(fig, ax, out / "coverage_vs_budget.png", "Coverage vs FM compute",
                   "FM inferences per served row", "share of test rows")


def _plot_tr_vs_coverage(pts: list[dict], out: Path) -> str:
    """The all-tiers VM's TR with its interval against coverage, one point per budget of the curve."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.2))
    tr = [p["solaris"]["tr"] for p in pts]
    ok = [t is not None for t in tr]
    if any(ok):
        xs = [p["coverage"]["any_tier"] for p, o in zip(pts, ok) if o]
        ys = [t for t in tr if t is not None]
        lo = [p["solaris"]["tr_ci"][0] for p, o in zip(pts, ok) if o]
        hi = [p["solaris"]["tr_ci"][1] for p, o in zip(pts, ok) if o]
        ax.errorbar(xs, ys, yerr=[np.array(ys) - lo, np.array(hi) - ys], fmt="o-", capsize=3, label="all tiers")
        xp = [p["coverage"]["shares"]["pair"] for p, o in zip(pts, ok) if o]
        ax.plot(xp, ys, "x:", label="(same points vs pair coverage)")
        for p, x, y in zip([p for p, o in zip(pts, ok) if o], xs, ys):
            ax.annotate(f"{p['budget_per_row']:g}/row", (x, y), fontsize=7)
    empty = None if any(ok) else ("no TR is quoted at any budget of the curve: the FM's gain over the VM is not "
                                  "above 0 at the 95% lower bound there")
    return _finish(fig, ax, out / "tr_vs_coverage.png", "Transfer ratio vs coverage (budget curve)",
                   "coverage of test rows", "TR (BCE)", empty=empty)


def _plot_coverage_vs_cadence(curves: dict | None, out: Path) -> str | None:
    """Pair and any-tier coverage per cadence (the fast cadence's replay where there is one, else the cadence
    curve); None without either."""
    import matplotlib.pyplot as plt
    fc = None
    if curves and curves.get("fast_cadence"):
        fc = curves["fast_cadence"]["coverage"]
    elif curves and curves.get("cadence"):
        fc = {p["cadence"]: p["coverage"] for p in curves["cadence"]}
    if not fc:
        return None
    names = list(fc)
    fig, ax = plt.subplots(figsize=(5, 3.2))
    x = np.arange(len(names))
    ax.bar(x - 0.2, [fc[n]["shares"]["pair"] for n in names], 0.4, label="pair tier")
    ax.bar(x + 0.2, [fc[n]["any_tier"] for n in names], 0.4, label="any tier")
    ax.set_xticks(x, names)
    return _finish(fig, ax, out / "coverage_vs_cadence.png", "Coverage vs cadence (same budget per served row)",
                   "refresh cadence (same budget per served row)", "share of rows")


def _plot_tr_per_variant(report: dict, out: Path) -> str:
    """TR per variant with intervals, every seed."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = [v for v in ORDER if v not in ("vm", "fm", "base_rate")]
    drawn = False
    for j, r in enumerate(report["per_seed"]):
        vs = r["headline"]["test"]["variants"]
        ys = [vs[n]["tr"] if vs.get(n) else None for n in names]
        drawn = drawn or any(y is not None for y in ys)
        x = np.arange(len(names)) + (j - (len(report["per_seed"]) - 1) / 2) * 0.18
        for xi, n, y in zip(x, names, ys):
            if y is None:
                continue
            lo, hi = vs[n]["tr_ci"]
            ax.errorbar([xi], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=f"C{j}", capsize=2,
                        label=f"seed {r['seed']}" if n == names[0] else None)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(names)), [SHORT[n] for n in names], rotation=25, ha="right", fontsize=7)
    return _finish(fig, ax, out / "tr_per_variant.png", "Transfer ratio per variant (test)", None,
                   "TR (BCE), 95% interval", empty=None if drawn else _no_tr_why(report), fontsize=7)


def _no_tr_why(report: dict) -> str:
    """Why no seed quotes a TR: per seed, the FM's gain over the VM (and the VM's over the base rate) that failed."""
    why = []
    for r in report["per_seed"]:
        te = r["headline"]["test"]
        gap, floor = te.get("gap"), te.get("baseline_beats_floor")
        if gap is None:
            why.append(f"seed {r['seed']}: no test rows")
        elif gap["ci"][0] <= 0:
            why.append(f"seed {r['seed']}: the FM's gain over the VM, {gap['value']:.4f} "
                       f"[{gap['ci'][0]:.4f}, {gap['ci'][1]:.4f}], is not above 0 at the 95% lower bound")
        elif floor is not None and not floor["met"]:
            why.append(f"seed {r['seed']}: the VM does not beat the base rate at the 95% lower bound")
    return "no TR is quoted: " + ("; ".join(why) if why else "no variant has one")


def _finish(fig, ax, path: Path, title: str, xlabel: str | None, ylabel: str, empty: str | None = None,
            **legend) -> str:
    """Labels, legend and title of a one-axes plot, then saved (its file name). ``empty``: why the plot has nothing
    to draw, written across it (a blank frame says nothing)."""
    if xlabel:
        ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if empty:
        import textwrap
        ax.text(0.5, 0.5, "Nothing to draw:\n" + textwrap.fill(empty, 70), transform=ax.transAxes, ha="center",
                va="center", fontsize=8, color="0.3")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**{"fontsize": 8, **legend})
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    import matplotlib.pyplot as plt
    plt.close(fig)
    return path.name


def _across_seeds(summary: list[dict]):
    pick = {"FM gain (relative)": lambda s: s["fm_gain_relative"], "TR all tiers": lambda s: s["tr"].get("solaris"),
            "TR KD": lambda s: s["tr"].get("vm_kd"), "any tier": lambda s: s["coverage"]["any_tier"],
            "pair of ceiling": lambda s: s["coverage"]["pair_of_ceiling"],
            "FM inferences per row": lambda s: s["fm_total_per_row"]}
    for name, f in pick.items():
        yield name, [x for x in map(f, summary) if x is not None]


def markdown(report: dict, files: dict) -> str:
    """``report.md``: its sections in order, each from the part of the report it shows."""
    first = report["per_seed"][0] if report["per_seed"] else {}
    L = _md_protocol(report) + _md_targets(report) + ["", "## Test results per seed"]
    for r in report["per_seed"]:
        L += _md_seed(r)
    if first.get("curves"):
        L += _md_curves(report, first)
    if first.get("secondary_t1_only"):
        L += _md_secondary(first)
    if first.get("kd_grid_check"):
        L += _md_kd_grid_check(first)
    if first.get("without_recency"):
        L += _md_without_recency(report, first)
    if report.get("sweep"):
        L += _md_sweep(report)
    for n in report.get("notes", []):
        L += ["", f"**Note:** {n}."]
    L += _md_plots(report, files)
    return "\n".join(L) + "\n"


def _md_protocol(report: dict) -> list[str]:
    """The title and the protocol in one paragraph: dates, seeds, the headline's settings."""
    cfg, P = report["config"], report["protocol"]
    return [f"# SOLARIS replay evaluation: {report['dataset']}", "",
            f"Protocol: FM, autoencoder and verifier trained on [{P['t0']}, {P['t1']}) (early stopping from "
            f"{P['fm_valid_from']}); replay of [{P['t1']}, {P['t3']}) every {cfg['cadence']}; VMs trained on "
            f"[{P['t0']}, {P['valid_from']}), validated on [{P['valid_from']}, {P['t2']}), tested on "
            f"[{P['t2']}, {P['t3']}). Seeds {report['seeds']}. Headline: budget {cfg['budget']} FM inferences "
            f"per served row, TTLs pair {cfg['ttl_pair']} / aggregate {cfg['ttl_aggregate']} / user state "
            f"{cfg.get('ttl_user_state', '-')} / neighbour {cfg['ttl_neighbour']}, pool = pairs ranked in the last {cfg['recent_hours']:g} h + "
            f"{cfg['n_candidates']} simulator candidates per active user + misses, priority "
            f"{cfg['select_priority']}, visibility delay {cfg['delay']}."]


def _md_targets(report: dict) -> list[str]:
    """## Targets: each target per seed, the headline numbers across seeds, the parts a merged report joins."""
    L = ["", "## Targets", "",
         "| seed | FM beats VM >= 2% | TR(all tiers) >= 0.3 | TR >= 1.5 x TR(KD) (paired bound) | "
         "pair >= 80% of ceiling | any tier >= 90% | <= 1 FM inference / row (pairs + user embeddings) | "
         "tiers with value >= 85% |", "|---|---|---|---|---|---|---|---|"]
    yes = lambda b: "n/a: KD's TR interval reaches 0" if b is None else ("yes" if b else "**no**")
    for p in report["targets"]["per_seed"]:
        L.append(f"| {p['seed']} | {yes(p['fm_beats_vm_by_2pct'])} | {yes(p['tr_solaris_at_least_0.3'])} | "
                 f"{yes(p['tr_solaris_at_least_1.5x_kd'])} | {yes(p['pair_at_least_80pct_of_ceiling'])} | "
                 f"{yes(p['any_tier_at_least_90pct'])} | {yes(p['fm_per_row_at_most_1'])} | "
                 f"{_yes_valued(p.get('valued_tiers_cover_at_least_85pct'))} |")
    if len(report["summary"]) > 1:
        L += ["", f"Across seeds {report['seeds']}: " + "; ".join(
            f"{name} mean {_f(np.mean(xs), 3)} (min {_f(min(xs), 3)}, max {_f(max(xs), 3)})"
            for name, xs in _across_seeds(report["summary"]) if xs) + "."]
    L += _md_across_seeds(report["targets"].get("across_seeds"))
    if report.get("merged_from"):
        L += ["", "Merged (`solaris evaluate-merge`) from " + "; ".join(
            f"{m['path']} (seeds {m['seeds']}{', sweep ' + str(m['sweep']) if m['sweep'] else ''})"
            for m in report["merged_from"]) + "."]
    return L


def _md_across_seeds(a: dict | None) -> list[str]:
    """The headline criterion across seeds, every variant's dBCE and each tier's value, with their intervals."""
    if not a:
        return []
    c = a["criterion"]
    met = {None: f"not decided (fewer than {MIN_SEEDS} seeds)", True: "**met**", False: "**not met**"}[c["met"]]
    L = ["", f"Headline criterion over seeds {a['seeds']}: {c['statistic']} = {_f(c['value'], 5)}"
             f"{_ci(c['ci'], 5)}: {met} (interval: {c['method']}).", "",
         "| variant | dBCE = BCE(VM) - BCE(X) [95%, seeds and users] |", "|---|---|"]
    L += [f"| {LABELS.get(n, n)} | {_f(d['value'], 5)}{_ci(d['ci'], 5)} |" for n, d in a["dbce"].items()]
    if a.get("tier_value"):
        L += ["", "Value of each tier on its own test rows across seeds: " + "; ".join(
            f"{t} {_f(v['value'], 5)}{_ci(v['ci'], 5)}" for t, v in a["tier_value"].items()) + "."]
    v = a.get("valued_coverage")
    if v:
        L += ["", f"Test rows served by the tiers that carry value across seeds ({', '.join(v['tiers']) or 'none'}): "
                  f"{_f(v['share'], 3)} (target >= 0.85: {'met' if v['met'] else '**not met**'})."]
    return L


def _yes_valued(b) -> str:
    return "n/a: no tier values" if b is None else ("yes" if b else "**no**")


def _md_seed(r: dict) -> list[str]:
    """### Seed n: the variants' test results, coverage and cost, tier shares, TR per tier and segment."""
    h = r["headline"]
    te = h["test"]
    L = ["", f"### Seed {r['seed']}: {te['rows']} test rows, {te['users']} users "
             f"({h['returning_test_users']} returning); FM - VM gap {_f(te['gap']['value'], 5)}"
             f"{_ci(te['gap']['ci'], 5)} ({100 * te['gap']['relative']:.2f}% of VM BCE); "
             f"TR quoted: {te['tr_quoted']}",
         "", "| variant | test BCE [95%] | AUC | TR [95%] |", "|---|---|---|---|"]
    for n in ORDER:
        v = te["variants"].get(n)
        if v is None:
            continue
        L.append(f"| {LABELS[n]} | {_f(v['bce'], 5)}{_ci(v['bce_ci'], 5)} | {_f(v['auc'], 4)} | "
                 f"{_f(v['tr'], 3)}{_ci(v['tr_ci'])} |")
    c = te.get("criterion")
    if c:
        L += ["", _verdict(c, te["variants"].get("vm_kd"))]
    return (L + _md_headroom(h) + _md_tier_value(r) + _md_coverage(r) + _md_tier_shares(h)
            + _md_per_tier_and_segment(h))


def _md_tier_value(r: dict) -> list[str]:
    """Each fallback tier's value on its own rows (validation, then test): what its embedding adds beyond its
    flag."""
    tv = r.get("tier_value")
    if not tv or not any(tv.values()):
        return []
    L = ["", "Value of each tier on its own rows: BCE(tier flags, codes zeroed) - BCE(all tiers), [95%] over users "
             "(above 0: the tier's embeddings carry value):", "", "| tier | validation | test |", "|---|---|---|"]
    for t in TIERS[:-1]:
        cell = lambda part: (f"{_f(part[t]['value'], 5)}{_ci(part[t]['ci'], 5)} ({part[t]['rows']} rows)"
                             if part and part.get(t) and part[t]["rows"] else "-")
        L.append(f"| {t} | {cell(tv.get('validation'))} | {cell(tv.get('test'))} |")
    return L


def _md_headroom(h: dict) -> list[str]:
    """The achievable test BCE (synthetic data: the labels' own probabilities) and the share of the headroom above
    the VM each model reaches."""
    hr = h.get("headroom")
    if not hr:
        return []
    parts = ", ".join(f"{LABELS[n]} {_f(hr['share_above_vm'].get(n), 3)}" for n in ORDER
                      if n in hr["share_above_vm"] and n != "vm")
    return ["", f"Achievable test BCE (the probabilities the labels were drawn from) {_f(hr['achievable_bce'], 5)}; "
                f"share of the headroom above the VM reached: {parts}."]


def _md_coverage(r: dict) -> list[str]:
    """A seed's coverage of the test rows, its cost in FM inferences, and the age of what was served."""
    cov = r["headline"]["coverage"]["test"]
    ages = ", ".join(f"{k} mean {_f(v['mean_h'], 2)} h (p90 {_f(v['p90_h'], 2)})" for k, v in cov["age"].items()
                     if v)
    shares = ", ".join(f"{t.replace('_', ' ')} {_f(cov['shares'].get(t), 3)}" for t in TIERS)
    return ["", f"Coverage of the test rows (through FeatureReader): {shares}; any tier {_f(cov['any_tier'], 3)}. "
                f"Pair ceiling (pair shown before the last refresh) {_f(cov['ceiling'], 3)}: pair tier = {_f(cov['pair_of_ceiling'], 3)} "
                f"of it. FM inferences per served row {_f(r['fm_per_row']['per_row'], 3)} "
                f"({r['fm_per_row']['fm_inferences']} pair inferences for {r['fm_per_row']['served_rows']} rows; "
                f"plus {_f(r['fm_per_row']['user_embeddings_per_row'], 3)} FM user embeddings per row for the "
                f"user-state and neighbour tiers, every user with history at every refresh).",
            f"Age of what was served: {ages}."]


def _md_tier_shares(h: dict) -> list[str]:
    """The tier shares of a seed's training, validation and test rows side by side."""
    L = ["", "Tier shares of training, validation and test rows (train on what is served):", "",
         "| rows | " + " | ".join(TIERS) + " |", "|---|" + "---|" * len(TIERS)]
    for k, sh in h["tier_shares_side_by_side"].items():
        L.append(f"| {k} | " + " | ".join(_f(sh.get(t), 3) for t in TIERS) + " |")
    return L


def _md_per_tier_and_segment(h: dict) -> list[str]:
    """The gap and the TRs of all tiers and of KD per tier served and per segment of a seed's test rows."""
    L = ["", "TR of all tiers (and KD) per tier served and per segment:", "",
         "| rows | n | FM - VM gap [95%] | TR all tiers [95%] | TR KD [95%] |", "|---|---|---|---|---|"]
    for group in ("per_tier", "segments"):
        for k, sm in h[group].items():
            if not sm.get("rows") or sm.get("gap") is None:
                continue
            s_ = sm["variants"]["solaris"]
            kd = sm["variants"]["vm_kd"]
            L.append(f"| {k} | {sm['rows']} | {_f(sm['gap']['value'], 5)}{_ci(sm['gap']['ci'], 5)} | "
                     f"{_f(s_['tr'], 3)}{_ci(s_['tr_ci'])} | {_f(kd['tr'], 3)}{_ci(kd['tr_ci'])} |")
    return L


def _md_curves(report: dict, first: dict) -> list[str]:
    """## Curves: the budget curve, the cadence curve and the fast cadence's replay (the first seed)."""
    cu = first["curves"]
    L = ["", f"## Curves (seed {first['seed']}; the all-tiers VM with the headline's hyperparameters)", "",
         "| budget (per served row, asked) | FM inferences per served row (used) | pair | any tier | "
         "pair / ceiling | TR all tiers [95%] |", "|---|---|---|---|---|---|"]
    for p in cu["budget"]:
        L.append(f"| {p['budget_per_row']:g} | {_f(p['fm']['per_row'], 3)} | {_f(p['coverage']['shares']['pair'], 3)}"
                 f" | {_f(p['coverage']['any_tier'], 3)} | {_f(p['coverage']['pair_of_ceiling'], 3)} | "
                 f"{_f(p['solaris']['tr'], 3)}{_ci(p['solaris']['tr_ci'])} |")
    L += ["", "| cadence | FM inferences per served row | pair | any tier | TR all tiers [95%] |",
          "|---|---|---|---|---|"]
    for p in cu["cadence"]:
        L.append(f"| {p['cadence']} | {_f(p['fm']['per_row'], 3)} | {_f(p['coverage']['shares']['pair'], 3)} | "
                 f"{_f(p['coverage']['any_tier'], 3)} | {_f(p['solaris']['tr'], 3)}{_ci(p['solaris']['tr_ci'])} |")
    if cu.get("fast_cadence"):
        L += _md_fast_cadence(report, cu["fast_cadence"])
    return L


def _md_fast_cadence(report: dict, fc: dict) -> list[str]:
    """The fast cadence's replay: coverage of the test rows it covers, beside the other cadences on the same rows."""
    L = ["", f"Fast cadence: its own replay, switching from the {report['config']['cadence']} refreshes at "
             f"{fc['switch_at']}; coverage of the test "
             f"rows in [{fc['window'][0]}, {fc['window'][1]}) (FM inferences per served row at "
             f"{report['config']['fast_cadence']}: {_f(fc['fast_fm_per_row'], 3)}):", "",
         "| cadence | pair | any tier | pair / ceiling | TR of the headline VM (trained at "
         f"{report['config']['cadence']}) [95%] |", "|---|---|---|---|---|"]
    for k, c in fc["coverage"].items():
        h = c.get("headline_vm", {}).get("solaris") or {}
        L.append(f"| {k} | {_f(c['shares']['pair'], 3)} | {_f(c['any_tier'], 3)} | "
                 f"{_f(c['pair_of_ceiling'], 3)} | {_f(h.get('tr'), 3)}{_ci(h.get('tr_ci'))} |")
    return L


def _md_secondary(first: dict) -> list[str]:
    """## Secondary: the variants trained on [t1, valid_from) only (the first seed)."""
    sec = first["secondary_t1_only"]
    te = sec["test"]
    L = ["", f"## Secondary: VMs trained on {sec['training_rows']} only ({sec['rows']} rows; seed "
             f"{first['seed']}, same test rows)", "", "| variant | test BCE [95%] | TR [95%] |", "|---|---|---|"]
    for n in ORDER:
        v = te["variants"].get(n)
        if v is not None:
            L.append(f"| {LABELS[n]} | {_f(v['bce'], 5)}{_ci(v['bce_ci'], 5)} | {_f(v['tr'], 3)}"
                     f"{_ci(v['tr_ci'])} |")
    c = te.get("criterion")
    if c:
        L += ["", _verdict(c, te["variants"].get("vm_kd"))]
    return L


def _md_without_recency(report: dict, first: dict) -> list[str]:
    """## The comparison before #40: the rankers without the recency inputs (the first seed)."""
    old, head = first["without_recency"]["test"], first["headline"]["test"]
    L = ["", f"## The comparison before #40: no recency inputs (seed {first['seed']}, same rows and grids)", "",
         "Every ranker takes the lifetime counters only, as before #40; the headline (every ranker with the recency "
         "inputs) beside it.", "",
         "| variant | test BCE, no recency [95%] | dBCE [95%] | TR | test BCE, headline | dBCE | TR |",
         "|---|---|---|---|---|---|---|"]
    for n in ORDER:
        v, h = old["variants"].get(n), head["variants"].get(n)
        if v is not None and h is not None:
            L.append(f"| {LABELS[n]} | {_f(v['bce'], 5)}{_ci(v['bce_ci'], 5)} | {_f(v['dbce'], 5)}"
                     f"{_ci(v['dbce_ci'], 5)} | {_f(v['tr'], 3)} | {_f(h['bce'], 5)} | {_f(h['dbce'], 5)} | "
                     f"{_f(h['tr'], 3)} |")
    c = old.get("dbce_criterion")
    if c:
        L += ["", f"Without the recency inputs, {c['statistic']} = {_f(c['value'], 5)}{_ci(c['ci'], 5)}."]
    return L


def _md_kd_grid_check(first: dict) -> list[str]:
    """## Post hoc: VM + KD on a wider grid (the first seed)."""
    kc = first["kd_grid_check"]
    b, t = kc["best"], kc["variants"]
    L = ["", f"## Post hoc: VM + KD on a wider grid (seed {first['seed']})", "",
         "Not a headline setting: added after the headline runs because KD's best point was its grid's corner "
         "(the smallest weight and temperature). VM + KD is also trained at weight x temperature "
         f"{', '.join(_point(g['params']) for g in kc['grid'])}"
         f"; the best of both grids on validation is {_params(b['params'])} ({b['from']}, valid BCE "
         f"{_f(b['valid_bce'], 5)}; the headline's {_params(kc['headline_grid_best']['params'])}, "
         f"{_f(kc['headline_grid_best']['valid_bce'], 5)}).", "",
         "| | test BCE [95%] | TR [95%] |", "|---|---|---|"]
    for k, name in (("vm_kd", "VM + KD (headline grid)"), ("vm_kd_best", "VM + KD (best of both grids)"),
                    ("solaris", "VM + SOLARIS, all tiers")):
        v = t[k]
        L.append(f"| {name} | {_f(v['bce'], 5)}{_ci(v['bce_ci'], 5)} | {_f(v['tr'], 3)}{_ci(v['tr_ci'])} |")
    if kc.get("criterion"):
        L += ["", _verdict(kc["criterion"], t["vm_kd_best"])]
    return L


def _md_sweep(report: dict) -> list[str]:
    """## Sweep: per share of the label signal only a sequence model can see, the BCEs and TRs."""
    L = ["", "## Sweep: share of the label signal only a sequence model can see (seed "
             f"{report['sweep'][0].get('seed', report['config'].get('sweep_seed', 0))} each)", "",
         "| sequence share | positive rate | VM BCE | VM + KD BCE | VM + SOLARIS BCE | FM BCE | FM gain | "
         "TR all tiers [95%] | TR KD [95%] | TR - 1.5 TR(KD) [95%] |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in report["sweep"]:
        c = s["criterion"]
        bce = s.get("bce") or {}
        L.append(f"| {s['sequence_share']:g} | {_f(s['positive_rate'], 3)} | {_f(s['vm_bce'], 5)} | "
                 f"{_f(bce.get('vm_kd'), 5)} | {_f(bce.get('solaris'), 5)} | {_f(s['fm_bce'], 5)} | "
                 f"{100 * s['fm_gain_relative']:.2f}% | {_f(s['tr'].get('solaris'), 3)}"
                 f"{_ci(s['tr_ci'].get('solaris'))} | {_f(s['tr'].get('vm_kd'), 3)}{_ci(s['tr_ci'].get('vm_kd'))}"
                 f" | {_f(c['value'], 3) if c else '-'}{_ci(c['ci']) if c else ''} |")
    return L


def _md_plots(report: dict, files: dict) -> list[str]:
    """## Plots, and the run's wall time."""
    L = ["", "## Plots", ""]
    for name, f in files.items():
        L += [f"![{name}]({f})", ""]
    return L + [f"Wall time: {report['timings']['total_s'] / 60:.1f} min (replays, training and serving included; "
                "cached steps reused)."]


def apply_kd_rule(obj) -> None:
    """Sets ``kd_transfers`` and ``met`` (None when KD's TR interval reaches 0) on every KD criterion of a
    report, from the intervals it already holds (``metrics.summarize_losses`` does the same for new runs)."""
    if isinstance(obj, dict):
        c = obj.get("criterion")
        if isinstance(c, dict) and "ci" in c:
            name = c.get("kd", "vm_kd")
            kd = (obj.get("variants") or {}).get(name) or {}
            ci = kd.get("tr_ci") if kd else (obj.get("tr_ci") or {}).get(name)
            c["kd_transfers"] = transfers(ci)
            c["met"] = bool(c["ci"][0] > 0) if c["kd_transfers"] else None
        for v in obj.values():
            apply_kd_rule(v)
    elif isinstance(obj, list):
        for v in obj:
            apply_kd_rule(v)


def _point(p: dict) -> str:
    return f"({p['kd_weight']:g}, {p['kd_temperature']:g})"


def _params(p: dict) -> str:
    return f"weight {p['kd_weight']:g}, temperature {p['kd_temperature']:g}"


def _verdict(c: dict, kd: dict | None) -> str:
    """The paired KD criterion in words; no ratio is quoted over a KD whose TR interval reaches 0."""
    head = f"{c['statistic']} = {_f(c['value'], 3)}{_ci(c['ci'])}"
    ci = (kd or {}).get("tr_ci")
    if not transfers(ci):
        return (f"{head}: no ratio quoted, KD's TR interval{_ci(ci)} reaches 0 (KD does not transfer here; the "
                "absolute TRs above are the result).")
    return f"{head}: {'met' if c['ci'][0] > 0 else 'not met'}."


HTML_STYLE = """body{font:14px/1.45 system-ui,sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:1em 0}th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left}
th{background:#f3f3f3}img{max-width:100%;border:1px solid #eee}code{background:#f6f6f6;padding:0 .2em}"""


def html(md: str, folder: Path, title: str) -> str:
    """The Markdown report as one HTML page: tables rendered, each ``![..](plot.png)`` inlined as a data URI (a
    plot that is not in ``folder`` is an error, not a broken image)."""
    import base64
    import html as html_lib

    from markdown_it import MarkdownIt
    md_it = MarkdownIt("commonmark").enable("table")

    def inline(renderer, tokens, idx, options, env):
        token = tokens[idx]
        path = Path(folder) / token.attrGet("src")
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the report names this plot and it was not written")
        data = base64.b64encode(path.read_bytes()).decode()
        alt = html_lib.escape("".join(c.content for c in (token.children or [])), quote=True)
        return f'<img src="data:image/png;base64,{data}" alt="{alt}" title="{alt}">'

    md_it.add_render_rule("image", inline)
    return (f"<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html_lib.escape(title)}"
            f"</title><style>{HTML_STYLE}</style></head>\n<body>\n{md_it.render(md)}</body></html>\n")


def write(report: dict, out: Path) -> Path:
    """Writes the plots, ``report.md`` and ``report.html`` under ``out``; returns the Markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = _plots(report, out)
    path = out / "report.md"
    text = markdown(report, files)
    path.write_text(text)
    first = text.splitlines()[0].lstrip("# ").strip() if text else "SOLARIS evaluation"
    (out / "report.html").write_text(html(text, out, first))
    logger.info("report: %s (and report.html)", path)
    return path


def save(report: dict, out: Path) -> Path:
    """Writes ``report.json`` and then the readable report (``write``) under ``out``; returns the Markdown's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_json_default) + "\n")
    return write(report, out)


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


def headline_table(report: dict) -> str:
    """A few lines for a terminal: per seed the FM's gain, the TRs, coverage and cost."""
    f = lambda x, nd=3: "-" if x is None else f"{x:.{nd}f}"
    lines = [f"{'seed':>4s} {'FM gain':>8s} {'TR all tiers':>12s} {'TR KD':>7s} {'any tier':>8s} {'pair/ceil':>9s} "
             f"{'FM/row':>6s}"]
    for p in report["summary"]:
        lines.append(f"{p['seed']:4d} {100 * p['fm_gain_relative']:7.2f}% {f(p['tr'].get('solaris')):>12s} "
                     f"{f(p['tr'].get('vm_kd')):>7s} {f(p['coverage']['any_tier']):>8s} "
                     f"{f(p['coverage']['pair_of_ceiling']):>9s} {f(p['fm_per_row']):>6s}")
    if report["summary"] and not any(p["tr_quoted"] for p in report["summary"]):
        lines.append("(no TR quoted: the FM's gain over the VM is not above 0 at the 95% lower bound)")
    for p in report.get("sweep", []):
        lines.append(f"sweep: sequence share {p['sequence_share']:g}: FM gain {100 * p['fm_gain_relative']:.2f}%, "
                     f"TR all tiers {f(p['tr'].get('solaris'))}, TR KD {f(p['tr'].get('vm_kd'))}")
    return "\n".join(lines)


if __name__ == "__main__":          # re-render report.md and the plots from a report.json
    import sys

    from solaris_jobs.evaluation.targets import check_targets
    src = Path(sys.argv[1])
    rep = json.loads(src.read_text())
    apply_kd_rule(rep)                                # today's quoting rule on a report written before it
    rep["targets"] = check_targets(rep["summary"])  # a pure function of the summaries
    src.write_text(json.dumps(rep, indent=1) + "\n")
    print(write(rep, src.parent))
