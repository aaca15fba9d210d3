"""The mirror's settings: where, how often, how fast, how long to wait, what it keeps."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpcckpt.store.mirror import compression
from hpcckpt.store.mirror import retention as mirror_retention
from hpcckpt.store.mirror.backend import check_url, check_verify, parse_bandwidth


@dataclass(frozen=True)
class MirrorOptions:
    """The mirror, a second tier (docs/tiers.md): ``mirror`` is a directory on another
    file system or ``s3://bucket/prefix`` (None: no mirror). A background worker copies
    every ``mirror_every``-th committed checkpoint there or, when ``mirror_interval``
    (seconds or "30m") is set instead, the first one committed that long after the last
    one sent, at most
    ``mirror_bandwidth`` bytes/s ("500M"; None: no cap), retrying with a backoff of up to
    ``mirror_retry_max`` seconds. ``finish()`` and a stop wait up to ``mirror_wait``
    seconds for the newest checkpoint to reach it. The mirror keeps ``mirror_keep_last``
    newest, one per ``mirror_keep_every`` steps and the ``mirror_thinning`` tiers by age
    ("6h:all,7d:1d,*:1w"); with none of them it keeps everything.

    ``mirror_verify``: how a copy is known to be whole: "auto" (the store's checksum on
    receipt where it checks one, else reading the copy back), "checksum" or "readback".
    ``mirror_compress``: "auto" (zstd where it makes the copy faster: a store slower than
    the compressor), "zstd" (always) or None (never); docs/tiers.md gives the figures."""

    mirror: str | os.PathLike[str] | None = None
    mirror_every: int = 1
    mirror_interval: float | str | None = None
    mirror_bandwidth: float | str | None = None
    mirror_wait: float | str = 300.0
    mirror_retry_max: float | str = 60.0
    mirror_keep_last: int | None = None
    mirror_keep_every: int | None = None
    mirror_thinning: str | None = None
    mirror_verify: str = "auto"
    mirror_compress: str | None = "auto"

    def __post_init__(self) -> None:
        if self.mirror is not None:
            object.__setattr__(self, "mirror", check_url(os.fspath(self.mirror)))
        every = self.mirror_every
        if isinstance(every, bool) or int(every) != every or every < 1:
            raise ValueError(f"mirror_every must be a positive integer, not {every!r}")
        for name in ("mirror_interval", "mirror_wait", "mirror_retry_max"):
            value = getattr(self, name)
            if value is None:
                continue
            seconds = float(value) if isinstance(value, (int, float)) else None
            if seconds is None:
                try:
                    seconds = mirror_retention.parse_age(str(value))
                except ValueError as exc:
                    raise ValueError(f"{name}={value!r}: {exc}") from None
            if seconds < 0 or (seconds == 0 and name != "mirror_wait"):
                raise ValueError(f"{name} must be a positive number of seconds, not {value!r}")
            object.__setattr__(self, name, seconds)
        if self.mirror_bandwidth is not None:
            value = self.mirror_bandwidth
            rate = float(value) if isinstance(value, (int, float)) else parse_bandwidth(value)
            if rate <= 0:
                raise ValueError(f"mirror_bandwidth must be positive, not {value!r}")
            object.__setattr__(self, "mirror_bandwidth", rate)
        object.__setattr__(self, "mirror_verify", check_verify(self.mirror_verify))
        object.__setattr__(self, "mirror_compress", compression.check_choice(self.mirror_compress))
        mirror_retention.check_rules(
            self.mirror_keep_last, self.mirror_keep_every, self.mirror_thinning
        )

    @property
    def url(self) -> str | None:
        """The mirror's URL or path (None: no mirror)."""
        return self.mirror  # type: ignore[return-value]
