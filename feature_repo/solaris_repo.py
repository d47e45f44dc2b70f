"""SOLARIS feature definitions for Feast: entities ``user`` and ``item``, one feature view per serving tier
(pair embeddings, user aggregates, neighbours) over the pipeline's offline outputs, and the versioned
FeatureService ``solaris_v1``.

Names, fields and TTLs come from ``solaris_jobs.online.views`` (shared with the materializer and the serving
client). Sources read ``<offline>/<view>/`` (``solaris_jobs.core.settings.feast_offline_root()``: the configured
offline store, else the demo's).
"""
from feast import Entity, FeatureService, FeatureView, Field, FileSource, ValueType
from feast.types import Array, Float32, Int32, Int64, String

from solaris_jobs.core.settings import feast_offline_root
from solaris_jobs.online.views import FEATURE_SERVICE, views

OFFLINE = feast_offline_root()
DTYPES = {"float_list": Array(Float32), "string": String, "int32": Int32, "int64_list": Array(Int64)}

user = Entity(name="user", join_keys=["user_id"], value_type=ValueType.INT64, description="A user id.")
item = Entity(name="item", join_keys=["item_id"], value_type=ValueType.INT64, description="An item id.")
ENTITIES = {"user_id": user, "item_id": item}


def _view(v) -> FeatureView:
    source = FileSource(name=f"{v.name}_source", path=f"{OFFLINE.rstrip('/')}/{v.name}",
                        timestamp_field="event_timestamp")
    return FeatureView(name=v.name, entities=[ENTITIES[k] for k in v.join_keys], ttl=v.ttl.to_pytimedelta(),
                       schema=[Field(name=k, dtype=Int64) for k in v.join_keys]
                       + [Field(name=c, dtype=DTYPES[kind]) for c, kind in v.features],
                       source=source, online=True, description=v.description, tags={"tier": v.tier})


_views = [_view(v) for v in views().values()]
pair_embeddings, user_aggregates, neighbours = _views
solaris_service = FeatureService(name=FEATURE_SERVICE, features=_views,
                                 description="Everything the ranker reads from SOLARIS, all tiers.")
