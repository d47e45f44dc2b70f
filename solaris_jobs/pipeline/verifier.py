"""The verifier: the current VM (without FM features) scores candidate pairs on executors."""
from __future__ import annotations

from typing import Iterator

import numpy as np
import pandas as pd

from solaris_jobs.core.settings import PrecomputeConfig
from solaris_jobs.pipeline.history import COUNTER_COLS
from solaris_jobs.pipeline.model_refs import ModelRef, load, task_device


def score_pairs(pairs, vm: ModelRef, cfg: PrecomputeConfig):
    """Adds ``vm_score`` (the verifier: the current VM without FM features) to pairs with counter columns. Only the
    model's inputs go to Python and only the score comes back (a pandas UDF), not the pairs' other columns."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import FloatType

    if vm.config.get("recency"):
        raise ValueError(f"verifier {vm.path}: this VM takes the rankers' recency inputs, which the select step does "
                         "not compute (it has each pair's counters at T); train the verifier with "
                         "`training.train_verifier` (`solaris train` does)")
    device, threads = cfg.device, cfg.torch_threads
    names = ("user", "item", *COUNTER_COLS)

    def score(batches: Iterator[tuple[pd.Series, ...]]) -> Iterator[pd.Series]:
        import torch

        from models import batch_to_tensors
        model, _, dev = load(vm, task_device(device), threads)
        batch_size = cfg.batch_on(dev)
        for cols in batches:
            arrays = [c.to_numpy(np.int64 if k < 2 else np.float32) for k, c in enumerate(cols)]
            scores = np.empty(len(arrays[0]), np.float32)
            with torch.inference_mode():
                for s in range(0, len(scores), batch_size):
                    b = {name: a[s: s + batch_size] for name, a in zip(names, arrays)}
                    scores[s: s + batch_size] = torch.sigmoid(model(batch_to_tensors(b, dev))["logit"]).cpu().numpy()
            yield pd.Series(scores)

    udf = F.pandas_udf(score, FloatType())
    return pairs.withColumn("vm_score", udf("user_id", "item_id", *COUNTER_COLS))
