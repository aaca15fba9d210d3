"""The Checkpointer's settings as small frozen values, checked once when made.

Every keyword of ``Checkpointer(...)`` is a field of one class: when to save
(:class:`ScheduleOptions`), saves that return before the write (:class:`StagingOptions`),
how often a node-local save is drained (:class:`LevelOptions`), the guard and what a
failed save does (:class:`GuardOptions`), and the store's own classes
(:mod:`hpcckpt.store.options`). :class:`CheckpointerOptions` bundles them; it routes the
keywords (``route``: an unknown one is a TypeError with the nearest name) and is the one
place that reads the environment: the arguments first, then the wrapper's ``HPCCKPT_*``
variables, then Slurm (:class:`JobEnvironment`). An option added to one of these classes
is a keyword of ``Checkpointer(...)`` with no other change: :func:`signature` lists them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcckpt import slurm
from hpcckpt.coord.validate import Validator, make_validator
from hpcckpt.policy import (
    Deadline,
    IntervalPolicy,
    job_mtbf,
    make_policy,
    multilevel,
    parse_duration,
    parse_end_time,
)
from hpcckpt.rundir import verbosity
from hpcckpt.rundir.env import (
    ATTEMPT_ENV,
    CACHE_ENV,
    CALL_TIMEOUT_ENV,
    DIR_ENV,
    DRAIN_EVERY_ENV,
    END_TIME_ENV,
    MIRROR_ENV,
    MIRROR_WAIT_ENV,
    REDUNDANCY_ENV,
    SIGNAL_ENV,
)
from hpcckpt.store import node_path, parse_budget
from hpcckpt.store.options import (
    ArrayOptions,
    FileOptions,
    IncrementalOptions,
    MirrorOptions,
    RetentionOptions,
    StoreOptions,
    TierOptions,
    route,
)


@dataclass(frozen=True)
class JobEnvironment:
    """What the job's environment says, read once: the wrapper's ``HPCCKPT_*`` variables
    (raw text, None when unset) and Slurm's job id, node count and node name."""

    directory: str | None = None  # $HPCCKPT_DIR
    attempt: str | None = None  # $HPCCKPT_ATTEMPT: the wrapper's token for this attempt
    signal: str | None = None  # $HPCCKPT_SIGNAL
    end_time: str | None = None  # $HPCCKPT_END_TIME
    cache: str | None = None  # $HPCCKPT_CACHE
    redundancy: str | None = None  # $HPCCKPT_REDUNDANCY: "xor", "xor:4", "partner"
    drain_every: str | None = None  # $HPCCKPT_DRAIN_EVERY
    call_timeout: str | None = None  # $HPCCKPT_CALL_TIMEOUT
    mirror: str | None = None  # $HPCCKPT_MIRROR
    mirror_wait: str | None = None  # $HPCCKPT_MIRROR_WAIT
    log_level: int = verbosity.NORMAL  # $HPCCKPT_LOG_LEVEL
    job_id: str | None = None  # Slurm's; None outside Slurm
    nodes: int = 1  # nodes in the allocation
    node_name: str = field(default_factory=socket.gethostname)  # Slurm's, else the host's

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> JobEnvironment:
        """The environment of this process (or ``environ``)."""
        env = os.environ if environ is None else environ
        return cls(
            directory=env.get(DIR_ENV),
            attempt=env.get(ATTEMPT_ENV),
            signal=env.get(SIGNAL_ENV),
            end_time=env.get(END_TIME_ENV) or None,
            cache=env.get(CACHE_ENV) or None,
            redundancy=env.get(REDUNDANCY_ENV) or None,
            drain_every=env.get(DRAIN_EVERY_ENV) or None,
            call_timeout=env.get(CALL_TIMEOUT_ENV) or None,
            mirror=env.get(MIRROR_ENV) or None,
            mirror_wait=env.get(MIRROR_WAIT_ENV) or None,
            log_level=verbosity.level_from_env(env),
            job_id=slurm.job_id(env),
            nodes=slurm.node_count(env),
            node_name=slurm.node_name(env) or socket.gethostname(),
        )


@dataclass(frozen=True)
class ScheduleOptions:
    """When to save (the Checkpointer's docstring says how they combine).

    A fixed ``interval`` (seconds or "5m") or ``every_steps``; else ``policy`` ("daly",
    "young" or an IntervalPolicy) from ``mtbf`` or ``node_mtbf`` and the measured cost
    (``initial_cost`` until the first save). ``end_time`` (Unix time, ISO or "+1:00:00")
    with ``deadline_safety`` and ``deadline_margin`` places the last checkpoint; the
    stop ``signal`` and ``stop_signals`` make one due at once.
    """

    interval: float | str | None = None
    every_steps: int | None = None
    policy: str | IntervalPolicy = "daly"
    mtbf: float | str | None = None
    node_mtbf: float | str | None = None
    initial_cost: float | str | None = None
    end_time: float | str | None = None
    deadline_safety: float = 1.5
    deadline_margin: float = 20.0
    signal: str | int | None = None
    stop_signals: Iterable[str | int] = ("TERM",)

    def __post_init__(self) -> None:
        if self.interval is not None:
            interval = duration("interval", self.interval)
            if interval <= 0:
                raise ValueError(f"interval must be a positive number of seconds, not {interval!r}")
            object.__setattr__(self, "interval", interval)
        steps = self.every_steps
        if steps is not None and (int(steps) != steps or steps < 1):
            raise ValueError(f"every_steps must be a positive integer, not {steps!r}")
        for name in ("mtbf", "node_mtbf", "initial_cost"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, duration(name, value))
        object.__setattr__(self, "end_time", parse_end_time(self.end_time))
        Deadline(None, safety=self.deadline_safety, margin=self.deadline_margin)  # checks them
        object.__setattr__(self, "stop_signals", tuple(self.stop_signals))

    @classmethod
    def from_env(cls, env: JobEnvironment, **given: Any) -> ScheduleOptions:
        """The arguments; a ``signal`` or ``end_time`` not given comes from the wrapper's
        ``$HPCCKPT_SIGNAL`` (else SIGUSR1) and ``$HPCCKPT_END_TIME``."""
        if given.get("signal") is None:
            given["signal"] = env.signal if env.signal is not None else "USR1"
        if given.get("end_time") is None and env.end_time:
            given["end_time"] = env.end_time
        return cls(**given)

    def interval_policy(self, nodes: int) -> IntervalPolicy | None:
        """The time policy, or None when only ``every_steps`` (and stop requests) apply;
        ``nodes`` divides ``node_mtbf`` into the job's MTBF."""
        if self.interval is not None:
            return make_policy("fixed", interval=self.interval)  # type: ignore[arg-type]
        if self.every_steps is not None:
            return None
        if isinstance(self.policy, IntervalPolicy):
            return self.policy
        if self.mtbf is not None:
            mtbf = float(self.mtbf)
        else:
            node = {} if self.node_mtbf is None else {"node_mtbf": float(self.node_mtbf)}
            mtbf = job_mtbf(nodes=nodes, **node)
        return make_policy(self.policy, mtbf=mtbf)


@dataclass(frozen=True)
class StagingOptions:
    """Saves that return before the write: ``async_save`` stages the arrays in host
    memory, within ``staging_budget`` bytes per rank (an int or "4G"; None: half the
    node's available memory shared by its ranks). A node-local ``cache`` stages there."""

    async_save: bool = False
    staging_budget: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "staging_budget", parse_budget(self.staging_budget))


@dataclass(frozen=True)
class LevelOptions:
    """How often a node-local checkpoint is drained to the directory: every
    ``drain_every``-th save (None: ``$HPCCKPT_DRAIN_EVERY``, else 1), or ``"auto"``: the
    two-level model with ``local_fraction`` of the failures survivable on the node-local
    tier (None: 0.8)."""

    drain_every: int | str | None = None
    local_fraction: float | None = None

    def __post_init__(self) -> None:
        every = 1 if self.drain_every is None else self.drain_every
        if every != "auto" and (isinstance(every, str) or int(every) != every or every < 1):
            raise ValueError(f"drain_every must be a positive integer or 'auto', not {every!r}")
        given = self.local_fraction
        fraction = multilevel.DEFAULT_LOCAL_FRACTION if given is None else given
        if not 0.0 <= float(fraction) <= 1.0:
            raise ValueError(f"local_fraction must be in [0, 1], not {given!r}")
        object.__setattr__(self, "drain_every", every if every == "auto" else int(every))
        object.__setattr__(self, "local_fraction", float(fraction))

    @classmethod
    def from_env(cls, env: JobEnvironment, **given: Any) -> LevelOptions:
        """The arguments; a ``drain_every`` not given comes from ``$HPCCKPT_DRAIN_EVERY``
        (ValueError naming the variable when it is malformed)."""
        if given.get("drain_every") is None and env.drain_every:
            text = env.drain_every.strip()
            try:
                given["drain_every"] = "auto" if text == "auto" else int(text)
            except ValueError:
                raise ValueError(
                    f"{DRAIN_EVERY_ENV}={text!r} must be a positive integer or auto"
                ) from None
        return cls(**given)

    @property
    def period(self) -> int | None:
        """Every how many saves one is drained; None: chosen by the two-level model."""
        return None if self.drain_every == "auto" else int(self.drain_every)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GuardOptions:
    """Before and after a save: ``validate`` checks the state ("finite", a callable
    ``validate(state) -> bool | str`` or None; docs/hang-and-poison.md) and
    ``on_save_error`` ("raise" or "warn") says whether a failed save stops the run.
    ``call_timeout`` (seconds or "10m"; None: ``$HPCCKPT_CALL_TIMEOUT``, else no limit)
    is how long a rank waits in a call for the other ranks to make it before it raises
    CallTimeout naming the ranks that never came."""

    on_save_error: str = "raise"
    validate: str | Validator | None = "finite"
    call_timeout: float | str | None = None

    def __post_init__(self) -> None:
        if self.on_save_error not in ("raise", "warn"):
            raise ValueError(f"on_save_error must be 'raise' or 'warn', not {self.on_save_error!r}")
        make_validator(self.validate)  # checks it
        if self.call_timeout is not None:
            seconds = duration("call_timeout", self.call_timeout)
            if seconds <= 0:
                raise ValueError(f"call_timeout must be a positive duration, not {seconds!r}")
            object.__setattr__(self, "call_timeout", seconds)

    @classmethod
    def from_env(cls, env: JobEnvironment, **given: Any) -> GuardOptions:
        """The arguments; a ``call_timeout`` not given comes from ``$HPCCKPT_CALL_TIMEOUT``
        (ValueError naming the variable when it is malformed)."""
        if given.get("call_timeout") is None and env.call_timeout:
            try:
                return cls(**{**given, "call_timeout": env.call_timeout})
            except ValueError as exc:
                raise ValueError(f"{CALL_TIMEOUT_ENV}={env.call_timeout!r}: {exc}") from None
        return cls(**given)

    @property
    def validator(self) -> Validator | None:
        """The check run before every save (None: none)."""
        return make_validator(self.validate)


def tier_from_env(env: JobEnvironment, **given: Any) -> TierOptions:
    """The store's node-local tier from the arguments, else ``$HPCCKPT_CACHE`` and
    ``$HPCCKPT_REDUNDANCY`` (``"xor:4"``: the scheme and the set size); ``%n`` in the
    cache is the node's name (``node_name``, else Slurm's, else the host's)."""
    redundancy, set_size = given.get("redundancy"), given.get("redundancy_set")
    if redundancy is None and env.redundancy:
        text = env.redundancy.strip()
        scheme, _, size = text.partition(":")
        redundancy = scheme or None
        if size and set_size is None:
            try:
                set_size = int(size)
            except ValueError:
                raise ValueError(
                    f"{REDUNDANCY_ENV}={text!r}: write the scheme and optionally the set "
                    "size, e.g. xor, xor:4 or partner"
                ) from None
    cache = given.get("cache")
    cache = cache if cache is not None else env.cache
    if redundancy is not None and cache is None:
        raise ValueError(
            f"redundancy={redundancy!r} protects the node-local tier: pass cache=PATH too "
            f"(or set {CACHE_ENV})"
        )
    node = given.get("node_name") or env.node_name
    path = None if cache is None else node_path(os.fspath(cache), node)
    return TierOptions(cache=path, redundancy=redundancy, redundancy_set=set_size, node_name=node)


def mirror_from_env(env: JobEnvironment, **given: Any) -> MirrorOptions:
    """The mirror from the arguments, else ``$HPCCKPT_MIRROR`` and
    ``$HPCCKPT_MIRROR_WAIT`` (ValueError naming the variable when it is malformed)."""
    for key, name, text in (
        ("mirror", MIRROR_ENV, env.mirror),
        ("mirror_wait", MIRROR_WAIT_ENV, env.mirror_wait),
    ):
        if given.get(key) is None and text:
            try:
                MirrorOptions(**{key: text})
            except ValueError as exc:
                raise ValueError(f"{name}={text!r}: {exc}") from None
            given[key] = text
    return MirrorOptions(**given)


#: The type of ``Checkpointer(directory)``, as the signature shows it.
DIRECTORY_TYPE = "str | os.PathLike[str] | None"

#: The classes whose fields are the keywords of ``Checkpointer(...)``, in the order shown.
KEYWORD_CLASSES: tuple[type, ...] = (
    ScheduleOptions,
    RetentionOptions,
    ArrayOptions,
    FileOptions,
    GuardOptions,
    IncrementalOptions,
    StagingOptions,
    TierOptions,
    LevelOptions,
    MirrorOptions,
)


@dataclass(frozen=True)
class CheckpointerOptions:
    """Everything a Checkpointer is set up with: the directory, one value per concern,
    and the job's environment they were resolved against."""

    directory: Path
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    retention: RetentionOptions = field(default_factory=RetentionOptions)
    guard: GuardOptions = field(default_factory=GuardOptions)
    staging: StagingOptions = field(default_factory=StagingOptions)
    levels: LevelOptions = field(default_factory=LevelOptions)
    store: StoreOptions = field(default_factory=StoreOptions)
    job: JobEnvironment = field(default_factory=JobEnvironment)
    #: Where ``schedule.end_time`` came from: "argument", "environment", "slurm" (ask
    #: Slurm, collectively) or None (no deadline).
    end_time_source: str | None = None

    @classmethod
    def from_keywords(
        cls, directory: str | os.PathLike[str] | None = None, **keywords: Any
    ) -> CheckpointerOptions:
        """The options of ``Checkpointer(directory, **keywords)`` in this process's
        environment; TypeError naming an unknown keyword and the nearest one."""
        return cls.resolve(directory, keywords, JobEnvironment.from_env())

    @classmethod
    def resolve(
        cls,
        directory: str | os.PathLike[str] | None,
        keywords: Mapping[str, Any],
        env: JobEnvironment,
    ) -> CheckpointerOptions:
        """The options from ``keywords`` first, then ``env``."""
        where = directory if directory is not None else env.directory
        if not where:
            raise ValueError(
                "Checkpointer needs a directory: pass Checkpointer(directory, ...) "
                f"or set {DIR_ENV} (the hpcckpt wrapper sets it from --ckpt-dir)"
            )
        given = route("Checkpointer", keywords, *KEYWORD_CLASSES)
        path = Path(where).absolute()
        schedule = ScheduleOptions.from_env(env, **given[ScheduleOptions])
        tier = tier_from_env(env, **given[TierOptions])  # the store checks it is not `path`
        if given[ScheduleOptions].get("end_time") is not None:
            source: str | None = "argument"
        elif env.end_time:
            source = "environment"
        else:
            source = "slurm" if env.job_id is not None else None
        return cls(
            directory=path,
            schedule=schedule,
            retention=RetentionOptions(**given[RetentionOptions]),
            guard=GuardOptions.from_env(env, **given[GuardOptions]),
            staging=StagingOptions(**given[StagingOptions]),
            levels=LevelOptions.from_env(env, **given[LevelOptions]),
            store=StoreOptions(
                arrays=ArrayOptions(**given[ArrayOptions]),
                incremental=IncrementalOptions(**given[IncrementalOptions]),
                files=FileOptions(**given[FileOptions]),
                tier=tier,
                mirror=mirror_from_env(env, **given[MirrorOptions]),
            ),
            job=env,
            end_time_source=source,
        )


def init_signature() -> inspect.Signature:
    """``Checkpointer.__init__``'s signature: ``self``, ``directory``, ``comm`` and every
    keyword with its default and type, from the fields of :data:`KEYWORD_CLASSES`."""
    P = inspect.Parameter
    leading = [
        P("self", P.POSITIONAL_OR_KEYWORD),
        P("directory", P.POSITIONAL_OR_KEYWORD, default=None, annotation=DIRECTORY_TYPE),
        P(
            "comm",
            P.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation="MPI.Comm | ProcessGroup | Comm | None",
        ),
    ]
    keywords = [
        P(f.name, P.KEYWORD_ONLY, default=_default(f), annotation=f.type)
        for kind in KEYWORD_CLASSES
        for f in dataclasses.fields(kind)
    ]
    return inspect.Signature([*leading, *keywords], return_annotation="None")


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def duration(name: str, value: float | str) -> float:
    """Seconds from a number or a duration like "5m"; the error names the argument."""
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise ValueError(f"Checkpointer({name}={value!r}): {exc}") from None
