"""The device check for a GPU machine: FM pair inference (history encoded once per user, target attention and the
trunk per pair, then the autoencoder's encoder: what the refresh's embed step runs) on the CPU and on each CUDA
device side by side, in float32 and under bfloat16 autocast, with pairs/s and how far each device's codes are from
the CPU's float32 ones. The FM is the product's (``TrainSettings``' widths and recipe, random weights: speed does
not depend on them), for each family (``--family``, both by default); batches are the refresh's (``PrecomputeConfig.batch_size`` on the CPU, ``gpu_batch_size`` on
a GPU), whole users.

    .venv/bin/python benchmarks/gpu_check.py [--users 2048 --pairs-per-user 20 --repeats 3]

Without CUDA it measures the CPU alone (and says so). Saves benchmarks/results/gpu_check.json. Whether bfloat16 is
safe for an FM (its codes within ``--tolerance`` of float32's, by max absolute difference) is what
``FoundationModel.mixed_precision`` should then declare.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from fm_inference import inputs, make_batches  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "gpu_check.json"


def run(fm, ae, data: dict, device: str, batch: int, bf16: bool, repeats: int) -> tuple[float, np.ndarray]:
    """Best pairs/s over ``repeats`` and the codes, on ``device`` in batches of about ``batch`` pairs."""
    import torch
    dev = torch.device(device)
    fm, ae = fm.to(dev), ae.to(dev)
    batches = make_batches(data, batch, shared=True, device=dev)
    best, codes = 0.0, None
    for _ in range(repeats):
        out = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.inference_mode(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            for tb, rows in batches:
                out.append(ae.encode(fm(tb, rows=rows)["h"]).float())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        best = max(best, len(data["rows"]) / (time.perf_counter() - t0))
        codes = torch.cat(out).cpu().numpy()
    return best, codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=2048)
    ap.add_argument("--pairs-per-user", type=int, default=20)
    ap.add_argument("--items", type=int, default=50_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=0.05, help="bfloat16 is safe within this max abs difference.")
    ap.add_argument("--family", nargs="+", default=["transformer", "gru4rec"],
                    help="The FM families measured, one after the other (each with the product's widths).")
    args = ap.parse_args()
    import torch

    from models import AEConfig, Autoencoder
    from models.checkpoint import FM_FAMILIES
    from solaris_jobs.core.settings import PrecomputeConfig, TrainSettings, validate_train
    from solaris_jobs.learning.training import fm_model_args
    ts, pc = TrainSettings(), PrecomputeConfig()
    data = inputs(args.users, args.pairs_per_user, args.items, ts.history_len)
    torch.set_num_threads(os.cpu_count())
    rows = []
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    for family in args.family:
        torch.manual_seed(0)
        fam = fm_model_args(validate_train({"fm_family": family}))        # the family's own recipe
        config_cls, model_cls = FM_FAMILIES[fam.pop("family")]
        fm = model_cls(config_cls(user_side={"n_ids": args.users + 1}, item_side={"n_ids": args.items},
                                  history_len=ts.history_len, **fam)).eval()
        ae = Autoencoder(AEConfig(d_in=fm.width, d_code=ts.d_code)).eval()
        ref_rate, ref = run(fm, ae, data, "cpu", pc.batch_size, False, args.repeats)
        rows.append({"family": family, "device": "cpu", "dtype": "float32", "batch": pc.batch_size,
                     "pairs_per_s": round(ref_rate), "max_abs_diff": 0.0})
        for d in devices:
            for bf16 in (False, True):
                rate, codes = run(fm, ae, data, d, pc.gpu_batch_size, bf16, args.repeats)
                rows.append({"family": family, "device": f"{d} ({torch.cuda.get_device_name(d)})",
                             "dtype": "bfloat16" if bf16 else "float32", "batch": pc.gpu_batch_size,
                             "pairs_per_s": round(rate), "max_abs_diff": float(np.abs(codes - ref).max())})
    for r in rows:
        print(f"{r['family']:12s} {r['device']:40s} {r['dtype']:9s} batch {r['batch']:6d}: {r['pairs_per_s']:>10,} pairs/s, "
              f"codes within {r['max_abs_diff']:.2e} of the CPU's float32")
    if not devices:
        print("no CUDA device here: the CPU alone was measured")
    bf = [r for r in rows if r["dtype"] == "bfloat16"]
    out = {"pairs": int(len(data["rows"])), "cpu_threads": os.cpu_count(), "rows": rows,
           "bfloat16_safe": {f: all(r["max_abs_diff"] <= args.tolerance for r in bf if r["family"] == f)
                      for f in args.family} if bf else None,
           "tolerance": args.tolerance, "command": " ".join(sys.argv)}
    OUT.write_text(json.dumps(out, indent=2) + "\n")
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
