"""Compare two demo workdirs (base vs after): every published offline output (rows, sorted), stats (volatile keys
dropped), the online SQLite store's rows, the quick evaluation's report.json (timing keys dropped).
Usage: compare.py BASE_ROOT AFTER_ROOT   (each a checkout root with artifacts/demo-movielens and feature_repo/data)"""
import json, sqlite3, sys, re
from pathlib import Path
import pandas as pd, pyarrow.parquet as pq, numpy as np
VOL = re.compile(r"(seconds|written_at|published_at|_s$|per_s|wall|time|run$|selection$|peak|rss|elapsed|_at_wall|duration|log$|user_batch)")
def clean(o, path=""):
    if isinstance(o, dict):
        return {k: clean(v, path + "." + k) for k, v in o.items() if not VOL.search(k)}
    if isinstance(o, list):
        return [clean(v, path) for v in o]
    if isinstance(o, str):
        return re.sub(r"run-[0-9a-f]+", "run-X", re.sub(r"/work/wt-[a-z]+|/work/main", "ROOT", o))
    return o
def published(folder: Path):
    ptrs = sorted(folder.glob("_PUBLISHED.*"), key=lambda p: int(p.name.split(".")[1]))
    if not ptrs:
        return None
    run = json.loads(ptrs[-1].read_text())["run"]
    return folder / (run if run.startswith("run-") else "run-" + run)
def frame(d: Path):
    files = sorted(d.glob("*.parquet"))
    if not files:
        return None
    df = pd.concat([pq.read_table(f).to_pandas() for f in files], ignore_index=True)
    for c in df.columns:
        if df[c].dtype == object and len(df) and isinstance(df[c].iloc[0], (np.ndarray, list)):
            df[c] = df[c].map(lambda a: tuple(np.asarray(a).tolist()))
    if "run" in df.columns: df = df.drop(columns=["run"])
    return df.sort_values(list(df.columns)).reset_index(drop=True) if len(df) else df
bad = 0
def diff(what, a, b):
    global bad
    if a != b:
        bad += 1
        print("DIFF", what, str(a)[:300], "|", str(b)[:300])
A, B = Path(sys.argv[1]), Path(sys.argv[2])
oa, ob = A / "artifacts/demo-movielens/offline", B / "artifacts/demo-movielens/offline"
n = 0
for ds in sorted(p.name for p in oa.iterdir() if p.is_dir()):
    for iv in sorted(p.name for p in (oa / ds).iterdir() if p.name.startswith("end=")):
        pa_, pb = published(oa / ds / iv), published(ob / ds / iv) if (ob / ds / iv).exists() else None
        if pa_ is None or pb is None:
            diff(f"{ds}/{iv} published", pa_ is None, pb is None); continue
        fa, fb = frame(pa_), frame(pb)
        if fa is None or fb is None:
            diff(f"{ds}/{iv} frame none", fa is None, fb is None)
        else:
            try:
                pd.testing.assert_frame_equal(fa, fb, check_exact=True)
            except AssertionError as e:
                diff(f"{ds}/{iv} rows", str(e)[:400], "")
        sa, sb = [json.loads((p / "_stats.json").read_text()) if (p / "_stats.json").exists() else None for p in (pa_, pb)]
        diff(f"{ds}/{iv} stats", clean(sa), clean(sb))
        for f in pa_.iterdir():
            if f.suffix in (".npy", ".faiss"):
                diff(f"{ds}/{iv}/{f.name}", f.read_bytes() == (pb / f.name).read_bytes(), True)
        n += 1
print("offline outputs compared:", n)
for name in ("reports",):
    for iv in sorted((oa / name).glob("end=*")) if (oa / name).exists() else []:
        ra, rb = json.loads((iv / "report.json").read_text()), json.loads((ob / name / iv.name / "report.json").read_text())
        diff(f"reports/{iv.name}", clean(ra), clean(rb))
def rows(db):
    con = sqlite3.connect(db); out = {}
    for (t,) in con.execute("select name from sqlite_master where type='table'"):
        out[t] = sorted(con.execute(f'select * from "{t}"').fetchall(), key=repr)
    return out
ra, rb = rows(A / "feature_repo/data/online_store.db"), rows(B / "feature_repo/data/online_store.db")
diff("online tables", sorted(ra), sorted(rb))
for t in ra:
    a, b = ra[t], rb.get(t)
    # drop created/ written timestamps columns? compare whole rows except last-col timestamps
    diff(f"online {t} rows ({len(a)})", a, b)
for rep in sorted((A / "artifacts/demo-movielens").rglob("report.json")):
    rel = rep.relative_to(A)
    if "offline" in rel.parts: continue
    diff(f"{rel}", clean(json.loads(rep.read_text())), clean(json.loads((B / rel).read_text())))
print("differences:", bad)
