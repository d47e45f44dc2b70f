"""What every layer must agree on, in one place without heavy imports (no torch, no pandas): the serving tiers in
the order of the VM's one-hot input, the sizes of the history token vocabularies the model inputs produce and the
FM embeds, and the version string of the embeddings in the store.
"""
from __future__ import annotations

# The VM's tier one-hot and the reader's tier codes, in the order the reader falls back through them.
TIERS = ("pair", "item_aware", "user_aggregate", "user_state", "neighbour", "none")
TIER_NONE = TIERS.index("none")

N_GAP_BUCKETS = 33          # 0 = padding, 1..32 = 1 + floor(log2(1 + seconds))
N_SIGNALS = 9               # 0 = padding, 1..5 = rating, 6 = negative, 7 = positive (no rating), 8 = label unknown
SIGNAL_UNKNOWN = 8          # no rating and no label: none in the log, or not arrived yet (the label delay)

# The log-derived inputs every ranker gets (#40), computed point in time from the impression log: minutes since
# this pair / this item was last shown and since the user's previous event (NaN: never), and how often this pair
# was shown in the last 1 h, 6 h and 24 h.
RECENCY_WINDOWS_H = (1, 6, 24)
RECENCY_MINUTES = ("pair_last_min", "item_last_min", "user_prev_min")
RECENCY_INPUTS = RECENCY_MINUTES + tuple(f"pair_cnt_{h}h" for h in RECENCY_WINDOWS_H)


def embedding_version(fm_version: str, ae_version: str) -> str:
    """The version the store's rows carry and a transfer VM expects: ``<fm>+<ae>`` (an FM code is only meaningful
    with the autoencoder that compressed it)."""
    return f"{fm_version}+{ae_version}"


def vm_embedding_version(vm_meta: dict) -> str | None:
    """The embedding version a VM checkpoint was trained with, None if it takes no FM input."""
    extra = vm_meta.get("extra", {})
    if vm_meta["config"].get("fm_dim", 0) and extra.get("fm_version") and extra.get("ae_version"):
        return embedding_version(extra["fm_version"], extra["ae_version"])
    return None
