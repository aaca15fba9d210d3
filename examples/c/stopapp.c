/*
 * stopapp: an MPI program that behaves like the compiled HPC codes hpcckpt meets in the
 * wild, WITHOUT the hpcckpt Python API. Two conventions, chosen by MODE:
 *
 *   stopapp term     STEPS SLEEP_MS RESTART_PREFIX OUT_FILE
 *   stopapp periodic STEPS SLEEP_MS RESTART_PREFIX OUT_FILE EVERY
 *   stopapp series   STEPS SLEEP_MS RESTART_PREFIX OUT_FILE EVERY [PIECE_MS]
 *
 * term     "TERM = save and exit": SIGUSR1 is ignored. The first SIGTERM (or SIGINT) makes
 *          every rank write RESTART_PREFIX.<rank> at the same step, in place, in ten
 *          pieces one second apart (>= 10 s, like a large state on a busy file system);
 *          then MPI_Finalize and exit status 1 (many codes exit non-zero after a
 *          signal). A second TERM/INT ends the process at once by the default action,
 *          leaving a half-written file if it came during the write.
 * periodic takes no signal at all (TERM and INT kill it, USR1 is ignored): every EVERY
 *          steps every rank rewrites RESTART_PREFIX.<rank> in place, in four pieces
 *          0.3 s apart; a kill in the middle leaves a cut file behind.
 * series   takes no signal either, and writes a NEW file every EVERY steps, named by its
 *          step like a molecular-dynamics code: rank 0 gathers the field and writes
 *          RESTART_PREFIX.<step>.bin in eight pieces PIECE_MS apart (default 300), fsync'd;
 *          it never deletes the older ones. At the start rank 0 reads the file with the
 *          largest step it finds (its own "newest file" wildcard); a cut newest file is an
 *          error (exit 3), as it is for such codes. With STOPAPP_SLOW_STEP=N in the
 *          environment, the write after step N takes 100 times longer, in 100 times the
 *          pieces (a big state trickling onto a busy file system, no pause longer than
 *          PIECE_MS): what a test needs to have a write cut at a time limit.
 *
 * Started again (HPCCKPT_RESTART=1, or whenever every rank finds its file) it resumes
 * from the files; a cut or inconsistent file is an error (exit 3 or 4). At the end rank 0
 * writes the whole field to OUT_FILE (raw doubles): however often it was stopped and
 * resumed, the result is bit-identical to an uninterrupted run.
 */
#include <dirent.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CELLS_PER_RANK 2000
#define ALPHA 0.25
#define MAGIC 0x53544f50u /* "STOP": the last word of a complete restart file */

static volatile sig_atomic_t stop_signals = 0;

static void on_stop(int sig) {
    if (stop_signals > 0) { /* a second stop: die now, by the default action */
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    stop_signals = 1;
}

static void pause_ms(long ms) {
    struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&t, &t) != 0) {
    }
}

/* In place, PIECES pieces PAUSE_MS apart, fsync'd: a kill in between leaves a cut file. */
static int write_restart(const char *prefix, int rank, long step, const double *u, int n,
                         int pieces, long pause) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", prefix, rank);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(&step, sizeof step, 1, f) == 1 && fwrite(&n, sizeof n, 1, f) == 1;
    int per = (n + pieces - 1) / pieces;
    for (int lo = 0; ok && lo < n; lo += per) {
        int len = lo + per <= n ? per : n - lo;
        ok = fwrite(u + lo, sizeof *u, (size_t)len, f) == (size_t)len && fflush(f) == 0 &&
             fsync(fileno(f)) == 0;
        if (ok && lo + per < n) pause_ms(pause);
    }
    unsigned magic = MAGIC;
    ok = ok && fwrite(&magic, sizeof magic, 1, f) == 1 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* 0: read; 1: no file; -1: a cut or foreign file. */
static int read_restart(const char *prefix, int rank, long *step, double *u, int n) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%d", prefix, rank);
    FILE *f = fopen(path, "rb");
    if (!f) return 1;
    int got = 0;
    unsigned magic = 0;
    int ok = fread(step, sizeof *step, 1, f) == 1 && fread(&got, sizeof got, 1, f) == 1 &&
             got == n && fread(u, sizeof *u, (size_t)n, f) == (size_t)n &&
             fread(&magic, sizeof magic, 1, f) == 1 && magic == MAGIC;
    fclose(f);
    return ok ? 0 : -1;
}

/* RESTART_PREFIX.<step>.bin: the whole field (NTOTAL doubles), in PIECES pieces. */
static int write_series(const char *prefix, long step, const double *all, int ntotal,
                        int pieces, long pause) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%ld.bin", prefix, step);
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(&step, sizeof step, 1, f) == 1 && fwrite(&ntotal, sizeof ntotal, 1, f) == 1;
    int per = (ntotal + pieces - 1) / pieces;
    for (int lo = 0; ok && lo < ntotal; lo += per) {
        int len = lo + per <= ntotal ? per : ntotal - lo;
        ok = fwrite(all + lo, sizeof *all, (size_t)len, f) == (size_t)len && fflush(f) == 0 &&
             fsync(fileno(f)) == 0;
        if (ok && lo + per < ntotal) pause_ms(pause);
    }
    unsigned magic = MAGIC;
    ok = ok && fwrite(&magic, sizeof magic, 1, f) == 1 && fflush(f) == 0 && fsync(fileno(f)) == 0;
    return (fclose(f) == 0 && ok) ? 0 : -1;
}

/* The largest step of RESTART_PREFIX.<step>.bin in its directory, or -1 if none. */
static long newest_series(const char *prefix) {
    char dir[4096], base[4096];
    const char *slash = strrchr(prefix, '/');
    if (slash) {
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - prefix), prefix);
        snprintf(base, sizeof base, "%s.", slash + 1);
    } else {
        snprintf(dir, sizeof dir, ".");
        snprintf(base, sizeof base, "%s.", prefix);
    }
    DIR *d = opendir(dir[0] ? dir : "/");
    if (!d) return -1;
    long best = -1;
    size_t blen = strlen(base);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, base, blen) != 0) continue;
        char *end = NULL;
        long step = strtol(e->d_name + blen, &end, 10);
        if (end != e->d_name + blen && strcmp(end, ".bin") == 0 && step > best) best = step;
    }
    closedir(d);
    return best;
}

/* 0: read; -1: cut or foreign. */
static int read_series(const char *prefix, long step, double *all, int ntotal) {
    char path[4096];
    snprintf(path, sizeof path, "%s.%ld.bin", prefix, step);
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    long got_step = -1;
    int got = 0;
    unsigned magic = 0;
    int ok = fread(&got_step, sizeof got_step, 1, f) == 1 && got_step == step &&
             fread(&got, sizeof got, 1, f) == 1 && got == ntotal &&
             fread(all, sizeof *all, (size_t)ntotal, f) == (size_t)ntotal &&
             fread(&magic, sizeof magic, 1, f) == 1 && magic == MAGIC;
    fclose(f);
    return ok ? 0 : -1;
}

static void initial(double *u, int rank, int n) {
    for (int i = 1; i <= n; i++) {
        long global = (long)rank * n + (i - 1);
        u[i] = (global % 97 < 30) ? 100.0 : 0.0;
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int term = argc == 6 && strcmp(argv[1], "term") == 0;
    int periodic = argc == 7 && strcmp(argv[1], "periodic") == 0;
    int series = (argc == 7 || argc == 8) && strcmp(argv[1], "series") == 0;
    if (!term && !periodic && !series) {
        if (rank == 0)
            fprintf(stderr, "usage: stopapp term STEPS SLEEP_MS PREFIX OUT\n"
                            "       stopapp periodic STEPS SLEEP_MS PREFIX OUT EVERY\n"
                            "       stopapp series STEPS SLEEP_MS PREFIX OUT EVERY [PIECE_MS]\n");
        MPI_Finalize();
        return 2;
    }
    long steps = atol(argv[2]), sleep_ms = atol(argv[3]);
    const char *prefix = argv[4], *out = argv[5];
    long every = (periodic || series) ? atol(argv[6]) : 0;
    long piece_ms = series && argc == 8 ? atol(argv[7]) : 300;

    signal(SIGUSR1, SIG_IGN);
    if (term) {
        struct sigaction sa;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_stop;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESTART;
        sigaction(SIGTERM, &sa, NULL);
        sigaction(SIGINT, &sa, NULL);
    }

    int n = CELLS_PER_RANK;
    double *u = calloc((size_t)n + 2, sizeof *u), *next = calloc((size_t)n + 2, sizeof *u);
    if (!u || !next) MPI_Abort(MPI_COMM_WORLD, 1);
    long start = 0;
    double *all = rank == 0 ? malloc((size_t)n * size * sizeof *all) : NULL;
    if (rank == 0 && !all) MPI_Abort(MPI_COMM_WORLD, 1);
    if (series) {
        long newest = rank == 0 ? newest_series(prefix) : -1;
        int bad = 0;
        if (rank == 0 && newest >= 0) bad = read_series(prefix, newest, all, n * size) != 0;
        MPI_Bcast(&newest, 1, MPI_LONG, 0, MPI_COMM_WORLD);
        MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
        if (bad) {
            if (rank == 0) fprintf(stderr, "stopapp: %s.%ld.bin is cut\n", prefix, newest);
            MPI_Abort(MPI_COMM_WORLD, 3);
        }
        if (newest >= 0) {
            MPI_Scatter(all, n, MPI_DOUBLE, u + 1, n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
            start = newest;
            if (rank == 0) printf("stopapp: resuming after step %ld\n", start);
        } else {
            initial(u, rank, n);
            if (rank == 0) printf("stopapp: starting from the beginning\n");
        }
        fflush(stdout);
    }
    int got = series ? 0 : read_restart(prefix, rank, &start, u + 1, n), worst = 0;
    MPI_Allreduce(&got, &worst, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int best = 0;
    MPI_Allreduce(&got, &best, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    const char *resume = getenv("HPCCKPT_RESTART");
    if (!series &&
        (worst < 0 || worst != best || (resume && strcmp(resume, "1") == 0 && best != 0))) {
        if (rank == 0) fprintf(stderr, "stopapp: restart files missing or cut\n");
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    if (series) {
        /* read above */
    } else if (best == 0) {
        long lo = start, hi = start;
        MPI_Allreduce(MPI_IN_PLACE, &lo, 1, MPI_LONG, MPI_MIN, MPI_COMM_WORLD);
        MPI_Allreduce(MPI_IN_PLACE, &hi, 1, MPI_LONG, MPI_MAX, MPI_COMM_WORLD);
        if (lo != hi) {
            if (rank == 0) fprintf(stderr, "stopapp: restart files of different steps\n");
            MPI_Abort(MPI_COMM_WORLD, 4);
        }
        if (rank == 0) printf("stopapp: resuming after step %ld\n", start);
    } else {
        start = 0;
        initial(u, rank, n);
        if (rank == 0) printf("stopapp: starting from the beginning\n");
    }
    fflush(stdout);

    int left = rank > 0 ? rank - 1 : MPI_PROC_NULL;
    int right = rank < size - 1 ? rank + 1 : MPI_PROC_NULL;
    for (long step = start; step < steps; step++) {
        MPI_Sendrecv(&u[1], 1, MPI_DOUBLE, left, 0, &u[n + 1], 1, MPI_DOUBLE, right, 0,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        MPI_Sendrecv(&u[n], 1, MPI_DOUBLE, right, 1, &u[0], 1, MPI_DOUBLE, left, 1,
                     MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        if (left == MPI_PROC_NULL) u[0] = 0.0;
        if (right == MPI_PROC_NULL) u[n + 1] = 0.0;
        for (int i = 1; i <= n; i++) next[i] = u[i] + ALPHA * (u[i - 1] - 2.0 * u[i] + u[i + 1]);
        memcpy(u + 1, next + 1, (size_t)n * sizeof *u);
        if (sleep_ms > 0) pause_ms(sleep_ms);
        long done = step + 1;

        if (periodic && done % every == 0 && done < steps) {
            int err = write_restart(prefix, rank, done, u + 1, n, 4, 300), errs = 0;
            MPI_Allreduce(&err, &errs, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
            if (rank == 0) {
                printf("stopapp: restart files written after step %ld%s\n", done,
                       errs ? " (FAILED on some rank)" : "");
                fflush(stdout);
            }
        }
        if (series && done % every == 0 && done < steps) {
            MPI_Gather(u + 1, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
            const char *slow = getenv("STOPAPP_SLOW_STEP");
            /* slow: 100 times the pieces, each PIECE_MS apart: a steady trickle of bytes,
               never a pause a watcher could take for the write's end */
            int pieces = slow && atol(slow) == done ? 800 : 8;
            int err = rank == 0 ? write_series(prefix, done, all, n * size, pieces, piece_ms) : 0;
            if (rank == 0) {
                printf("stopapp: restart file %s.%ld.bin written%s\n", prefix, done,
                       err ? " (FAILED)" : "");
                fflush(stdout);
            }
            MPI_Barrier(MPI_COMM_WORLD);
        }
        if (term) {
            int want = stop_signals > 0, any = 0;
            MPI_Allreduce(&want, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
            if (any) {
                if (rank == 0) {
                    printf("stopapp: stop signal; writing restart files after step %ld\n", done);
                    fflush(stdout);
                }
                int err = write_restart(prefix, rank, done, u + 1, n, 10, 1200), errs = 0;
                MPI_Allreduce(&err, &errs, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
                if (rank == 0) {
                    printf("stopapp: restart files written after step %ld%s; exiting 1\n", done,
                           errs ? " (FAILED on some rank)" : "");
                    fflush(stdout);
                }
                MPI_Finalize();
                return 1;
            }
        }
    }

    MPI_Gather(u + 1, n, MPI_DOUBLE, all, n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0) {
        FILE *f = fopen(out, "wb");
        if (!f || fwrite(all, sizeof *all, (size_t)n * size, f) != (size_t)n * size) {
            fprintf(stderr, "stopapp: cannot write %s\n", out);
            MPI_Abort(MPI_COMM_WORLD, 5);
        }
        fclose(f);
        printf("stopapp: finished %ld steps\n", steps);
        free(all);
    }
    free(u);
    free(next);
    MPI_Finalize();
    return 0;
}
