"""Comparing offline outputs: what two runs of the same interval wrote, row for row (rows sorted by their keys;
the run's stats, timing included, are not rows)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from solaris_jobs import offline as off


def read_sorted(offline, dataset: str, end) -> pd.DataFrame:
    """One interval's published output through the layout module, rows sorted by every column that is not an
    array (keys first), so that equal outputs compare equal whatever order their files and rows came in."""
    df = off.read_table(offline, dataset, end).to_pandas()
    if not len(df):
        return df
    scalar = [c for c in df.columns if not isinstance(df[c].iloc[0], (np.ndarray, list))]
    key = [c for c in ("user_id", "item_id") if c in scalar] + [c for c in scalar if c not in ("user_id", "item_id")]
    return df.sort_values(key, kind="mergesort").reset_index(drop=True)


def assert_same_frames(x: pd.DataFrame, y: pd.DataFrame, name: str, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Same columns and rows; array columns within ``rtol``/``atol`` (exactly equal by default)."""
    assert list(x.columns) == list(y.columns), (name, list(x.columns), list(y.columns))
    assert x.shape == y.shape, (name, x.shape, y.shape)
    for c in x.columns:
        if len(x) and isinstance(x[c].iloc[0], (np.ndarray, list)):
            assert [len(v) for v in x[c]] == [len(v) for v in y[c]], (name, c)
            if sum(len(v) for v in x[c]):
                np.testing.assert_allclose(np.concatenate(x[c].to_list()), np.concatenate(y[c].to_list()),
                                           rtol=rtol, atol=atol, err_msg=f"{name}.{c}")
        else:
            pd.testing.assert_series_equal(x[c], y[c], check_names=False, obj=f"{name}.{c}")


def assert_same_outputs(a, b, end, datasets=off.DATASETS, rtol: float = 0.0, atol: float = 0.0) -> dict:
    """Asserts that two offline stores hold the same rows for the interval ending ``end``; returns the row counts
    per dataset."""
    counts = {}
    for d in datasets:
        x = read_sorted(a, d, end)
        assert_same_frames(x, read_sorted(b, d, end), d, rtol, atol)
        counts[d] = len(x)
    return counts


def main(argv=None) -> None:
    """``python -m tests.outputs A B``: compares every interval of every dataset two offline stores hold (either
    layout), rows sorted, exactly; a dataset only one holds must be empty there. Prints the row counts."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("a")
    ap.add_argument("b")
    args = ap.parse_args(argv)
    for d in off.DATASETS:
        ends_a, ends_b = off.list_intervals(args.a, d), off.list_intervals(args.b, d)
        for e in sorted(set(ends_a) | set(ends_b)):
            if e in ends_a and e in ends_b:
                n = assert_same_outputs(args.a, args.b, e, [d])[d]
                print(f"{d:18s} {e.isoformat()}  {n:7d} rows, identical")
            else:
                only, store = (args.a, "a") if e in ends_a else (args.b, "b")
                n = off.read_table(only, d, e).num_rows
                assert n == 0, f"{d} {e}: {n} rows only in {store}"
                print(f"{d:18s} {e.isoformat()}  only in {store}, empty")


if __name__ == "__main__":
    main()
