/* A small test harness: checks that report file:line and keep going, one line
 * per test case, and a closing "N passed, N failed" line. Each test case runs
 * in a forked child with an alarm, so a crash or hang fails that case only. */
#ifndef KVPT_TEST_H
#define KVPT_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <pthread.h>
#include <sys/types.h>

#include "kvpipe/kvpipe.h"

extern int kvpt_failures; /* checks failed in the current case */

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "  %s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond);             \
            kvpt_failures++;                                                                       \
        }                                                                                          \
    } while (0)

/* Fails and returns from the case when cond is false. */
#define REQUIRE(cond)                                                                              \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "  %s:%d: REQUIRE(%s) failed\n", __FILE__, __LINE__, #cond);           \
            kvpt_failures++;                                                                       \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define CHECK_ST(expr, want)                                                                       \
    do {                                                                                           \
        kvp_status st_ = (expr);                                                                   \
        if (st_ != (want)) {                                                                       \
            fprintf(stderr, "  %s:%d: %s = %d (%s: %s), want %d\n", __FILE__, __LINE__, #expr,     \
                    (int)st_, kvp_strerror(st_), kvp_last_error(), (int)(want));                   \
            kvpt_failures++;                                                                       \
        }                                                                                          \
    } while (0)

#define REQUIRE_OK(expr)                                                                           \
    do {                                                                                           \
        kvp_status st_ = (expr);                                                                   \
        if (st_ != KVP_OK) {                                                                       \
            fprintf(stderr, "  %s:%d: %s = %s: %s\n", __FILE__, __LINE__, #expr,                   \
                    kvp_strerror(st_), kvp_last_error());                                          \
            kvpt_failures++;                                                                       \
            return;                                                                                \
        }                                                                                          \
    } while (0)

#define CHECK_OK(expr) CHECK_ST(expr, KVP_OK)

/* Run one case in a child process with a timeout in seconds. With env
 * KVPT_FILTER set, only cases whose name contains it run; with KVPT_EXCLUDE
 * set (one text or several, comma-separated), cases whose name contains one
 * of them are reported as skipped, not run. */
void kvpt_run(const char *name, void (*fn)(void), int timeout_s);
#define RUN(fn) kvpt_run(#fn, fn, 120)
#define RUN_T(fn, secs) kvpt_run(#fn, fn, secs)
/* A case that is fn(arg), named name: one function for several cases. */
void kvpt_run_with(const char *name, void (*fn)(const char *arg), const char *arg, int timeout_s);

/* Exit code of a skipped case, and of a program all of whose cases skipped;
 * ctest reports such a program as skipped (SKIP_RETURN_CODE). */
#define KVPT_SKIP_EXIT 77

/* Whether the UCX this process runs with is older than major.minor (0 in a
 * build without UCX, whose ucx cases skip anyway). For cases that meet a bug
 * of an old UCX (docs/transport-ucx.md, "Known UCX 1.13.1 bugs"). */
int kvpt_ucx_older_than(unsigned major, unsigned minor);

/* Print the summary line; returns the process exit code: 1 if a case failed,
 * KVPT_SKIP_EXIT if every case that ran skipped, else 0. */
int kvpt_summary(void);

/* Mark the current case skipped (with a reason) and return from it. */
#define SKIP(...)                                                                                  \
    do {                                                                                           \
        kvpt_skip(__VA_ARGS__);                                                                    \
        return;                                                                                    \
    } while (0)
void kvpt_skip(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* A TCP port on 127.0.0.1 that was free a moment ago, below the ephemeral
 * range, and handed to no other live process: draws are recorded in a
 * registry file shared with the Python tests (test.c). */
int kvpt_free_port(void);

/* A base port B for a pipe pair whose prefill_url and decode_url are both
 * 127.0.0.1:B, claimed as above with every port its two sides bind (B, +9,
 * +10, +100, +109, +110); -1 if none. Give it to a CLI that launches a
 * pair (`kvpipe demo --port`): its own pick does not know the claims. */
int kvpt_pipe_ports(void);

/* A base port B such that B + offsets[i] were all free a moment ago (and
 * recorded as kvpt_free_port's). */
int kvpt_free_port_block(const int *offsets, size_t n);

/* Wait until something accepts connections on host:port; 0 on success. */
int kvpt_wait_port(const char *host, int port, int timeout_ms);

/* Wait until the file at path holds text (in its first 64 KiB), as a program
 * started with kvpt_spawn() writes it; 0 on success. */
int kvpt_wait_file_has(const char *path, const char *text, int timeout_ms);

/* SIGSTOP pid and wait (up to timeout_ms) until every thread of it is
 * stopped: kill() returns before the threads of a busy process have all
 * taken the signal, and one still running may serve a request meanwhile.
 * 0 once they are all stopped. */
int kvpt_stop(pid_t pid, int timeout_ms);

/* Milliseconds the threads of process pid (alive now) spent runnable but
 * waiting for a CPU, so far (/proc/PID/task/TID/schedstat); -1 if unknown.
 * The difference over an interval is how much load delayed the process:
 * what a check of a duration may add to its bound. */
int64_t kvpt_runq_wait_ms(pid_t pid);

/* Start a program (argv[0] is a path) with stdout to out_path (NULL: inherit).
 * Returns its pid. */
pid_t kvpt_spawn(char *const argv[], const char *out_path);

/* 0 when this process runs no thread but the caller's; else -1, after
 * saying so as who. A child forked beside other threads may inherit a lock
 * one of them held (ASan's allocator's, a library's) and hang in it: the
 * fork helpers below and kvpt_peer_fork refuse, so that a case that would
 * hang now and then fails every time. Under TSan, which runs a thread of
 * its own and checks this itself, it always answers 0. */
int kvpt_fork_alone(const char *who);

/* Fork a child that dies with this process and runs fn(arg, fd), which
 * must not return; fd is the writing end of a pipe whose reading end is
 * *rfd here. The child's pid, or -1 if it could not start. */
pid_t kvpt_fork_piped(void (*fn)(const void *arg, int fd), const void *arg, int *rfd);

/* Fork a child that dies with this process and runs fn(arg, ready_fd),
 * which must not return; fn writes a byte to ready_fd once it is ready.
 * The child's pid once that byte came; -1 (the child killed and reaped)
 * if it never did. */
pid_t kvpt_fork_ready(void (*fn)(const void *arg, int ready_fd), const void *arg);

/* kvpt_spawn() argv with stdout to a file of its own and wait (up to
 * timeout_ms) until that holds text; the file is removed. Its pid, or -1
 * (killed) when text did not come. */
pid_t kvpt_spawn_until(char *const argv[], const char *text, int timeout_ms);

/* Join n threads that return a count of bad results cast to a pointer; their
 * sum. */
long kvpt_join_bad(const pthread_t *t, int n);

/* Wait for a child up to timeout_ms; returns its exit status (0..255), 128+sig
 * if killed, or -1 on timeout (the child is then killed). */
int kvpt_wait_child(pid_t pid, int timeout_ms);

/* Fill / check a deterministic byte pattern that depends on seed and offset. */
void kvpt_fill(void *buf, size_t len, uint64_t seed);
/* Returns the index of the first wrong byte, or (size_t)-1 if all match. */
size_t kvpt_verify(const void *buf, size_t len, uint64_t seed);

/* Descriptors this process has open, or -1. */
int kvpt_count_fds(void);

/* The CUDA driver's test double's own functions (tests/support/fake_cuda):
 * device memory allocated, read and written without counting as copies, the
 * Nth copy made to fail, copies counted (all; those of IPC-opened memory). */
typedef struct kvpt_fakecuda {
    void *(*alloc)(int device, size_t n);
    int (*peek)(void *dst, const void *dev, size_t n);
    int (*poke)(void *dev, const void *src, size_t n);
    void (*fail_copy)(long n);
    long (*copies)(void);
    long (*ipc_copies)(void);
} kvpt_fakecuda;
/* Load them from the double at path (the process exits if it cannot). */
void kvpt_fakecuda_load(kvpt_fakecuda *fc, const char *path);

/* Path of the kvpipe CLI built with the tests. */
const char *kvpt_cli(void);

/* Run `kvpipe ARGS` (ARGS as shell text) and wait; its stdout lands in out
 * (at most len - 1 bytes, NUL-terminated), and when it fails the end of its
 * stderr is printed. Returns the exit status, or -1. */
int kvpt_cli_run(const char *args, char *out, size_t len);

/* The last line of text, trailing newlines trimmed in place (what a --json
 * run prints last). */
char *kvpt_last_line(char *text);

#endif
