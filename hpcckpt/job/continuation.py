"""Continuing a job after its step: requeue, chain, give up, give up after poison.

After a stop (time limit, preemption) the job continues by ``scontrol requeue`` or, with
``--chain``, a new job depending on this one (:mod:`hpcckpt.slurm.chain`). After a
crash it continues only within the restart budget and if the attempt made progress
(:mod:`hpcckpt.job.budget`); after a poisoned state (:mod:`hpcckpt.job.poison`) never;
after ``scancel`` never (``scontrol requeue`` also takes a finished job, so the wrapper
asks ``scontrol show job`` once it heard a TERM).
Every decision is one log line and one event, written through the wrapper's
:class:`Reporter`.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from hpcckpt.job import budget, poison, stalled
from hpcckpt.job.config import EXIT_CONTINUE_FAILED, EXIT_NO_PROGRESS, WrapperConfig
from hpcckpt.job.outcome import EXIT_OK, StepResult, crash_exit_code
from hpcckpt.job.reporting import DETAIL, WARN, Reporter
from hpcckpt.rundir import events
from hpcckpt.rundir.env import SCONTROL_ENV
from hpcckpt.slurm import chain, jobid
from hpcckpt.slurm import commands as slurm
from hpcckpt.slurm.env import SlurmEnv
from hpcckpt.slurm.parse import is_cancelled
from hpcckpt.slurm.runner import QUERY_TIMEOUT, SlurmError


class Continuation:
    """How this run of the job continues once its step has ended."""

    def __init__(
        self,
        reporter: Reporter,
        config: WrapperConfig,
        slurm_env: SlurmEnv,
        environ: Mapping[str, str],
        *,
        attempt: str,
        restart: int,
    ) -> None:
        self.reporter = reporter
        self.config = config
        self.slurm_env = slurm_env
        self.environ = environ
        self.attempt = attempt
        self.restart = restart
        #: The wrapper heard a TERM: the job may be cancelled (``scancel``), not stopped.
        self.term_heard = False

    @property
    def how(self) -> str | None:
        """ "chain", "requeue", or None (outside Slurm, or --no-requeue)."""
        if not self.slurm_env.in_job:
            return None
        if self.config.chain:
            return "chain"
        requeue = True if self.config.requeue is None else self.config.requeue
        return "requeue" if requeue else None

    def describe(self) -> str:
        """How this job continues after a stop, in words for the start line."""
        how = self.how
        if how is not None:
            return f"continue by {how}"
        if not self.slurm_env.in_job:
            return "no requeue outside Slurm: run the command again to resume"
        return "no requeue (--no-requeue): submit the batch script again to resume"

    def check_at_start(self) -> None:
        """Continuing by requeue: ask Slurm now whether it will requeue this job, so that a
        job submitted with --no-requeue (or under JobRequeue=0) learns it at the start,
        not at its first stop. Silent when scontrol cannot tell."""
        job = jobid.target(self.environ) or self.slurm_env.job_id
        if self.how != "requeue" or job is None:
            return
        timeout = min(QUERY_TIMEOUT, self.config.requeue_timeout)
        try:
            allowed = slurm.requeue_allowed(job, timeout=timeout, environ=self.environ)
        except (SlurmError, ValueError) as exc:
            self.reporter.log(f"cannot tell whether job {job} may be requeued: {exc}", DETAIL)
            return
        if allowed is not False:
            return
        self.reporter.log(
            f"warning: job {job} cannot be requeued: Slurm shows it with Requeue=0 (submitted "
            "with --no-requeue, or without --requeue where the site sets JobRequeue=0), so a "
            "stop would end it after its checkpoint instead of continuing",
            WARN,
        )
        self.reporter.log(
            "fix: add `#SBATCH --requeue` to the batch script, or continue by new jobs "
            "instead: hpcckpt srun --chain (or hpcckpt run --chain)",
            WARN,
        )

    def after_poison(self, result: StepResult, step: int | None) -> int:
        """Give up after a poisoned attempt: restarting would compute the same poison."""
        for line in poison.give_up_messages(result, self.config.ckpt_dir):
            self.reporter.log(line)
        self.reporter.event(events.GIVE_UP, **poison.give_up_fields(result, step))
        return crash_exit_code(result.returncode)

    def after_crash(self, result: StepResult, step: int | None, runtime: float) -> int:
        """Continue after a crash within the restart budget, else give up (budget.py)."""
        rc = result.returncode
        code = crash_exit_code(rc)
        self.reporter.log(f"step crashed: {result.reason}", WARN)
        self.reporter.event(
            events.CRASHED, exit_code=rc, reason=result.reason, step=step, wrapper_exit=code
        )
        how = self.how
        if how is not None and self._cancelled(code):
            return code
        if how is None:
            if self.slurm_env.in_job:
                self.reporter.log(
                    "not continuing: requeue disabled (--no-requeue); submit the batch script "
                    f"again to resume from the last checkpoint in {self.config.ckpt_dir}"
                )
            return code
        try:
            log = list(events.read_events(self.config.ckpt_dir))
        except OSError:
            log = None
        decision = budget.decide_after_crash(
            log,
            attempt=self.attempt,
            restart=self.restart,
            runtime=runtime,
            max_restarts=self.config.max_restarts,
            min_progress=self.config.min_progress,
        )
        if not decision.restart:
            self.reporter.log(decision.message, WARN)
            self.reporter.log(
                f"job {self.slurm_env.job_id}: restart {self.restart} of this computation, "
                f"{decision.used} after crashes (--max-restarts {self.config.max_restarts}); "
                f"the last good checkpoint stays in {self.config.ckpt_dir}. What to do: read "
                "the application's errors above, fix the cause, then submit the same batch "
                "script again (it resumes from that checkpoint with a fresh restart budget)",
                WARN,
            )
            self.reporter.event(
                events.GIVE_UP,
                reason=decision.message,
                crash_restarts=decision.used,
                max_restarts=self.config.max_restarts,
                progress=decision.progress,
                wrapper_exit=code,
            )
            return code
        self.reporter.log(decision.message)
        cont = self.continue_job("crash", step)
        return EXIT_OK if cont == EXIT_OK else cont

    def after_stop(self, step: int | None, facts: stalled.RunFacts | None = None) -> int:
        """The step stopped: continue the job later, unless runs in a row stopped before
        keeping anything new (:mod:`hpcckpt.job.stalled`); ``facts``: the run's numbers
        for that message."""
        facts = facts if facts is not None else stalled.RunFacts()
        try:
            log: list | None = list(events.read_events(self.config.ckpt_dir))
        except OSError:
            log = None
        decision = stalled.decide_after_stop(log, attempt=self.attempt, facts=facts)
        at_step = f" at step {step}" if step is not None else ""
        if not decision.progress:
            said = f"stopped{at_step}; nothing new was kept ({decision.kept})"
        elif facts.observable:
            said = f"stopped{at_step} after checkpoint"
        else:
            unseen = (
                "--restart-files lets the wrapper check its files"
                if self.config.app_mode
                else "no Checkpointer of this run reported a start"
            )
            said = (
                f"stopped{at_step} after the application was asked to checkpoint (what it "
                f"kept cannot be seen: {unseen})"
            )
        how = self.how
        if how is None:
            why = "requeue disabled (--no-requeue)" if self.slurm_env.in_job else "outside Slurm"
            self.reporter.log(f"{said}; run again to resume ({why})")
            self.reporter.event(
                events.STOPPED, step=step, requeued=False, reason=why, progress=decision.progress
            )
            return EXIT_OK
        if self._cancelled(EXIT_OK):
            return EXIT_OK
        self.reporter.log(said)
        if decision.give_up:
            self.reporter.log(decision.message, WARN)
            self.reporter.event(
                events.GIVE_UP,
                cause=stalled.STALLED_CAUSE,
                reason=decision.message,
                stalled_runs=decision.stalled,
                max_stalled=stalled.MAX_STALLED_STOPS,
                run_seconds=_rounded(facts.run_seconds),
                stop_before_end=_rounded(facts.stop_before_end),
                first_write=_rounded(facts.first_write),
                write_cut=facts.write_cut,
                wrapper_exit=EXIT_NO_PROGRESS,
            )
            return EXIT_NO_PROGRESS
        if decision.message:
            self.reporter.log(decision.message, WARN)
        return self.continue_job("stop", step, progress=decision.progress)

    def _cancelled(self, code: int) -> bool:
        """After a TERM: was the job cancelled (``scancel``)? Then say so and do not continue
        it (measured: ``scontrol requeue`` during the cancel's KillWait brings the job back,
        PENDING with ``Restarts`` + 1). False when scontrol cannot tell."""
        job = jobid.target(self.environ) or self.slurm_env.job_id
        if not self.term_heard or job is None:
            return False
        try:
            info = slurm.show_job(job, environ=self.environ)
        except (SlurmError, ValueError) as exc:
            self.reporter.log(f"note: cannot tell whether job {job} was cancelled: {exc}")
            return False
        if not is_cancelled(info):
            return False
        self.reporter.log(
            f"job {job} was cancelled (scancel): not continuing it. The newest complete "
            f"checkpoint stays in {self.config.ckpt_dir}; submit the same batch script again "
            "to resume from it",
            WARN,
        )
        self.reporter.event(events.CANCELLED, job_id=job, wrapper_exit=code)
        return True

    def continue_job(self, cause: str, step: int | None, *, progress: bool = True) -> int:
        """Requeue this job or submit the next link of the chain; 0 or EXIT_CONTINUE_FAILED.
        ``progress``: the run kept something new (recorded in the event, counted by
        :func:`hpcckpt.job.stalled.stalled_stops`)."""
        job = self.slurm_env.job_id
        assert job is not None
        at_step = f" at step {step}" if step is not None else ""
        if self.how == "chain":
            return self._chain(job, cause, step, at_step, progress)
        target = jobid.target(self.environ) or job  # an array task: <array job id>_<task id>
        self.reporter.log(f"requeueing job {target} (scontrol requeue)")
        if not self._recorded(events.REQUEUE, "requeueing", job, step, cause, progress):
            return EXIT_CONTINUE_FAILED
        try:
            slurm.requeue(target, timeout=self.config.requeue_timeout, environ=self.environ)
        except (SlurmError, ValueError) as exc:
            self.reporter.log(f"requeue failed: {exc}", WARN)
            self.reporter.log(
                f"the checkpoint{at_step} is safe in {self.config.ckpt_dir}: resubmit the same "
                "batch script (sbatch) to resume; make sure it has #SBATCH --requeue and that "
                f"scontrol works on the compute nodes (or set {SCONTROL_ENV}), or use "
                "--chain"
            )
            self.reporter.event(events.REQUEUE_FAILED, job_id=job, error=str(exc), cause=cause)
            return EXIT_CONTINUE_FAILED
        self.reporter.log(
            f"job {job} requeued; Slurm ends this run now and starts it again "
            "(it may wait about two minutes in PENDING/BeginTime)"
        )
        return EXIT_OK

    def _recorded(
        self, kind: str, doing: str, job: str, step: int | None, cause: str, progress: bool
    ) -> bool:
        """Record the continuation; after a crash it must be recorded (the restart budget
        counts restarts from the log), else the job does not continue."""
        fields = {} if progress else {"progress": False}
        if self.reporter.event(kind, job_id=job, step=step, cause=cause, **fields):
            return True
        if cause != "crash":
            return True
        self.reporter.log(
            f"not {doing} after a crash: the restart could not be counted in the log", WARN
        )
        return False

    def _chain(self, job: str, cause: str, step: int | None, at_step: str, progress: bool) -> int:
        after = jobid.target(self.environ) or job  # an array task: <array job id>_<task id>
        self.reporter.log(
            f"submitting the next job of the chain (sbatch --dependency=afterany:{after})"
        )
        if not self._recorded(events.CHAIN, "chaining", job, step, cause, progress):
            return EXIT_CONTINUE_FAILED
        try:
            new, spec, count = chain.submit_next(
                job,
                self.environ,
                ckpt_dir=str(self.config.ckpt_dir),
                timeout=self.config.requeue_timeout,
            )
        except (chain.ChainError, SlurmError, ValueError, OSError) as exc:
            self.reporter.log(f"chain failed: {exc}", WARN)
            self.reporter.log(
                f"the checkpoint{at_step} is safe in {self.config.ckpt_dir}: submit the same "
                "batch script again (with the same HPCCKPT_DIR) to resume"
            )
            self.reporter.event(events.CHAIN_FAILED, job_id=job, error=str(exc), cause=cause)
            return EXIT_CONTINUE_FAILED
        self.reporter.log(
            f"submitted job {new} (chain link {count}): "
            f"{shlex.join([spec.script, *spec.script_args])}; it starts when job {job} has ended"
        )
        self.reporter.event(
            events.CHAIN_SUBMITTED, job_id=job, next_job=new, chain_next=count, cause=cause
        )
        return EXIT_OK


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
