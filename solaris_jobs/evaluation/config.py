"""What an evaluation's numbers depend on: ``EvalConfig`` (written into report.json), its presets (the quick demo,
MovieLens), and the refresh settings and TTLs a replay of it runs with.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from solaris_jobs.data.synth import SynthConfig
from solaris_jobs.evaluation.protocol import ModelsConfig
from solaris_jobs.evaluation.variants import GRID_SIZE
from solaris_jobs.online.reader import DEFAULT_TIERS, READER_BUDGET_MS, READER_COOLDOWN_S


@dataclass(frozen=True)
class EvalConfig:
    """Everything the evaluation's numbers depend on (written into report.json).

    The headline settings (TTLs, cadence, budget, pool) are fixed here before any headline run; docs/evaluation.md and
    BENCHMARKS say why each has its value.
    """
    dataset: str = "synth"                                 # synth, movielens, or path: a log of the user's own
    data_root: str | None = None                           # dataset path: the data root (the event-log contract)
    times: tuple = ()                                      # dataset path: (t0, t1, t2, t3), else from ``split``
    split: tuple = (0.8, 0.9)                              # t1, t2 at these quantiles of the log's event times
    fm_checkpoint: str | None = None                       # a trained FM of the user's own, taken as it is
    fm_factory: str | None = None                          # its package.module:factory (models.protocol)
    possibly_leaky: bool = False                           # evaluate an FM that declares no training end
    seeds: tuple = (0, 1, 2, 3, 4)                       # >= 5: the headline criterion resamples seeds (#40)
    data_per_seed: bool = True       # synth: seed k draws its own log (generator seed synth.seed + k), same config
    synth: SynthConfig = field(default_factory=lambda: SynthConfig(users=5_000, items=5_000, days=5, seed=0))
    sequence_shares: tuple = (0.0, 0.25, 0.5, 0.75)       # the sweep (the headline is synth.sequence_share)
    train_days: float = 3.0
    served_days: float = 1.0
    test_days: float = 1.0
    valid_hours: float = 6.0
    fm_valid_hours: float = 12.0
    cadence: str = "1h"
    delay: str = "10min"
    label_delay_minutes: float = 30.0                      # labels arrive 30 min after their event (#40)
    serving_store: str = "redis"                           # the replays' store: the production kind (#40)
    serving_budget_ms: float = READER_BUDGET_MS            # the replays' reader: the production reader's budget
    serving_cooldown_s: float = READER_COOLDOWN_S          # and cooldown (on the requests' clock)
    tiers: tuple = DEFAULT_TIERS                           # the fallbacks served: validation's choice (#40)
    ttl_pair: str = "24h"
    ttl_item_aware: str = "24h"
    ttl_aggregate: str = "24h"
    ttl_user_state: str = "24h"
    ttl_neighbour: str = "24h"
    aggregate_hours: float = 24.0
    active_hours: float = 24.0
    recent_hours: float = 24.0
    budget: float = 0.5                                    # the headline: FM inferences per served row
    budgets: tuple = (0.125, 0.25, 0.5, 1.0, 2.0)          # the curve; the replay runs at the largest
    slow_cadence: int = 4                                  # 4 h: every 4th hourly refresh, 4x its budget
    fast_cadence: str | None = "15min"                     # its own replay over the hours before and after t2
    fast_hours_before: float = 4.0
    fast_hours_after: float = 8.0
    n_candidates: int = 20                                 # request-simulator candidates per active user
    select_priority: str = "recency"
    models: ModelsConfig = field(default_factory=ModelsConfig)
    vm_epochs: int = 5
    vm_batch_size: int = 8192
    grid_points: int = GRID_SIZE                           # per variant (the same for all)
    sweep_variants: tuple = ("vm", "vm_kd", "solaris")     # what the sweep over the sequence share trains
    sweep_seed: int = 0                                    # the one seed each sweep point runs
    n_boot: int = 1000
    curves: bool = True
    spark_master: str = "local[2]"

    def key(self) -> dict:
        d = asdict(self)
        d.pop("spark_master")
        return d

    def replay_key(self) -> dict:
        """What a replay's outputs depend on (its budget and plan are keyed apart): not the seeds, the curves'
        points, the VM training or the bootstrap, so changing those reuses the replays already run."""
        d = self.key()
        for k in REPLAY_INDEPENDENT:
            d.pop(k)
        return d


REPLAY_INDEPENDENT = ("seeds", "sequence_shares", "budget", "budgets", "slow_cadence", "fast_cadence",
                      "fast_hours_before", "fast_hours_after", "vm_epochs", "vm_batch_size", "grid_points",
                      "sweep_variants", "sweep_seed", "n_boot", "curves")


def quick_config(**kw) -> EvalConfig:
    """About eleven minutes on 2 cores with the curves (``make demo`` runs it without them: 7 min): 1,000
    synthetic users over 2.5 days refreshed every 2 h, one seed, small models, 4 grid points per variant, no sweep
    and no fast-cadence replay. Too small for the targets (the small FM barely beats the VM, if at all); the same
    code path as the full run."""
    base = dict(synth=SynthConfig(users=1_000, items=1_000, days=2.5, seed=0), seeds=(0,), sequence_shares=(),
                train_days=1.5, served_days=0.5, test_days=0.5, valid_hours=4.0, fm_valid_hours=6.0, cadence="2h",
                budgets=(0.25, 0.5, 1.0), slow_cadence=2, fast_cadence=None, n_boot=200, vm_epochs=3,
                grid_points=4,
                models=ModelsConfig(d_model=32, n_layers=1, d_interaction=64, d_code=16, history_len=30,
                                    fm_epochs=1, vm_epochs=3, max_train_rows=100_000))
    return EvalConfig(**{**base, **kw})


def path_config(root, **kw) -> EvalConfig:
    """A log of the user's own (``solaris evaluate --data PATH``): the headline's refresh, serving and model
    settings; t0..t3 given (``times``) or at quantiles of its event times (``split``, as MovieLens); three seeds
    of models on the one log (no data draw per seed, no generator sweep)."""
    base = dict(dataset="path", data_root=str(root), seeds=(0, 1, 2), data_per_seed=False, sequence_shares=(),
                fast_cadence=None)
    return EvalConfig(**{**base, **kw})


def movielens_config(**kw) -> EvalConfig:
    """MovieLens-100K: the 80/10/10 time split of DESIGN.md (t1, t2 at the 80% and 90% quantiles); people rate in
    bursts weeks apart, so a daily refresh with week-long windows and TTLs; no sequence-share sweep and no curves
    (reported with intervals, no target)."""
    base = dict(dataset="movielens", cadence="1d", delay="10min", ttl_pair="7d", ttl_item_aware="7d",
                ttl_aggregate="7d", ttl_neighbour="7d", ttl_user_state="7d", aggregate_hours=168.0,
                active_hours=168.0, recent_hours=168.0,
                slow_cadence=7, fast_cadence=None, sequence_shares=(), curves=False,
                models=ModelsConfig(max_train_rows=None, fm_epochs=3, vm_epochs=8, batch_size=256))
    return EvalConfig(**{**base, **kw})


def refresh_settings(cfg: EvalConfig, root: Path, offline: Path, models_dir: Path, budget: float):
    """The refresh settings a replay of ``cfg`` runs with, at ``budget`` FM inferences per served row."""
    from solaris_jobs.core.settings import PrecomputeConfig, Settings, SimulatorConfig
    n = cfg.n_candidates
    return Settings(data=str(root), offline=str(offline), models=str(models_dir), expire_from="event",
                    spark_master=cfg.spark_master, spark_log_level="ERROR", fm_factory=cfg.fm_factory,
                    precompute=PrecomputeConfig(
                        active_hours=cfg.active_hours, lookback_days=None, recent_hours=cfg.recent_hours,
                        budget_per_row=budget, select_priority=cfg.select_priority,
                        # Negative exclusion drops pairs the ranker would not rank again; this log's retrieval
                        # ranks them anyway, so excluding them would only cost coverage here.
                        exclusion_runs=0, aggregate_hours=cfg.aggregate_hours,
                        label_delay_minutes=cfg.label_delay_minutes,
                        simulator=SimulatorConfig().with_candidates(n)))


def ttls(cfg: EvalConfig) -> dict:
    """The online views' TTLs of ``cfg`` (as the materializer takes them)."""
    from solaris_jobs.core.settings import ttl_env
    return ttl_env({"pair_embeddings": cfg.ttl_pair, "pair_fallbacks": cfg.ttl_item_aware,
                    "user_aggregates": cfg.ttl_aggregate, "user_states": cfg.ttl_user_state,
                    "neighbours": cfg.ttl_neighbour})
