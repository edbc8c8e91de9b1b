/* Pieces the bench programs share: the clock, long options read from a
 * table, and the latency summary they print. */
#ifndef KVP_BENCH_UTIL_H
#define KVP_BENCH_UTIL_H

#include <stdint.h>
#include <sys/types.h>

/* CLOCK_MONOTONIC in nanoseconds. */
uint64_t bench_now_ns(void);

/* One long option: --name VALUE or --name=VALUE (and -s VALUE where
 * short_name is set), stored in *to as kind says (a flag takes no value and
 * stores 1 in an int). */
typedef enum {
    BENCH_STR,
    BENCH_LONG,
    BENCH_INT,
    BENCH_UINT,
    BENCH_SIZE,
    BENCH_DOUBLE,
    BENCH_FLAG
} bench_kind;
typedef struct bench_opt {
    const char *name;
    bench_kind kind;
    void *to;
    char short_name;
} bench_opt;

/* Parse argv's options (n rows of opts, 32 at most); 0, or -1 on an option
 * not in the table or one without its value. Operands are left from optind
 * on, as getopt_long leaves them. */
int bench_parse(int argc, char **argv, const bench_opt *opts, int n);

/* qsort's order of uint64_t samples. */
int bench_cmp_u64(const void *a, const void *b);

/* Sort n (>= 1) samples in nanoseconds and print the head of a JSON line:
 * {"median_us", "p99_us", "mean_us", "min_us", "count", and a comma; the
 * caller prints its own fields and the closing brace. */
void bench_print_latency(uint64_t *ns, long n);

/* A ZeroMQ socket of type bound to a free loopback TCP port, and a child
 * process that runs child(endpoint, arg) and exits with its result; the
 * socket (the child's pid in *pid), or NULL with ZeroMQ's reason printed
 * after who. */
void *bench_zmq_with_child(void *ctx, int type, const char *who,
                           int (*child)(const char *ep, const void *arg), const void *arg,
                           pid_t *pid);

#endif
