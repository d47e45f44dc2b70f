"""SOLARIS feature definitions for Feast: entities ``user`` and ``item``, one feature view per serving tier
(pair embeddings, item-aware pair fallbacks, user aggregates, user states, neighbours) over the pipeline's offline outputs, and the versioned
FeatureService ``solaris_v3``.

Names, fields and TTLs come from ``solaris_jobs.online.views`` (shared with the materializer and the serving
client). Sources read ``<offline>/<view>/`` (``solaris_jobs.core.settings.feast_offline_root()``: the configured
offline store, else the demo's).
"""
from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Array, Float32, Int32, Int64, String

from solaris_jobs.core.contract import TIERS
from solaris_jobs.core.settings import feast_offline_root, owner
from solaris_jobs.online.views import FEATURE_SERVICE, VERSION_POLICY, duration, views

OFFLINE = feast_offline_root()
OWNER = owner()
DTYPES = {"float_list": Array(Float32), "string": String, "int32": Int32, "int64_list": Array(Int64)}
TAGS = {"system": "solaris", "refreshed_by": "Airflow DAG solaris_refresh (hourly by default)"}

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64, owner=OWNER, tags=TAGS,
              description="A user of the ranked surface (the event log's user_id, a positive int64).")
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.INT64, owner=OWNER, tags=TAGS,
              description="A rankable item (the event log's item_id, a positive int64).")
ENTITIES = {"user_id": user, "item_id": item}


def _view(v) -> FeatureView:
    source = FileSource(name=f"{v.name}_source", path=f"{OFFLINE.rstrip('/')}/{v.name}",
                        timestamp_field="event_timestamp", owner=OWNER,
                        description=f"The refresh's offline `{v.name}` dataset, one folder per interval end.")
    return FeatureView(name=v.name, entities=[ENTITIES[k] for k in v.join_keys], ttl=v.ttl.to_pytimedelta(),
                       schema=[Field(name=k, dtype=Int64) for k in v.join_keys]
                       + [Field(name=c, dtype=DTYPES[kind]) for c, kind in v.features],
                       source=source, online=True, owner=OWNER,
                       description=f"{v.description} TTL {_duration(v.ttl)} ({v.ttl_var}).",
                       tags={**TAGS, "tier": v.tier, "ttl": _duration(v.ttl), "ttl_setting": v.ttl_var,
                             "model_version_policy": VERSION_POLICY})


def _duration(t) -> str:
    """4h, 24h, 90min, 7d: the TTL as an operator writes it (days from 2 days up)."""
    return duration(t, min_days=2)


_views = [_view(v) for v in views().values()]
pair_embeddings, pair_fallbacks, user_aggregates, user_states, neighbours = _views
solaris_service = FeatureService(
    name=FEATURE_SERVICE, features=_views, owner=OWNER,
    description="Everything the ranker reads from SOLARIS, all tiers: the serving client (FeatureReader) takes the "
                "pair embedding when fresh, else the pair's item-aware fallback, else the user aggregate, else the "
                "user state, else the neighbour embedding, else none.",
    tags={**TAGS, "tiers": " > ".join(TIERS),
          "ttls": ", ".join(f"{v.name} {_duration(v.ttl)}" for v in views().values()),
          "model_version_policy": VERSION_POLICY})

# Everything `feast apply` registers from this file, for the SDK's ``FeatureStore.apply``.
OBJECTS = [user, item, *_views, solaris_service]
