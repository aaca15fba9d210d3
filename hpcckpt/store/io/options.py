"""The checkpoint files on their file system: tuning and modes."""

from __future__ import annotations

from dataclasses import dataclass

from hpcckpt.store.io import filesystem


@dataclass(frozen=True)
class FileOptions:
    """The checkpoint files: the file-system tuning (``fs_tuning``, docs/filesystems.md)
    and who may read them (``share_group``: 0640/0750 instead of 0600/0700)."""

    fs_tuning: filesystem.TuningOptions | None = None
    share_group: bool = False

    @property
    def tuning(self) -> filesystem.TuningOptions:
        return self.fs_tuning or filesystem.TuningOptions()
