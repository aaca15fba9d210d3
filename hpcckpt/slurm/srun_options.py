"""Which words of ``srun ARGS`` are srun's own options, and where the program starts.

srun reads options only up to the first word that is not one (or ``--``); what follows
is the program and its arguments, so an application's own ``-K`` or ``-N 4`` is not
srun's. Telling the two apart needs to know which options take a value in the next
word: the tables below are srun's (Slurm's ``src/common/slurm_opt.c``; options of
newer releases included, harmless on older ones). Long options may be abbreviated
to any unambiguous prefix, as getopt allows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: Short options and their long names.
SHORT = {
    "A": "account", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task",
    "C": "constraint", "d": "dependency", "D": "chdir", "e": "error", "E": "preserve-env",
    "F": "nodefile", "G": "gpus", "h": "help", "H": "hold", "i": "input", "I": "immediate",
    "J": "job-name", "k": "no-kill", "K": "kill-on-bad-exit", "l": "label",
    "L": "licenses", "m": "distribution", "M": "clusters", "n": "ntasks", "N": "nodes",
    "o": "output", "O": "overcommit", "p": "partition", "q": "qos", "Q": "quiet",
    "r": "relative", "s": "oversubscribe", "S": "core-spec", "t": "time", "T": "threads",
    "u": "unbuffered", "v": "verbose", "V": "version", "w": "nodelist", "W": "wait",
    "x": "exclude", "X": "disable-status", "Z": "no-allocate",
}  # fmt: skip

#: Long options whose value may be the next word (``--ntasks 4``).
REQUIRED = frozenset(
    """
    accel-bind account acctg-freq autocomplete bb bbf bcast-exclude begin chdir cluster
    cluster-constraint clusters comment constraint container container-id context
    core-spec cores-per-socket cpu-bind cpu-freq cpu_bind cpus-per-gpu cpus-per-task
    deadline delay-boot dependency distribution epilog error exclude export extra
    extra-node-info gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task
    gres gres-flags het-group hint ignore-signals input job-name jobid licenses mail-type
    mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mem-update mincpus mpi
    msg-timeout network nodefile nodelist nodes ntasks ntasks-per-core ntasks-per-gpu
    ntasks-per-node ntasks-per-socket ntasks-per-tres open-mode output pack-group
    partition prefer priority profile prolog qos relative reservation resources runtime
    segment signal slurmd-debug sockets-per-node switches task-epilog task-prolog
    tasks-per-node thread-spec threads threads-per-core time time-min tmp treewidth
    tres-bind tres-per-task wait wckey
""".split()
)

#: Long options whose value, if any, is attached (``--kill-on-bad-exit=0``).
OPTIONAL = frozenset(
    """
    bcast compress exclusive external-launcher immediate kill-on-bad-exit nice no-kill
    oom-kill-step overlap propagate pty resv-ports send-libs x11
""".split()
)

#: Long options that take no value.
FLAGS = frozenset(
    """
    async consolidate-segments contiguous debugger-test disable-status exact help hold
    interactive label multi-prog no-allocate overcommit oversubscribe parsable
    preserve-env quiet quit-on-interrupt reboot spread-job spread-segments stepmgr
    test-only unbuffered usage use-min-nodes verbose version wait-for-children whole
""".split()
)

_SHORT_REQUIRED = frozenset(k for k, v in SHORT.items() if v in REQUIRED)
_LONG = REQUIRED | OPTIONAL | FLAGS


@dataclass(frozen=True)
class Option:
    """One srun option as given: its long ``name`` (None when srun does not know it),
    its value if any, and the words it took."""

    name: str | None
    value: str | None
    words: tuple[str, ...]


def long_name(given: str) -> str | None:
    """srun's long option that ``given`` (without ``--``) names: itself or the one
    option it is a prefix of; None when it names none or several."""
    if given in _LONG:
        return given
    matches = [n for n in _LONG if n.startswith(given)]
    return matches[0] if len(matches) == 1 else None


def parse(args: Sequence[str]) -> tuple[list[Option], int]:
    """srun's options at the head of ``args`` and the index of the program's first word
    (``len(args)`` when there is none)."""
    found: list[Option] = []
    i = 0
    while i < len(args):
        word = args[i]
        if word == "--":
            return found, i + 1
        if word.startswith("--"):
            given, eq, value = word[2:].partition("=")
            name = long_name(given)
            if eq or name not in REQUIRED or i + 1 >= len(args):
                found.append(Option(name, value if eq else None, (word,)))
                i += 1
            else:
                found.append(Option(name, args[i + 1], (word, args[i + 1])))
                i += 2
        elif word.startswith("-") and len(word) > 1:
            i += _short_cluster(word, args[i + 1] if i + 1 < len(args) else None, found)
        else:
            break
    return found, i


def _short_cluster(word: str, following: str | None, found: list[Option]) -> int:
    """Options of one ``-abc`` word into ``found``; how many words they took (1 or 2)."""
    for k, letter in enumerate(word[1:], start=1):
        name = SHORT.get(letter)
        rest = word[k + 1 :]
        if letter in _SHORT_REQUIRED:
            if rest:
                found.append(Option(name, rest, (word,)))
                return 1
            if following is None:
                found.append(Option(name, None, (word,)))
                return 1
            found.append(Option(name, following, (word, following)))
            return 2
        if name in OPTIONAL:  # -K0, -I30: the value is the rest of the word
            found.append(Option(name, rest or None, (word,)))
            return 1
        found.append(Option(name, None, (word,)))
    return 1


def options(args: Sequence[str]) -> list[Option]:
    """srun's options at the head of ``args`` (never the program's)."""
    return parse(args)[0]


def given(args: Sequence[str], *names: str) -> Iterator[Option]:
    """srun's options among ``args`` that are one of ``names`` (long names)."""
    return (o for o in options(args) if o.name in names)
