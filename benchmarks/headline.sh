#!/usr/bin/env bash
# The #40 headline, one part at a time (a part takes hours on 2 cores; each part's report is committed as it ends,
# so a session that stops loses at most the part under way). Every part runs the code frozen by `freeze`, in its
# own worktree and venv: a seed run later, on a changed main, still runs the evaluated code.
#
#   benchmarks/headline.sh freeze COMMIT   worktree of COMMIT at $WT and its venv (make venv)
#   benchmarks/headline.sh seed N          seed N (seed 0 with the curves, the fast cadence, the KD check and the
#                                          comparison without the recency inputs; others without the curves)
#   benchmarks/headline.sh sweep           the sequence-share sweep's 0.75 point (seed 0)
#   benchmarks/headline.sh merge           one report over every committed part
#   benchmarks/headline.sh search FAMILY   an FM family's recipe search (#41: gru4rec), its table and points kept
#   benchmarks/headline.sh family FAMILY N one descriptive headline seed of that family (#41), after its search
#
# The #40 seeds all run one frozen commit (WT=/work/wt-eval); the #41 parts need a later one (the family's recipe):
# freeze it in another worktree, e.g. WT=/work/wt-fam benchmarks/headline.sh freeze COMMIT, and give that WT to them.
#
# Each part's report.json is copied to benchmarks/results/headline40/<part>.json (each seed in it records the
# commit that ran it); commit it at once. Run nothing heavy beside a part (its replay reads Redis on a 10 ms
# budget). Launch detached, e.g.
#   (setsid nohup benchmarks/headline.sh seed 1 > $OUT/seed1.log 2>&1; echo "exit $?" >> $OUT/seed1.log) &
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
WT="${WT:-/work/wt-eval}"
OUT="${OUT:-/work/eval40}"
VENV="${VENV:-$WT/.venv}"
RESULTS="$HERE/benchmarks/results/headline40"
export JAVA_HOME="${JAVA_HOME:-$(ls -d /usr/lib/jvm/java-17-openjdk-* | head -1)}"
export SPARK_LOCAL_IP=127.0.0.1
export PYSPARK_PYTHON="$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$VENV/bin/python"

frozen() {
    test -d "$WT" || { echo "no frozen worktree at $WT: run $0 freeze COMMIT" >&2; exit 2; }
    git -C "$WT" rev-parse HEAD
}

keep() {  # keep PART DIR: the part's report into the results (each seed records the commit that ran it)
    frozen >/dev/null
    mkdir -p "$RESULTS"
    cp "$2/report.json" "$RESULTS/$1.json"
    echo "kept: $RESULTS/$1.json (commit it now)"
}

case "${1:-}" in
freeze)
    commit="${2:?freeze COMMIT}"
    git -C "$HERE" worktree add --detach "$WT" "$commit"
    make -C "$WT" venv
    ;;
seed)
    n="${2:?seed N}"
    cd "$WT"
    if [ "$n" = 0 ]; then
        "$VENV/bin/solaris" evaluate --seeds 0 --sequence-shares none --out "$OUT/seed0"
    else
        "$VENV/bin/solaris" evaluate --seeds "$n" --sequence-shares none --no-curves --fast-cadence none \
            --out "$OUT/seed$n"
    fi
    keep "seed$n" "$OUT/seed$n"
    ;;
sweep)
    cd "$WT"
    "$VENV/bin/solaris" evaluate --seeds none --sequence-shares 0.75 --no-curves --fast-cadence none \
        --out "$OUT/sweep075"
    keep sweep075 "$OUT/sweep075"
    ;;
merge)
    cd "$WT"
    "$VENV/bin/solaris" evaluate-merge "$RESULTS"/seed*.json "$RESULTS"/sweep*.json --out "$OUT/merged"
    cp "$OUT/merged/report.json" "$HERE/benchmarks/results/evaluation_synth.json"
    echo "merged: benchmarks/results/evaluation_synth.json (commit it, and the report's figures in BENCHMARKS)"
    ;;
search)
    family="${2:?search FAMILY}"
    cd "$WT"
    "$VENV/bin/solaris" evaluate-fm-search --family "$family" --out "$OUT/search-$family" \
        --result "$HERE/benchmarks/results/fm_search_synth_$family.json"
    cp -n "$OUT/search-$family"/fm_search/point-*.json "$HERE/benchmarks/results/fm_search_points/"
    echo "kept: benchmarks/results/fm_search_synth_$family.json and its points (commit them, and the choice into" \
         "settings.FM_RECIPES)"
    ;;
family)
    family="${2:?family FAMILY N}"
    n="${3:?family FAMILY N}"
    cd "$WT"
    "$VENV/bin/solaris" evaluate --fm "$family" --seeds "$n" --sequence-shares none --no-curves --fast-cadence none \
        --out "$OUT/$family-seed$n"
    frozen >/dev/null
    cp "$OUT/$family-seed$n/report.json" "$HERE/benchmarks/results/evaluation_synth_$family.json"
    echo "kept: benchmarks/results/evaluation_synth_$family.json (commit it now: one descriptive seed)"
    ;;
*)
    sed -n 2,21p "$0"
    exit 2
    ;;
esac
