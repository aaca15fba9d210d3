/*
 * heat1d: a small MPI program WITHOUT the hpcckpt Python API, checkpointed by the
 * hpcckpt wrapper through its own restart files.
 *
 *   heat1d STEPS SLEEP_MS RESTART_PREFIX OUT_FILE
 *
 * A 1-D heat equation, cells split over the ranks, ghost cells exchanged every step.
 * On SIGUSR1 (from `hpcckpt run/srun --app-signal USR1`, which Slurm's warning signal
 * or the periodic --ckpt-every timer triggers) every rank writes RESTART_PREFIX.<rank>
 * at the same step: to a temporary file first, then renamed into place, so a file is
 * never half-written under its final name. Then it goes on computing; the wrapper
 * decides when to stop the step. Started again with HPCCKPT_RESTART=1 (or whenever
 * the files exist), it resumes from them. At the end rank 0 writes the whole field to
 * OUT_FILE (raw doubles): a run stopped and resumed any number of times ends
 * bit-identical to one that ran straight through.
 */
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CELLS_PER_RANK 1000
#define ALPHA 0.25

static volatile sig_atomic_t checkpoint_requested = 0;

static void on_signal(int sig) {
    (void)sig;
    checkpoint_requested = 1;
}

static int write_restart(const char *prefix, int rank, long step, const double *u, int n) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof path, "%s.%d", prefix, rank);
    snprintf(tmp, sizeof tmp, "%s.%d.tmp-%d", prefix, rank, (int)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return -1;
    int ok = fwrite(&step, sizeof step, 1, f) == 1 && fwrite(&n, sizeof n, 1, f) == 1 &&
             fwrite(u, sizeof *u, (size_t)n, f) == (size_t)n;
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    if (!ok || rename(tmp, path) != 0) {
        unlink(tmp);
        return -1;
    }
    return 0;
}

static int read_restart(const char *prefix, int rank, long *step, double *u, int n) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", prefix, rank);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    int got = 0;
    int ok = fread(step, sizeof *step, 1, f) == 1 && fread(&got, sizeof got, 1, f) == 1 &&
             got == n && fread(u, sizeof *u, (size_t)n, f) == (size_t)n;
    fclose(f);
    return ok ? 0 : -1;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 5) {
        if (rank == 0) fprintf(stderr, "usage: heat1d STEPS SLEEP_MS RESTART_PREFIX OUT_FILE\n");
        MPI_Finalize();
        return 2;
    }
    long steps = atol(argv[1]);
    long sleep_ms = atol(argv[2]);
    const char *prefix = argv[3];
    const char *out = argv[4];

    /* The handler first: the wrapper holds its signal for --app-ready seconds. */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    sigaction(SIGUSR1, &sa, NULL);

    int n = CELLS_PER_RANK;
    double *u = calloc((size_t)n + 2, sizeof *u), *next = calloc((size_t)n + 2, sizeof *u);
    if (!u || !next) MPI_Abort(MPI_COMM_WORLD, 1);
    for (int i = 1; i <= n; i++) {
        long global = (long)rank * n + (i - 1);
        u[i] = (global % 97 < 30) ? 100.0 : 0.0;
    }

    long start = 0;
    const char *resume = getenv("HPCCKPT_RESTART");
    int have = read_restart(prefix, rank, &start, u + 1, n) == 0;
    int all_have = 0;
    MPI_Allreduce(&have, &all_have, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (resume && strcmp(resume, "1") == 0 && !all_have) {
        if (rank == 0) fprintf(stderr, "heat1d: HPCCKPT_RESTART=1 but no complete restart files\n");
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (all_have) {
        long lo = start, hi = start;
        MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_LONG, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
        if (lo != hi) {
            if (rank == 0) fprintf(stderr, "heat1d: restart files of different steps\n");
            MPI_Abort(MPI_COMM_WORLD, 4);
        }
        if (rank == 0) printf("heat1d: resuming after step %ld\n", start);
    } else {
        start = 0;
        for (int i = 1; i <= n; i++) {
            long global = (long)rank * n + (i - 1);
            u[i] = (global % 97 < 30) ? 100.0 : 0.0;
        }
        if (rank == 0) printf("heat1d: starting from the beginning\n");
    }
    fflush(stdout);

    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;
    struct timespec pause = {sleep_ms / 1000, (sleep_ms % 1000) * 1000000L};
    for (long step = start; step < steps; step++) {
        MPI_Sendrecv(&u[1], 1, MPI_DOUBLE, left, 0, &u[n + 1], 1, MPI_DOUBLE, right, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(&u[n], 1, MPI_DOUBLE, right, 1, &u[0], 1, MPI_DOUBLE, left, 1,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (left == MPI_PROC_NULL) u[0] = 0.0;
        if (right == MPI_PROC_NULL) u[n + 1] = 0.0;
        for (int i = 1; i <= n; i++) next[i] = u[i] + ALPHA * (u[i - 1] - 2.0 * u[i] + u[i + 1]);
        memcpy(u + 1, next + 1, (size_t)n * sizeof *u);
        if (sleep_ms > 0) nanosleep(&pause, NULL);

        /* Agree on the step: every rank writes at the same one. */
        int want = checkpoint_requested, any = 0;
        MPI_Allreduce(&want, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        if (any) {
            checkpoint_requested = 0;
            long done = step + 1;
            int err = write_restart(prefix, rank, done, u + 1, n), errs = 0;
            MPI_Allreduce(&err, &errs, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            if (rank == 0) {
                printf("heat1d: restart files written after step %ld%s\n", done,
                       errs ? " (FAILED on some rank)" : "");
                fflush(stdout);
            }
        }
    }

    double *all = rank == 0 ? malloc((size_t)n * size * sizeof *all) : NULL;
    MPI_Gather(u + 1, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        double sum = 0.0;
        for (long i = 0; i < (long)n * size; i++) sum += all[i];
        FILE *f = fopen(out, "wb");
        if (!f || fwrite(all, sizeof *all, (size_t)n * size, f) != (size_t)n * size) {
            fprintf(stderr, "heat1d: cannot write %s\n", out);
            MPI_Abort(MPI_COMM_WORLD, 5);
        }
        fclose(f);
        printf("heat1d: finished %ld steps, sum=%.6f\n", steps, sum);
        free(all);
    }
    free(u);
    free(next);
    MPI_Finalize();
    return 0;
}
