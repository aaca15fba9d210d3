"""Console-script entry point: catch signals first, import the CLI second.

Slurm may deliver the time-limit signal to a freshly exec'd wrapper within
milliseconds; an uncaught SIGUSR1 kills the process. So the very first thing the
entry point does is record such signals; the wrapper replays them once it is ready.
"""

from __future__ import annotations

import sys

from hpcckpt.job import early_signals


def main() -> None:
    early_signals.install()
    from hpcckpt.cli.main import cli

    cli(prog_name="hpcckpt")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
