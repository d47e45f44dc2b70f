"""Every run-time setting of SOLARIS in one place: the refresh's ``Settings`` (where the data, offline store and
models are, the Spark, store and precompute knobs), the training settings, the feature views' TTLs and the
download cache; the ``SOLARIS_*`` environment variables they are read from, with their defaults; and the command
line flags that override them.

One object travels whole: the Airflow tasks build it from the worker's environment (``Settings.from_env``), the
``SparkSubmitOperator`` passes it to ``spark_jobs/*.py`` as JSON (``--settings``), the CLI builds it from the
environment, ``--settings`` and its flags, and a replay builds it in code. This module is the only one that
names a run-time ``SOLARIS_*`` variable (the DAG files name their own scheduling settings: cron, dates, retries,
the Spark connection, the FM queue and pool; ``DAG_ENV`` lists them for the docs and the demo). It imports only
the standard library and pydantic, so that a DAG file or a ranker can import it cheaply.

Validation: unknown keys, wrong types and out-of-range values are errors that name the setting (and the
environment variable it came from).
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, field_validator
from pydantic.dataclasses import dataclass

PROJECT_ROOT = Path(__file__).resolve().parents[2]          # the checkout: solaris_jobs/core/settings.py
_STRICT = ConfigDict(extra="forbid")

# ------------------------------------------------------------------------------------------------ precompute


@dataclass(frozen=True, config=_STRICT)
class SimulatorConfig:
    """The request simulator's candidate-set sizes and windows (``solaris_jobs.data.requests``)."""
    n_candidates: int = Field(20, ge=1)
    n_popular: int = Field(10, ge=0)
    popularity_hours: float = Field(168.0, gt=0)
    history_items: int = Field(10, ge=1)
    covisit_window: int = Field(3, ge=1)
    covisit_top: int = Field(50, ge=1)

    def __post_init__(self):
        if self.n_popular > self.n_candidates:
            raise ValueError(f"simulator: n_popular ({self.n_popular}) is more than n_candidates "
                             f"({self.n_candidates})")

    def with_candidates(self, n: int) -> "SimulatorConfig":
        """``n`` candidates per user, half of them popular (what ``--candidates N`` means everywhere)."""
        return replace(self, n_candidates=n, n_popular=n // 2)


@dataclass(frozen=True, config=_STRICT)
class PrecomputeConfig:
    """Settings of one refresh (``SOLARIS_PRECOMPUTE`` JSON and the job flags map onto these fields).

    The defaults are the configuration the replay evaluation measured (its headline settings,
    ``solaris_jobs.evaluation.config``; ``tests/test_settings.py`` fails when the two drift apart): one FM budget
    of 0.5 inferences per served row over one pool (pairs ranked in the last 24 h, 20 request-simulator candidates
    per active user, misses), ranked by recency then the verifier, negative exclusion off. The paper's per-user
    top share of the verifier's ranking stays as a named option: ``PrecomputeConfig.per_user_share()`` (the
    refresh's earlier defaults; ``--budget-per-row 0`` drops the budget alone).

    Attributes:
        simulator: candidate-set sizes and windows of the request simulator.
        active_hours: users with an event in ``[T - active_hours, T)`` are expected to be served soon.
        lookback_days: history, counters and co-visitation read events in ``[T - lookback_days, T)``
            (None: the whole log before T).
        select_share: share of scored pairs sent to the FM (without ``budget_per_row``).
        select_scope: ``user`` (top share of each user's candidates, at least one) or ``global`` (top share of
            all pairs by verifier score).
        recent_hours: pairs ranked for a user in ``[T - recent_hours, T)`` join the candidate pool (a user's
            rankings stay stable over short periods); 0: off.
        budget_per_row: one FM budget for the whole pool, misses included: ``ceil(budget_per_row x`` the rows the
            log served per interval over the last ``budget_window_hours``) pairs, the top of one global ranking
            (``select_priority``). None: the per-share selection above, misses forced in on top.
        select_priority: the global ranking under a budget: ``verifier`` (the VM's score) or ``recency`` (the
            time the pair was last ranked or missed, most recent first, then the verifier's score; pairs never
            ranked come last).
        exclusion_runs: K; a pair in the bottom ``exclusion_share`` of its user's candidates in each of the last
            K runs is skipped before scoring (0 disables).
        miss_hours: serving misses recorded in ``[T - miss_hours, T)`` are forced into the selection.
        history_len: FM history length L; None: the FM's own (a different value is an error).
        batch_size: rows per model batch on executors.
        user_batch_size: users per batch of the FM user embedding (the neighbours step: the history encoder alone,
            whose intermediates outgrow the CPU's caches in large batches: ``benchmarks/fm_inference.py
            --user-embedding`` measured 5.2K users/s per thread at 128 against 3.3K at 1024, identical vectors).
        device: torch device for the models (``auto``: CUDA when present). On a Spark executor with GPUs assigned
            to its tasks (``spark.task.resource.gpu.amount``), ``auto`` and ``cuda`` take the task's own GPU
            (``model_refs.task_device``).
        gpu_batch_size, gpu_user_batch_size: ``batch_size`` and ``user_batch_size`` on a GPU (a GPU wants far
            larger batches than a CPU core).
        aggregate_hours: window of the user aggregate (and of the pairs behind an item-aware fallback).
        item_aware_temperature: the item-aware fallback of a pair (u, j) ranked, missed or left out by the
            selection lately without a pair embedding weighs u's embedded pairs (u, i) by softmax(cos(item j,
            item i) / this) over the FM's item embeddings; 0.1 (fixed before any run: a cosine 0.1 lower weighs e
            times less, so the most similar few items dominate).
        knn_k: neighbours per user; knn_exact_max: above this many users, HNSW replaces exact search, with
            ``knn_hnsw_m`` links per node and ``knn_ef_search`` (``benchmarks/knn_scale.py`` measured the choice).
        knn_requery: ``all``: every user with history is embedded and queried each interval; ``active``: only
            the users with an event since the previous interval (the others keep their vector and neighbour list),
            against the index built at the last full interval; a full interval comes every
            ``knn_rebuild_hours`` (everyone re-embedded, the index rebuilt), or when the previous state cannot be
            used (none, another model version or KNN settings).
        state_rebuild_hours: ``select`` updates the interval's state (every user's history, the user and item
            counters) from the previous interval's instead of rebuilding it from the lookback, when that state ends
            at this interval's start, was made with the same history length, lookback and event source, the log's
            files of the hours it covers are unchanged since (a late event in an old hour, a rewritten file: a full
            rebuild), and its last full rebuild is less than this many hours old; 0: a full rebuild every interval.
        state_keep_hours: once it has published the interval's state, ``select`` removes the state of intervals
            that end more than this many hours before it (``solaris_jobs.pipeline.retention``): only the next
            interval reads it, and a rerun of an interval whose previous state is gone rebuilds it from the log.
        torch_threads: torch threads per Spark task.
        label_delay_minutes: an event's label (click, rating) reaches the log this long after the event; its
            impression at once. The refresh at T uses the labels of events before ``T - label_delay_minutes`` only
            (histories and counters); training sets and the evaluation's inputs follow the same rule.
    """
    simulator: SimulatorConfig = Field(default_factory=SimulatorConfig)
    active_hours: float = Field(24.0, gt=0)
    lookback_days: float | None = Field(30.0, gt=0)
    select_share: float = Field(0.2, gt=0, le=1)
    select_scope: Literal["user", "global"] = "user"
    recent_hours: float = Field(24.0, ge=0)
    budget_per_row: float | None = Field(0.5, gt=0)
    budget_window_hours: float = Field(24.0, gt=0)
    select_priority: Literal["verifier", "recency"] = "recency"
    exclusion_runs: int = Field(0, ge=0)
    exclusion_share: float = Field(0.5, ge=0, le=1)
    miss_hours: float = Field(24.0, ge=0)
    history_len: int | None = Field(None, ge=1)
    batch_size: int = Field(1024, ge=1)
    user_batch_size: int = Field(128, ge=1)
    device: str = "auto"
    gpu_batch_size: int = Field(16384, ge=1)
    gpu_user_batch_size: int = Field(4096, ge=1)
    aggregate_hours: float = Field(24.0, gt=0)
    item_aware_temperature: float = Field(0.1, gt=0)
    knn_k: int = Field(10, ge=1)
    knn_exact_max: int = Field(100_000, ge=0)
    knn_hnsw_m: int = Field(32, ge=4)
    knn_ef_search: int = Field(128, ge=1)
    knn_requery: Literal["all", "active"] = "all"
    knn_rebuild_hours: float = Field(24.0, gt=0)
    state_rebuild_hours: float = Field(24.0, ge=0)
    state_keep_hours: float = Field(6.0, ge=0)
    torch_threads: int = Field(1, ge=1)
    label_delay_minutes: float = Field(30.0, ge=0)

    def batch_on(self, device, users: bool = False) -> int:
        """Rows (``users``: users) per model batch on ``device`` (a torch device: a GPU takes the GPU sizes)."""
        gpu = getattr(device, "type", str(device)).startswith("cuda")
        return (self.gpu_user_batch_size if gpu else self.user_batch_size) if users else (
            self.gpu_batch_size if gpu else self.batch_size)

    @classmethod
    def per_user_share(cls, **kw) -> "PrecomputeConfig":
        """The per-user top share (the paper's selection, and the refresh's default before it took the evaluated
        configuration): no budget, the verifier's top ``select_share`` (20%) of each user's 200 request-simulator
        candidates with the misses forced in on top, no recently ranked pairs in the pool, negative exclusion over
        the last 3 runs. Its quality was not measured by the replay evaluation. ``kw``: other fields."""
        return cls(**{"budget_per_row": None, "recent_hours": 0.0, "select_priority": "verifier", "exclusion_runs": 3,
                      "simulator": SimulatorConfig(n_candidates=200, n_popular=100), **kw})


def _describe(cls, descriptions: dict[str, str]) -> None:
    """Sets the description of ``cls``'s fields (what ``describe`` and the CLI's help read)."""
    fields = cls.__pydantic_fields__
    for name, text in descriptions.items():
        fields[name].description = text


# The precompute fields' descriptions, the CLI's help (beside the class: its field lines hold only type, default and
# bounds).
_describe(SimulatorConfig, {"n_candidates": "Request-simulator candidates per user"})
_describe(PrecomputeConfig, {
    "select_share": "Share of scored pairs sent to the FM.",
    "select_scope": "user: top share of each user's candidates; global: top share of all pairs.",
    "recent_hours": "Pairs ranked for the user in the last this many hours join the candidate pool (0: off).",
    "budget_per_row": "One FM budget for the pool, misses included: this many FM inferences per row the log served "
                      "per interval (0: none, the verifier's top --select-share of each user's candidates).",
    "select_priority": "The global ranking under a budget: verifier score, or recency of the pair's last ranking "
                       "then verifier.",
    "exclusion_runs": "K: skip pairs in their user's bottom share in each of the last K runs (0: off).",
    "exclusion_share": "The bottom share for negative exclusion.",
    "active_hours": "Users with an event in the last this many hours before T are expected soon.",
    "lookback_days": "History, counters and co-visitation read this many days before T",
    "batch_size": "Rows per model batch on executors.",
    "user_batch_size": "Users per batch of the FM user embedding (neighbours).",
    "history_len": "FM history length (default: the FM's; must match it).",
    "knn_k": "Neighbours per user.",
    "knn_exact_max": "Exact FAISS search up to this many users, HNSW above (recall measured and logged).",
    "knn_requery": "all: embed and query every user each interval; active: only users with new events, against the "
                   "last full interval's index.",
    "knn_rebuild_hours": "With --knn-requery active: a full interval (everyone, new index) this often.",
    "state_rebuild_hours": "The interval's state (histories, counters) is updated from the previous interval's, and "
                           "rebuilt from the lookback this often (0: every interval).",
    "state_keep_hours": "Select removes the state of intervals that end more than this many hours before its own (a "
                        "rerun of one rebuilds it from the log).",
    "aggregate_hours": "Window of the user aggregate.",
    "item_aware_temperature": "The item-aware fallback weighs the user's embedded pairs by softmax(item cosine "
                              "similarity / this).",
    "miss_hours": "Serving misses recorded this many hours before T are forced into the selection.",
    "device": "Torch device for the models (auto: CUDA when present; a Spark task's own GPU where Spark assigns "
              "GPUs).",
    "gpu_batch_size": "Rows per model batch on a GPU.",
    "gpu_user_batch_size": "Users per batch of the FM user embedding on a GPU.",
})

# ------------------------------------------------------------------------------------------------ spark-submit

SPARK_STEPS = ("select", "embed", "aggregate", "neighbours")
SparkStep = Literal["select", "embed", "aggregate", "neighbours"]


@dataclass(frozen=True, config=_STRICT)
class SparkSubmitStep:
    """One Spark step's own spark-submit settings, on top of the shared ones (``conf`` and ``env_vars`` per key,
    ``py_files`` and ``archives`` appended): e.g. GPU resources for ``embed`` only."""
    conf: dict[str, str] = Field(default_factory=dict)
    py_files: tuple[str, ...] = ()
    archives: tuple[str, ...] = ()
    env_vars: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True, config=_STRICT)
class SparkSubmitConfig:
    """How the refresh DAG submits its four Spark steps when ``SOLARIS_SPARK_CONN_ID`` is set (``SOLARIS_SPARK_SUBMIT``
    JSON): Spark settings, a packed Python environment (``archives``, e.g. ``env.tar.gz#env`` with
    ``spark.pyspark.python=./env/bin/python``) or ``py_files``, environment variables, and the deploy mode, shared
    by the four steps and per step (``steps``).

    ``deploy_mode``: ``client`` (the driver runs on the Airflow worker, which must reach the cluster and the online
    store) or ``cluster`` (the driver runs on the cluster: YARN or Kubernetes; Spark's standalone master runs Python
    drivers in client mode only, refused when the task starts); unset, the Airflow connection's ``deploy-mode``
    extra decides (client without one). In cluster mode the driver cannot read the Airflow
    worker's files: ``application_root`` is where the cluster's nodes find ``spark_jobs/`` (``local:///opt/solaris/
    spark_jobs``, ``s3a://bucket/solaris/spark_jobs``), and the driver needs the online store's connection (it
    takes the interval's lease) through the cluster's own secrets, not ``env_vars``.
    """
    conf: dict[str, str] = Field(default_factory=dict)
    py_files: tuple[str, ...] = ()
    archives: tuple[str, ...] = ()
    env_vars: dict[str, str] = Field(default_factory=dict)
    deploy_mode: Literal["client", "cluster"] | None = None
    application_root: str | None = None
    steps: dict[SparkStep, SparkSubmitStep] = Field(default_factory=dict)

    def __post_init__(self):
        if self.deploy_mode == "cluster" and not self.application_root:
            raise ValueError("deploy_mode cluster runs the driver on the cluster, which cannot read this worker's "
                             "spark_jobs/: set application_root to where the cluster's nodes find it (e.g. "
                             "local:///opt/solaris/spark_jobs or s3a://bucket/solaris/spark_jobs)")

    def operator_args(self, step: str, script: str, local_root: str) -> dict:
        """``SparkSubmitOperator`` arguments of ``step`` (its script ``script``; ``local_root``: this checkout's
        ``spark_jobs/``, the application in client mode without an ``application_root``)."""
        own = self.steps.get(step, SparkSubmitStep())
        root = (self.application_root or local_root).rstrip("/")
        joined = lambda a, b: ",".join((*a, *b)) or None       # noqa: E731
        return {"application": f"{root}/{script}", "conf": {**self.conf, **own.conf} or None,
                "py_files": joined(self.py_files, own.py_files), "archives": joined(self.archives, own.archives),
                "env_vars": {**self.env_vars, **own.env_vars} or None,
                **({"deploy_mode": self.deploy_mode} if self.deploy_mode else {})}

    def check_master(self, master: str, connection_mode: str | None = None) -> None:
        """Raises ValueError for a deploy mode (this one, else the connection's ``connection_mode``) that the master
        cannot run a Python driver in, or cluster mode without ``application_root``."""
        mode = self.deploy_mode or connection_mode or "client"
        if mode != "cluster":
            return
        if master.startswith("spark://"):
            raise ValueError(f"deploy mode cluster: Spark's standalone master ({master}) runs Python applications in "
                             f"client mode only; set SOLARIS_SPARK_SUBMIT deploy_mode client (or the Spark "
                             f"connection's deploy-mode), or use a YARN or Kubernetes master for cluster mode")
        if not self.application_root:
            raise ValueError("deploy mode cluster (the Spark connection's deploy-mode) runs the driver on the cluster, "
                             "which cannot read this worker's spark_jobs/: set SOLARIS_SPARK_SUBMIT application_root")


# ------------------------------------------------------------------------------------------------ refresh


@dataclass(frozen=True, config=_STRICT)
class Settings:
    """Everything a refresh step needs besides its interval (and, for replays, an injected clock, event source
    and models; see ``solaris_jobs.pipeline.jobs``).

    Attributes:
        data: data root with the event log (``<data>/events/date=.../hour=.../*.parquet``).
        offline: offline store root (any URI the jobs take: a path, ``file://``, ``s3a://``, ``hdfs://``).
        models: folder with fm.pt, ae.pt, vm.pt (e.g. ``<registry>/current``); resolved once per run.
        feature_repo: the Feast repo whose ``feature_store.yaml`` names the online store (None: this project's
            ``feature_repo/``; Feast's own ``FEAST_FS_YAML_FILE_PATH`` picks another yaml).
        expire_from: ``event``: online keys expire at event time + view TTL; ``write``: at write time + TTL.
        max_bad_share: share of an interval's events that may break the contract before ``validate`` fails it.
        precompute: the refresh's knobs.
        spark_master: Spark master for in-process steps (None: spark-submit's, else ``local[*]``;
            ``sc://host:port`` for Spark Connect).
        spark_driver_memory: driver heap of a local Spark (also the executors' in local mode).
        spark_log_level: Spark's log level.
        log_level: SOLARIS's log level in job processes (spark-submit drivers).
        lease_minutes: how long a run's lease of its interval lasts unless a step renews it
            (``solaris_jobs.online.lease``); as long as a DAG run may last (its 6 h ``dagrun_timeout``).
        spark_submit: how the refresh DAG's spark-submit runs the Spark steps (``SparkSubmitConfig``).
        fm_factory: ``package.module:factory`` when ``models``' fm.pt is a user's own FM (``factory(path,
            map_location)`` builds it, keeping ``models.protocol``; importable on the driver and every executor);
            None: a SOLARIS checkpoint (either family).
        store_timeout_seconds: how long the refresh's and the operator commands' calls to a Redis online store
            (connect, a reply, a write's reply) may wait before the command fails with a message naming the store
            (the serving reader has its own ``budget_ms``).
    """
    data: str = Field("", description="Data root with the event log.")
    offline: str = Field("", description="Offline store root (outputs keyed by interval end; any URI the jobs "
                                         "take).")
    models: str = Field("", description="Folder with fm.pt, ae.pt, vm.pt (resolved once per run).")
    feature_repo: str | None = Field(None, description="Feast repo (its feature_store.yaml, or "
                                                       "$FEAST_FS_YAML_FILE_PATH, names the online store).")
    expire_from: Literal["event", "write"] = Field("event", description="event: online keys expire at event time + "
                                                   "view TTL; write: at write time + TTL (replays of old data).")
    max_bad_share: float = Field(0.05, ge=0, le=1)
    precompute: PrecomputeConfig = Field(default_factory=PrecomputeConfig)
    spark_master: str | None = Field(None, description="Spark master (default: spark-submit's, or local[*]; "
                                                       "sc://host:port for Spark Connect).")
    spark_driver_memory: str = "4g"
    spark_log_level: str = "WARN"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    lease_minutes: float = Field(360.0, gt=0)
    store_timeout_seconds: float = Field(10.0, gt=0, le=3600)
    spark_submit: SparkSubmitConfig = Field(default_factory=SparkSubmitConfig)
    fm_factory: str | None = Field(None, pattern=r"^[\w.]+:\w+$")

    @field_validator("log_level", "spark_log_level", mode="before")
    @classmethod
    def _upper(cls, v):
        return v.upper() if isinstance(v, str) else v

    @field_validator("data", "offline", "models")
    @classmethod
    def _absolute(cls, v: str) -> str:
        """Local paths made absolute once, here: Spark, pyarrow and a spark-submit driver elsewhere then agree."""
        return os.path.abspath(v) if v and "://" not in v and not v.startswith("file:") else v

    @classmethod
    def from_env(cls, env=None, require: bool = True, **overrides) -> "Settings":
        """Settings from ``SOLARIS_*`` variables (``ENV``), then ``overrides`` (field names; ``precompute`` may be
        a dict of its fields).

        Raises:
            ValueError: a variable does not parse or validate (named), or, with ``require``, the data, offline or
                models location is not set.
        """
        env = os.environ if env is None else env
        raw: dict[str, Any] = {}
        for var, name in ENV.items():
            value = env.get(var)
            if value is None or value == "":
                continue
            if name in JSON_FIELDS:
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{var} is not JSON: {e}") from e
            raw[name] = value
        base = _validate(raw, {name: var for var, name in ENV.items()})
        s = base.override(**overrides) if overrides else base
        if require:
            s.require()
        return s

    @classmethod
    def from_json(cls, text: str) -> "Settings":
        """The whole object from ``to_json()`` output (what ``--settings`` carries)."""
        try:
            return _ADAPTER.validate_json(text)
        except ValidationError as e:
            raise ValueError(f"--settings: {_explain(e)}") from e

    def to_json(self) -> str:
        return _ADAPTER.dump_json(self).decode()

    def to_dict(self) -> dict:
        return asdict(self)

    def to_env(self) -> dict[str, str]:
        """The ``SOLARIS_*`` variables that ``from_env`` turns back into these settings (unset ones omitted)."""
        out = {}
        for var, name in ENV.items():
            value = getattr(self, name)
            if value is None:
                continue
            out[var] = json.dumps(asdict(value)) if name in JSON_FIELDS else str(value)
        return out

    def override(self, **changes) -> "Settings":
        """A copy with fields replaced; ``precompute`` may be a dict of changes to the current precompute (and its
        ``simulator`` a dict of changes too). Validated."""
        changes = dict(changes)
        pc = changes.get("precompute")
        if isinstance(pc, dict):
            pc = dict(pc)
            sim = pc.get("simulator")
            if isinstance(sim, dict):
                pc["simulator"] = asdict(self.precompute.simulator) | sim
            changes["precompute"] = asdict(self.precompute) | pc
        return _validate(asdict(self) | changes, {})

    def require(self) -> "Settings":
        missing = [f"{_VAR[n]} (--{n})" for n in ("data", "offline", "models") if not getattr(self, n)]
        if missing:
            raise ValueError(f"set {', '.join(missing)}: where the event log, the offline store and the models are")
        return self

    def for_spark_submit(self) -> "Settings":
        """What a spark-submit driver gets: the master is spark-submit's own (``--master`` / the connection)."""
        return replace(self, spark_master=None)


ENV = {  # variable -> Settings field
    "SOLARIS_DATA": "data",
    "SOLARIS_OFFLINE": "offline",
    "SOLARIS_MODELS": "models",
    "SOLARIS_FEATURE_REPO": "feature_repo",
    "SOLARIS_EXPIRE_FROM": "expire_from",
    "SOLARIS_MAX_BAD_SHARE": "max_bad_share",
    "SOLARIS_PRECOMPUTE": "precompute",
    "SOLARIS_SPARK_MASTER": "spark_master",
    "SOLARIS_SPARK_DRIVER_MEMORY": "spark_driver_memory",
    "SOLARIS_SPARK_LOG_LEVEL": "spark_log_level",
    "SOLARIS_LOG_LEVEL": "log_level",
    "SOLARIS_LEASE_MINUTES": "lease_minutes",
    "SOLARIS_STORE_TIMEOUT_SECONDS": "store_timeout_seconds",
    "SOLARIS_SPARK_SUBMIT": "spark_submit",
    "SOLARIS_FM_FACTORY": "fm_factory",
}
JSON_FIELDS = ("precompute", "spark_submit")         # given as JSON in their variables
_VAR = {name: var for var, name in ENV.items()}
_ADAPTER = TypeAdapter(Settings)


def _explain(e: ValidationError, names: dict | None = None) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        var = (names or {}).get(str(err["loc"][0])) if err["loc"] else None
        where = f"{var} ({loc})" if var else loc
        parts.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(parts)


def _validate(raw: dict, names: dict) -> Settings:
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as e:
        raise ValueError(f"settings: {_explain(e, names)}") from e


# ------------------------------------------------------------------------------------------------ flags

@dataclass(frozen=True)
class Flag:
    """A command-line flag of the job commands (``solaris select|...|refresh|backfill`` and ``spark_jobs/*.py``):
    ``field`` is a Settings field or ``precompute.<field>``; ``candidates`` sets the simulator's size. Its help is
    the field's description (``describe``) and ``note``, what the flag's value means beyond the field's."""
    flag: str
    field: str
    type: str = "str"                       # str | int | float | choice
    choices: tuple[str, ...] = ()
    note: str = ""

    @property
    def help(self) -> str:
        return describe(self.field) + self.note


FLAGS = (
    Flag("--data", "data"),
    Flag("--offline", "offline"),
    Flag("--models", "models"),
    Flag("--feature-repo", "feature_repo"),
    Flag("--expire-from", "expire_from", "choice", ("event", "write")),
    Flag("--master", "spark_master"),
    Flag("--select-share", "precompute.select_share", "float"),
    Flag("--select-scope", "precompute.select_scope", "choice", ("user", "global")),
    Flag("--recent-hours", "precompute.recent_hours", "float"),
    Flag("--budget-per-row", "precompute.budget_per_row", "float"),
    Flag("--select-priority", "precompute.select_priority", "choice", ("verifier", "recency")),
    Flag("--exclusion-runs", "precompute.exclusion_runs", "int"),
    Flag("--exclusion-share", "precompute.exclusion_share", "float"),
    Flag("--active-hours", "precompute.active_hours", "float"),
    Flag("--lookback-days", "precompute.lookback_days", "float", note=" (0: all)."),
    Flag("--candidates", "precompute.simulator.n_candidates", "int", note=" (half of them popular)."),
    Flag("--batch-size", "precompute.batch_size", "int"),
    Flag("--user-batch-size", "precompute.user_batch_size", "int"),
    Flag("--history-len", "precompute.history_len", "int"),
    Flag("--knn-k", "precompute.knn_k", "int"),
    Flag("--knn-exact-max", "precompute.knn_exact_max", "int"),
    Flag("--knn-requery", "precompute.knn_requery", "choice", ("all", "active")),
    Flag("--knn-rebuild-hours", "precompute.knn_rebuild_hours", "float"),
    Flag("--state-rebuild-hours", "precompute.state_rebuild_hours", "float"),
    Flag("--state-keep-hours", "precompute.state_keep_hours", "float"),
    Flag("--aggregate-hours", "precompute.aggregate_hours", "float"),
    Flag("--item-aware-temperature", "precompute.item_aware_temperature", "float"),
    Flag("--miss-hours", "precompute.miss_hours", "float"),
    Flag("--device", "precompute.device", "str"),
)


def describe(field: str, cls=None) -> str:
    """The description of a Settings field path (``precompute.select_share``), or of a field of ``cls`` (e.g.
    ``TrainSettings``): what the CLI's help says of it.

    Raises:
        KeyError: the field has no description.
    """
    *path, name = field.split(".")
    cls = cls or Settings
    for part in path:
        cls = type(getattr(cls(), part))
    text = cls.__pydantic_fields__[name].description
    if not text:
        raise KeyError(f"{cls.__name__}.{name} has no description")
    return text


def default_of(field: str):
    """The default value of a Settings field path (``precompute.select_share``), for help texts."""
    obj: Any = Settings()
    for part in field.split("."):
        obj = getattr(obj, part)
    return obj


def apply_flags(s: Settings, values: dict[str, Any]) -> Settings:
    """``s`` with the given flag values (keyed by ``Flag.field``; None = not given) applied."""
    top: dict[str, Any] = {}
    pc: dict[str, Any] = {}
    for field, value in values.items():
        if value is None:
            continue
        if field == "precompute.simulator.n_candidates":
            pc["simulator"] = asdict(s.precompute.simulator.with_candidates(int(value)))
        elif field == "precompute.lookback_days":
            pc["lookback_days"] = value or None          # 0: the whole log
        elif field == "precompute.budget_per_row":
            pc["budget_per_row"] = value or None         # 0: no budget (the per-user top share)
        elif field.startswith("precompute."):
            pc[field.split(".", 1)[1]] = value
        else:
            top[field] = value
    if pc:
        top["precompute"] = pc
    return s.override(**top) if top else s


def env_var(field: str) -> str:
    """The variable a Settings field is read from (for help texts: ``$SOLARIS_DATA``)."""
    return _VAR[field]


def env_log_level(env=None) -> str:
    """SOLARIS's log level from the environment alone (for a process before its settings are built)."""
    env = os.environ if env is None else env
    return (env.get("SOLARIS_LOG_LEVEL") or Settings().log_level).upper()


# ------------------------------------------------------------------------------------------------ training

# Each FM family's recipe, the one its validation search chose (solaris_jobs/evaluation/fm_search.py, tables in
# benchmarks/results/fm_search_synth*.json; held equal by tests/test_settings.py): the FM's training takes its
# family's where a setting does not name a value. gru4rec's is its search's start until that search has run.
FM_RECIPES = {
    "transformer": {"fm_lr": 4e-3, "fm_weight_decay": 1e-2, "fm_dropout": 0.1, "fm_target_user": True,
                    "history_len": 50},
    "gru4rec": {"fm_lr": 2e-3, "fm_weight_decay": 0.0, "fm_dropout": 0.1, "fm_target_user": False,
                "history_len": 50},
}
_FM = FM_RECIPES["transformer"]          # TrainSettings' defaults: the default family's


@dataclass(frozen=True, config=_STRICT)
class TrainSettings:
    """The training DAG's settings (``SOLARIS_TRAIN`` JSON); ``solaris train`` takes the same fields as flags."""
    epochs: int = Field(3, ge=1, description="Maximum epochs: the FM's in the training DAG (early stopping on valid "
                                             "BCE, patience 1).")
    history_len: int = Field(_FM["history_len"], ge=1, description="History length L.")
    batch_size: int = Field(512, ge=1, description="Training batch size.")
    d_model: int = Field(64, ge=1, description="FM model width.")
    layers: int = Field(2, ge=1, description="FM sequence-encoder layers.")
    d_interaction: int = Field(128, ge=1, description="Width of the interaction embedding h(u, i).")
    d_code: int = Field(32, ge=1, description="Code width D (what the VM and the feature store take).")
    # The FM's recipe: the evaluated one (the evaluation's ModelsConfig, chosen by #40's validation search; held equal
    # by tests/test_settings.py::test_the_defaults_are_the_evaluated_configuration); validate_train (SOLARIS_TRAIN,
    # `solaris train`) takes the family's (FM_RECIPES) for the fields it is not given.
    fm_lr: float = Field(_FM["fm_lr"], gt=0, description="The FM's learning rate.")
    fm_weight_decay: float = Field(_FM["fm_weight_decay"], ge=0,
                                   description="The FM's weight decay (AdamW).")
    fm_dropout: float = Field(_FM["fm_dropout"], ge=0, lt=1, description="The FM's dropout.")
    fm_target_user: bool = Field(_FM["fm_target_user"],
                                 description="The FM trunk's target x user product.")
    fm_family: Literal["transformer", "gru4rec"] = Field(
        "transformer", description="The FM's family: transformer (the evaluated one) or gru4rec (a recurrent one, "
                                   "models/gru4rec.py).")
    ae_epochs: int = Field(1, ge=1, description="The autoencoder's epochs.")
    verifier_epochs: int = Field(6, ge=1, description="The verifier's maximum epochs (early stopping on valid BCE).")
    verifier_patience: int = Field(2, ge=1, description="The verifier's early-stopping patience (epochs).")
    max_train_rows: int | None = Field(None, ge=1, description="Subsample large logs: N training rows, N/4 valid "
                                                                "and N/4 test rows.")
    seed: int = Field(0, ge=0, description="Random seed.")
    # The ranker's VM trains on what the store would serve the new models: a replay of the log's last served_hours,
    # refreshed every served_every (solaris_jobs.learning.replay).
    served_hours: int | float = Field(24, gt=0, description="The ranker's VM trains on a replay of the log's last "
                                                            "this many hours.")
    served_every: str = Field("1h", description="The replay's refresh interval (a duration: 1h, 30min).")

    @field_validator("served_every")
    @classmethod
    def _duration(cls, v: str) -> str:
        import pandas as pd             # only when training settings are read (a training task), not at import
        try:
            if pd.Timedelta(v) <= pd.Timedelta(0):
                raise ValueError("a duration must be positive")
        except ValueError as e:
            raise ValueError(f"not a duration ({e})") from e
        return v


_TRAIN_ADAPTER = TypeAdapter(TrainSettings)


def train_settings(env=None) -> TrainSettings:
    """``SOLARIS_TRAIN`` (JSON) over ``TrainSettings``' defaults.

    Raises:
        ValueError: not JSON, an unknown key, or a value of the wrong type or out of range (the message names the
            setting).
    """
    env = os.environ if env is None else env
    raw = env.get("SOLARIS_TRAIN")
    try:
        o = json.loads(raw) if raw else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"SOLARIS_TRAIN is not JSON: {e}") from e
    if not isinstance(o, dict):
        raise ValueError(f"SOLARIS_TRAIN must be a JSON object, not {raw!r}")
    known = sorted(TrainSettings.__pydantic_fields__)
    unknown = set(o) - set(known)
    if unknown:
        raise ValueError(f"SOLARIS_TRAIN: unknown settings {sorted(unknown)}; known: {known}")
    return validate_train(o, dict.fromkeys(o, "SOLARIS_TRAIN"))


def validate_train(raw: dict, names: dict[str, str] | None = None) -> TrainSettings:
    """``TrainSettings`` from a dict of fields, the FM's recipe fields it does not name from its family's
    (``FM_RECIPES``); an error names the field and where it came from (``names``: field -> a variable or a flag)."""
    raw = {**FM_RECIPES.get(raw.get("fm_family", "transformer"), {}), **raw}
    try:
        return _TRAIN_ADAPTER.validate_python(raw)
    except ValidationError as e:
        raise ValueError(f"training settings: {_explain(e, names)}") from e


def model_registry(env=None) -> Path:
    """``SOLARIS_MODEL_REGISTRY``: the folder holding ``versions/`` and the ``current`` link."""
    env = os.environ if env is None else env
    root = env.get("SOLARIS_MODEL_REGISTRY")
    if not root:
        raise ValueError("set SOLARIS_MODEL_REGISTRY (the folder holding versions/ and the current link)")
    return Path(root)


# ------------------------------------------------------------------------------------------------ store, cache

VIEW_TTLS = {"pair_embeddings": "24h", "pair_fallbacks": "24h", "user_aggregates": "24h", "user_states": "24h",
             "neighbours": "24h"}


def view_ttl(view: str, env=None) -> tuple[str, str]:
    """(variable, raw duration) of a feature view's TTL: ``SOLARIS_TTL_<VIEW>`` or its default."""
    env = os.environ if env is None else env
    var = f"SOLARIS_TTL_{view.upper()}"
    return var, env.get(var) or VIEW_TTLS[view]


def ttl_env(ttls: dict[str, str]) -> dict[str, str]:
    """The environment that sets these views' TTLs: ``{"pair_embeddings": "24h"}`` -> its variable and value."""
    unknown = set(ttls) - set(VIEW_TTLS)
    if unknown:
        raise ValueError(f"no feature view named {sorted(unknown)}; the views are {sorted(VIEW_TTLS)}")
    return {view_ttl(v, {})[0]: str(d) for v, d in ttls.items()}


def feature_repo(explicit=None, env=None) -> Path:
    """The Feast repo: ``explicit``, else ``SOLARIS_FEATURE_REPO``, else this project's ``feature_repo/``."""
    env = os.environ if env is None else env
    return Path(explicit or env.get("SOLARIS_FEATURE_REPO") or PROJECT_ROOT / "feature_repo").resolve()


def feast_offline_root(env=None) -> str:
    """Where the Feast repo's file sources point: ``SOLARIS_OFFLINE``, else the demo's offline store (so that
    ``feast apply`` works before anything is configured)."""
    env = os.environ if env is None else env
    return env.get("SOLARIS_OFFLINE") or str(PROJECT_ROOT / "artifacts" / "demo" / "offline")


def owner(env=None) -> str:
    """Who runs this deployment (a team, an address): ``SOLARIS_OWNER``, else ``solaris``. The DAGs' owner and the
    owner of every Feast entity, view and FeatureService, so the Airflow and Feast UIs say whom to ask."""
    env = os.environ if env is None else env
    return env.get("SOLARIS_OWNER") or "solaris"


def cache_dir(env=None) -> Path:
    """Download cache (MovieLens): ``SOLARIS_CACHE``, else ``~/.cache/solaris``."""
    env = os.environ if env is None else env
    return Path(env.get("SOLARIS_CACHE") or Path.home() / ".cache" / "solaris")


# ------------------------------------------------------------------------------------------------ the DAGs'

# Read by the DAG files themselves at parse time (scheduling and task placement); listed here for the docs and
# for the demo, which sets some of them (``dag_env``).
SPARK_CONN_ENV = "SOLARIS_SPARK_CONN_ID"         # also read outside the DAGs: `solaris airflow` checks it
REDIS_CONN_ENV = "SOLARIS_REDIS_CONN_ID"
FM_QUEUE_ENV = "SOLARIS_FM_QUEUE"
FM_POOL_ENV = "SOLARIS_FM_POOL"
DAG_ENV = {          # their defaults are in the DAG files (and docs/configuration.md)
    "SOLARIS_REFRESH_CRON": "refresh schedule",
    "SOLARIS_TRAIN_CRON": "training schedule (`none`: on demand)",
    "SOLARIS_START_DATE": "first interval",
    "SOLARIS_END_DATE": "the DAG's end_date: the last interval the scheduler starts is the one starting at or before it",
    "SOLARIS_CATCHUP": "run missed intervals on start",
    "SOLARIS_RETRIES": "task retries",
    "SOLARIS_RETRY_MINUTES": "first retry delay, exponential back-off",
    "SOLARIS_OWNER": "the DAGs' owner (also the Feast objects', read by `owner()`)",
    SPARK_CONN_ENV: "when set, the four Spark steps become SparkSubmitOperators on that connection",
    REDIS_CONN_ENV: "Airflow connection (type redis) the tasks build `SOLARIS_REDIS` from: host, port, login, "
                    "password, schema as the db number, extras as further parameters (`ssl`, `ssl_ca_certs`, ...)",
    FM_QUEUE_ENV: "Celery queue of the FM task (its workers: `airflow celery worker --queues <it>`, on GPU hosts)",
    FM_POOL_ENV: "pool of the FM task, its slots how many FM tasks run at once (`airflow pools set <it> <slots> ...`)",
}

# Named by other tools: Feast's yaml files expand it, so it is not read here.
REDIS_ENV = "SOLARIS_REDIS"
OTHER_ENV = {REDIS_ENV: "Redis connection string expanded in feature_store.redis*.yaml"}


def dag_env(start_date=None, end_date=None, retries=None, cron=None, catchup=None) -> dict[str, str]:
    """DAG scheduling variables for a local run (the demo): the first and last interval, retries, cron, catchup."""
    out = {}
    for var, value in (("SOLARIS_START_DATE", start_date), ("SOLARIS_END_DATE", end_date),
                       ("SOLARIS_RETRIES", retries), ("SOLARIS_REFRESH_CRON", cron),
                       ("SOLARIS_CATCHUP", None if catchup is None else str(catchup).lower())):
        if value is not None:
            out[var] = value.isoformat() if hasattr(value, "isoformat") else str(value)
    return out


def all_env_names() -> set[str]:
    """Every SOLARIS_* variable a deployment may set."""
    return (set(ENV) | {view_ttl(v)[0] for v in VIEW_TTLS} | {"SOLARIS_TRAIN", "SOLARIS_MODEL_REGISTRY",
                                                              "SOLARIS_CACHE"} | set(DAG_ENV) | set(OTHER_ENV))


__all__ = ["Settings", "PrecomputeConfig", "SimulatorConfig", "ENV", "DAG_ENV", "FLAGS", "Flag", "apply_flags",
           "default_of", "describe", "env_var", "TrainSettings", "train_settings", "validate_train",
           "model_registry", "view_ttl", "feature_repo", "feast_offline_root", "cache_dir", "dag_env",
           "all_env_names"]
