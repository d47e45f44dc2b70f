"""Where the online store is: read from the Feast repo's ``feature_store.yaml``, the same file the Feast SDK reads,
so that `feast apply`, our materializer, the serving client and a ranker using the Feast SDK agree.

The yaml is ``$FEAST_FS_YAML_FILE_PATH`` when set (Feast's own switch), else ``<repo>/feature_store.yaml``; the
repo is the one given, else ``settings.feature_repo()`` (the environment's, or this project's ``feature_repo/``). ``${VARS}`` in the file are expanded from
the environment, as Feast does. Supported online stores: ``sqlite`` (path relative to the repo) and ``redis``
(``redis_type`` redis or redis_cluster; ``connection_string`` as Feast parses it: ``host:port[,host:port],
password=...,ssl=true,db=0``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from solaris_jobs.core import settings

DEFAULT_REPO = settings.PROJECT_ROOT / "feature_repo"


@dataclass(frozen=True)
class StoreConfig:
    kind: str                                  # "sqlite" or "redis"
    project: str
    repo: Path
    yaml_path: Path
    sqlite_path: Path | None = None
    redis_type: str = "redis"                  # redis | redis_cluster
    nodes: tuple[tuple[str, int], ...] = ()
    # password, ssl, db, ... (redis-py keyword arguments); kept out of repr so that a logged config shows no secret
    redis_params: dict = field(default_factory=dict, repr=False)
    # How long a call to Redis may wait (connect, a reply) before it fails: Settings.store_timeout_seconds.
    timeout_s: float = 10.0

    def describe(self) -> str:
        if self.kind == "sqlite":
            return f"sqlite:{self.sqlite_path}"
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{self.redis_type}://{hosts}" + (" (tls)" if self.redis_params.get("ssl") else "")


def parse_connection_string(s: str) -> tuple[list[tuple[str, int]], dict]:
    """Feast's Redis connection string: ``host:port`` entries and ``key=value`` parameters (JSON-decoded)."""
    nodes, params = [], {}
    for part in (p.strip() for p in s.split(",")):
        if not part:
            continue
        if "=" in part:
            k, v = part.split("=", 1)
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                pass
            params[k] = v
        else:
            host, _, port = part.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"redis connection string {s!r}: {part!r} is not host:port")
            nodes.append((host, int(port)))
    if not nodes:
        raise ValueError(f"redis connection string {s!r} names no host:port")
    return nodes, params


def connection_string(host: str, port: int | None = None, password: str | None = None, db=None,
                      login: str | None = None, extras: dict | None = None) -> str:
    """Feast's Redis connection string from the parts of a connection (an Airflow connection's host, port,
    password, login, schema as the db number and extras such as ``ssl`` or ``ssl_ca_certs``).

    Raises:
        ValueError: a value holds a comma (Feast's format cannot carry it; the message does not show the value).
    """
    parts = [f"{host}:{int(port or 6379)}"]
    params = {"username": login, "password": password, "db": int(db) if db not in (None, "") else None,
              **(extras or {})}
    for k, v in params.items():
        if v is None or v == "":
            continue
        v = json.dumps(v) if isinstance(v, bool) else str(v)
        if "," in v or "," in k:
            raise ValueError(f"redis connection parameter {k!r} holds a ',', which Feast's connection string "
                             f"cannot carry")
        parts.append(f"{k}={v}")
    return ",".join(parts)


def use_airflow_connection(conn_id: str | None) -> bool:
    """Sets the Redis connection variable (``settings.REDIS_ENV``, what ``feature_store.redis*.yaml`` expands) from
    the Airflow connection ``conn_id`` (None: nothing to do). Airflow's secrets masker hides the password in task logs once it has been read.

    Returns:
        Whether a connection was applied.
    """
    if not conn_id:
        return False
    from airflow.sdk import Connection
    c = Connection.get(conn_id)
    os.environ[settings.REDIS_ENV] = connection_string(c.host, c.port, c.password, c.schema, c.login,
                                                       c.extra_dejson)
    return True


class StoreUnavailable(RuntimeError):
    """The online store did not answer (hung, down, unreachable): the message names it and what to check."""


def check(cfg: StoreConfig) -> None:
    """Fails fast when a Redis online store does not answer a PING within ``cfg.timeout_s`` (every node of a
    cluster's startup list): what an operator command runs before it touches the store, so that a hung or
    unreachable store gives one line instead of a traceback after minutes. SQLite: nothing to check.

    Raises:
        StoreUnavailable: the store, the failure, and what to check.
    """
    if cfg.kind != "redis":
        return
    import redis
    for host, port in cfg.nodes:
        client = redis_client(node_config(cfg, host, port))
        try:
            client.ping()
        except redis.RedisError as e:
            raise StoreUnavailable(unavailable_message(cfg, e, f"{host}:{port}")) from e
        finally:
            client.close()


def unavailable_message(cfg: StoreConfig | None, e: BaseException, node: str | None = None) -> str:
    """One line: which store failed how, and what to check."""
    what = "did not answer" if "imeout" in type(e).__name__ or "imeout" in str(e) else "could not be reached"
    store = f"the online store {cfg.describe()}" if cfg is not None else "the online store"
    named = f" (named by {cfg.yaml_path})" if cfg is not None else ""
    waited = f" within {cfg.timeout_s:g} s" if cfg is not None and what == "did not answer" else ""
    return (f"{store}{f' node {node}' if node and len(cfg.nodes) > 1 else ''} {what}{waited}: "
            f"{type(e).__name__}: {str(e).rstrip('.')}. Check that Redis is running, not paused, and reachable from this host"
            f"{named}; {settings.env_var('store_timeout_seconds')} sets how long a call may wait")


def of_settings(s: "settings.Settings") -> StoreConfig:
    """The online store the settings' Feast repo names, with the settings' store timeout."""
    return load(s.feature_repo, timeout_s=s.store_timeout_seconds)


def for_airflow_task(s: "settings.Settings", conn_id: str | None) -> StoreConfig:
    """What an Airflow task runs before it touches the online store: the Redis connection variable from the Airflow connection
    ``conn_id`` (when one is configured), and the store refused if it is SQLite under an executor of several hosts
    (``check_shared``)."""
    use_airflow_connection(conn_id)
    cfg = of_settings(s)
    check_shared(cfg)
    return cfg


# Airflow executors whose tasks all run on the scheduler's host: an SQLite online store (and its lease) is shared.
SINGLE_HOST_EXECUTORS = {"LocalExecutor", "SequentialExecutor", "DebugExecutor"}


def check_shared(cfg: StoreConfig, executor: str | None = None) -> None:
    """Refuses an SQLite online store under an Airflow executor that runs tasks on several hosts (Celery,
    Kubernetes, ...): each host would write its own file, so features and the interval leases (kept in the same
    store) would not meet. ``executor``: Airflow's ``[core] executor`` (a list, aliases and module paths allowed;
    None: read from Airflow's configuration).

    Raises:
        ValueError: naming the store, the executor and the settings to change.
    """
    if cfg.kind != "sqlite":
        return
    if executor is None:
        from airflow.configuration import conf
        executor = conf.get("core", "executor", fallback="") or ""
    names = [p.split(":")[-1].rsplit(".", 1)[-1].strip() for p in executor.split(",") if p.strip()]
    shared = [n for n in names if n not in SINGLE_HOST_EXECUTORS]
    if shared:
        raise ValueError(f"the SQLite online store {cfg.sqlite_path} (named by {cfg.yaml_path}) lives on one host, but "
                         f"Airflow's {', '.join(shared)} runs tasks on several: their features and interval leases "
                         f"would not meet. Point every worker at one Redis: FEAST_FS_YAML_FILE_PATH="
                         f"feature_store.redis.yaml (or feature_store.redis_cluster.yaml) and {settings.REDIS_ENV} "
                         f"(or {settings.REDIS_CONN_ENV})")


def load(repo: str | os.PathLike | None = None, yaml_path: str | os.PathLike | None = None,
         timeout_s: float | None = None) -> StoreConfig:
    """The online store the Feast repo's yaml names; ``timeout_s``: how long a call to Redis may wait (None: the
    environment's ``store_timeout_seconds`` setting, 10 s by default)."""
    import yaml
    if timeout_s is None:
        timeout_s = settings.Settings.from_env(require=False).store_timeout_seconds
    repo = settings.feature_repo(repo)
    if yaml_path is None:
        yaml_path = os.environ.get("FEAST_FS_YAML_FILE_PATH") or repo / "feature_store.yaml"
    yaml_path = Path(yaml_path)
    if not yaml_path.is_absolute() and not yaml_path.exists():
        yaml_path = repo / yaml_path
    if not yaml_path.exists():
        raise FileNotFoundError(f"{yaml_path}: no feature_store.yaml (set {settings.env_var('feature_repo')} or "
                                f"FEAST_FS_YAML_FILE_PATH)")
    text = os.path.expandvars(yaml_path.read_text())
    raw = yaml.safe_load(text) or {}
    project = raw.get("project")
    if not project:
        raise ValueError(f"{yaml_path}: no project")
    if int(raw.get("entity_key_serialization_version", 3)) != 3:
        raise ValueError(f"{yaml_path}: entity_key_serialization_version must be 3 (the only one Feast 0.67 writes)")
    online = raw.get("online_store") or {"type": "sqlite"}
    if isinstance(online, str):
        online = {"type": online}
    kind = online.get("type", "sqlite")
    if kind == "sqlite":
        p = Path(online.get("path", "data/online.db"))
        return StoreConfig("sqlite", project, repo, yaml_path, sqlite_path=p if p.is_absolute() else repo / p,
                           timeout_s=timeout_s)
    if kind == "redis":
        rtype = online.get("redis_type", "redis")
        if rtype not in ("redis", "redis_cluster"):
            raise ValueError(f"{yaml_path}: redis_type {rtype!r} is not supported (redis or redis_cluster)")
        cs = str(online.get("connection_string", "localhost:6379"))
        if "${" in cs:
            raise ValueError(f"{yaml_path}: connection_string {cs!r} has an unset environment variable")
        nodes, params = parse_connection_string(cs)
        return StoreConfig("redis", project, repo, yaml_path, redis_type=rtype, nodes=tuple(nodes),
                           redis_params=params, timeout_s=timeout_s)
    raise ValueError(f"{yaml_path}: online store type {kind!r} is not supported (sqlite or redis)")


def node_config(cfg: StoreConfig, host: str, port: int) -> StoreConfig:
    """The store config of one node of ``cfg`` (a cluster's primary, or a startup node): its parameters, one node."""
    import dataclasses
    return dataclasses.replace(cfg, redis_type="redis", nodes=((host, int(port)),))


def cluster_primaries(cluster, cfg: StoreConfig, timeout_s: float | None = None):
    """The primaries of a Redis Cluster as the cluster client ``cluster`` maps them now: (their ``host:port`` names,
    a client of each, ``cfg``'s parameters and ``timeout_s``; the primary of each of the 16384 slots as an index
    into them). What the raw cluster writer and the serving reader pipeline on, one connection per primary."""
    import numpy as np
    slots = cluster.nodes_manager.slots_cache
    index, of_slot = {}, np.zeros(16384, np.int64)
    for slot in range(16384):
        of_slot[slot] = index.setdefault(slots[slot][0].name, len(index))
    names = list(index)
    return names, [redis_client(node_config(cfg, *n.rsplit(":", 1)), timeout_s) for n in names], of_slot


def redis_client(cfg: StoreConfig, timeout_s: float | None = None, **overrides):
    """A redis-py client for the configured Redis (standalone or cluster); ``timeout_s``: how long a call may wait
    (None: the store's ``timeout_s``)."""
    import redis
    timeout_s = cfg.timeout_s if timeout_s is None else timeout_s
    params = {k: v for k, v in cfg.redis_params.items() if k not in ("skip_full_coverage_check",)}
    params.update(socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **overrides)
    if "retry" not in overrides:
        # No silent reconnect-and-retry loops (redis-py's default backs off for seconds): callers decide.
        from redis.backoff import NoBackoff
        from redis.retry import Retry
        params["retry"] = Retry(NoBackoff(), 0)
    if cfg.redis_type == "redis_cluster":
        from redis.cluster import ClusterNode, RedisCluster
        params.pop("db", None)
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cfg.nodes], **params)
    host, port = cfg.nodes[0]
    return redis.Redis(host=host, port=port, **params)
