"""srun's options against the program's words (hpcckpt/slurm/srun_options.py)."""

from __future__ import annotations

from hpcckpt.slurm import srun_options


def names(args):
    return [o.name for o in srun_options.options(args)]


def test_values_in_the_next_word_are_taken_with_their_option():
    found, at = srun_options.parse(["-n", "2", "--chdir", "/x", "-N1", "a.out", "-K"])
    assert [(o.name, o.value, o.words) for o in found] == [
        ("ntasks", "2", ("-n", "2")),
        ("chdir", "/x", ("--chdir", "/x")),
        ("nodes", "1", ("-N1",)),
    ]
    assert at == 5


def test_optional_values_are_attached_only():
    found, at = srun_options.parse(["-K", "--exclusive", "-I", "a.out"])
    assert [(o.name, o.value) for o in found] == [
        ("kill-on-bad-exit", None),
        ("exclusive", None),
        ("immediate", None),
    ]
    assert at == 3
    assert [o.value for o in srun_options.options(["-K0", "--kill-on-bad-exit=1"])] == ["0", "1"]


def test_clusters_of_short_options():
    assert names(["-luK", "a"]) == ["label", "unbuffered", "kill-on-bad-exit"]
    assert [o.value for o in srun_options.options(["-lKu"])] == [None, "u"]  # as getopt
    found, at = srun_options.parse(["-ln", "4", "a"])
    assert [(o.name, o.value) for o in found] == [("label", None), ("ntasks", "4")]
    assert at == 2


def test_prefixes_unknown_options_and_the_end_of_options():
    assert names(["--kill-on-bad", "--ntasks-per-no=2", "--bogus", "a"]) == [
        "kill-on-bad-exit",
        "ntasks-per-node",
        None,
    ]
    assert names(["--ntask=2"]) == [None]  # ambiguous: ntasks, ntasks-per-node, ...
    assert srun_options.parse(["-n", "1", "--", "-K"]) == (srun_options.options(["-n", "1"]), 3)
    assert srun_options.parse([]) == ([], 0)
    assert srun_options.parse(["-n"]) == ([srun_options.Option("ntasks", None, ("-n",))], 1)


def test_every_short_option_has_a_known_long_name():
    tables = srun_options.REQUIRED | srun_options.OPTIONAL | srun_options.FLAGS
    assert set(srun_options.SHORT.values()) <= tables
    assert not srun_options.REQUIRED & srun_options.OPTIONAL
    assert not (srun_options.REQUIRED | srun_options.OPTIONAL) & srun_options.FLAGS
