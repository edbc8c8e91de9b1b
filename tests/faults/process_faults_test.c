/* Process faults mid-transfer, over TCP: the target or the initiator is
 * SIGSTOPped or SIGKILLed while READs or WRITEs run. The side that lives on
 * sees the failure within the documented bound (timeout_ms + a slice at
 * min_transfer_rate: 3 s + 4 MiB at 16 MiB/s here), frees what the dead or
 * frozen peer held, and keeps serving others. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "test.h"

#define SEED 0x9f
#define MIB ((size_t)1 << 20)
#define TIMEOUT_MS 3000
/* timeout_ms + one 4 MiB slice at 16 MiB/s, and a second of margin. */
#define BOUND_MS (TIMEOUT_MS + 250 + 1000)

typedef struct looper {
    kvp_engine *e;
    kvp_segment_id seg;
    kvp_opcode op;
    uint64_t remote;
    char *local;
    size_t len;
    atomic_int stop;
    atomic_llong failed_at; /* kvpi_now_ms() of the first failure; 0: none */
    kvp_status st;
    char why[512];
    pthread_t thread;
} looper;

static void *loop_main(void *arg)
{
    looper *l = arg;
    while (!atomic_load(&l->stop)) {
        kvp_status st = l->op == KVP_OP_READ
                            ? kvp_engine_read(l->e, l->seg, l->local, l->remote, l->len)
                            : kvp_engine_write(l->e, l->seg, l->local, l->remote, l->len);
        if (st) {
            l->st = st; /* read after the join */
            snprintf(l->why, sizeof l->why, "%s", kvp_last_error());
            atomic_store(&l->failed_at, (long long)kvpi_now_ms());
            break;
        }
    }
    return NULL;
}

static int loop_start(looper *l, kvp_engine *e, kvp_segment_id seg, kvp_opcode op, uint64_t remote,
                      size_t len)
{
    *l = (looper){.e = e, .seg = seg, .op = op, .remote = remote, .len = len};
    l->local = malloc(len);
    if (!l->local) return -1;
    kvpt_fill(l->local, len, 3);
    return pthread_create(&l->thread, NULL, loop_main, l);
}

static void loop_stop(looper *l)
{
    atomic_store(&l->stop, 1);
    pthread_join(l->thread, NULL);
    free(l->local);
}

/* The target is stopped (or killed) while 64 MiB requests (16 slices over
 * the engine's 4 workers) run back to back; returns ms from the signal to the
 * failure, or -1. */
static long target_fault(int sig, kvp_opcode op, kvp_status *st)
{
    kvpt_target t;
    kvpt_target_opts o = {
        .len = 64 * MIB, .seed = SEED, .timeout_ms = TIMEOUT_MS, .disable_shm = 1};
    if (kvpt_target_start(&o, &t) != 0) return -1;
    kvp_engine *e;
    long took = -1;
    if (kvpt_initiator_start(NULL, "tcp", 1, TIMEOUT_MS, &e) == 0) {
        kvp_segment_id seg;
        looper l;
        if (kvp_engine_open_segment(e, t.name, &seg) == KVP_OK &&
            loop_start(&l, e, seg, op, (uint64_t)(uintptr_t)t.buf, 64 * MIB) == 0) {
            usleep(400000);
            uint64_t at = kvpi_now_ms();
            kill(t.pid, sig);
            for (int i = 0; i < 300 && !atomic_load(&l.failed_at); i++)
                usleep(50000);
            long long failed = atomic_load(&l.failed_at);
            if (failed) took = (long)(failed - (long long)at);
            if (sig == SIGSTOP) kill(t.pid, SIGKILL); /* frees the initiator's last waits */
            loop_stop(&l);
            *st = l.st;
            fprintf(stderr, "  signal %d during %s: %s after %ld ms: %s\n", sig,
                    op == KVP_OP_READ ? "READs" : "WRITEs", kvp_strerror(l.st), took, l.why);
        }
        kvp_engine_destroy(e);
    }
    kill(t.pid, SIGKILL);
    kvpt_target_stop(&t, 0);
    return took;
}

static void target_sigstop_mid_read(void)
{
    kvp_status st = KVP_OK;
    long ms = target_fault(SIGSTOP, KVP_OP_READ, &st);
    CHECK_ST(st, KVP_ETIMEDOUT);
    CHECK(ms >= 0 && ms < BOUND_MS);
}

static void target_sigstop_mid_write(void)
{
    kvp_status st = KVP_OK;
    long ms = target_fault(SIGSTOP, KVP_OP_WRITE, &st);
    CHECK_ST(st, KVP_ETIMEDOUT);
    CHECK(ms >= 0 && ms < BOUND_MS);
}

static void target_sigkill_mid_write(void)
{
    kvp_status st = KVP_OK;
    long ms = target_fault(SIGKILL, KVP_OP_WRITE, &st);
    CHECK(st == KVP_ECONNRESET || st == KVP_ECONNREFUSED);
    CHECK(ms >= 0 && ms < 2000); /* a dead peer is seen at once */
}

static void target_sigkill_mid_read(void)
{
    kvp_status st = KVP_OK;
    long ms = target_fault(SIGKILL, KVP_OP_READ, &st);
    CHECK(st == KVP_ECONNRESET || st == KVP_ECONNREFUSED);
    CHECK(ms >= 0 && ms < 2000);
}

/* An initiator in a child process that WRITEs 32 MiB at a time into the
 * target's buffer until it is signalled. */
static pid_t writer_child(const kvpt_target *t)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid != 0) return pid;
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    kvp_engine *e;
    kvp_segment_id seg;
    if (kvpt_initiator_start(NULL, "tcp", 1, TIMEOUT_MS, &e) != 0 ||
        kvp_engine_open_segment(e, t->name, &seg) != KVP_OK)
        _exit(3);
    char *buf = malloc(32 * MIB);
    if (!buf) _exit(4);
    kvpt_fill(buf, 32 * MIB, 5);
    for (;;)
        kvp_engine_write(e, seg, buf, (uint64_t)(uintptr_t)t->buf, 32 * MIB);
}

/* The initiator is frozen or killed mid-WRITE: the target registers other
 * memory at once, serves another initiator, and lets go of the region by the
 * frozen WRITE's deadline (so unregistering it returns). Before, a frozen
 * writer blocked registration (the registry's lock) until the target's I/O
 * timeout. */
static void initiator_fault(int sig)
{
    kvpt_target t;
    kvpt_target_opts o = {
        .len = 64 * MIB, .seed = SEED, .timeout_ms = TIMEOUT_MS, .disable_shm = 1};
    REQUIRE(kvpt_target_start(&o, &t) == 0);
    pid_t w = writer_child(&t);
    REQUIRE(w > 0);
    usleep(700000); /* it is connected and writing */
    kill(w, sig);
    usleep(100000);
    int64_t reg_ms = kvpt_target_cmd(&t, KVPT_T_REGISTER, MIB, 2500);
    CHECK(reg_ms >= 0 && reg_ms < 1000);
    kvp_engine *e;
    REQUIRE(kvpt_initiator_start(NULL, "tcp", 1, TIMEOUT_MS, &e) == 0);
    kvp_segment_id seg;
    REQUIRE_OK(kvp_engine_open_segment(e, t.name, &seg));
    char *buf = malloc(MIB);
    REQUIRE(buf);
    /* Another initiator, the upper half of the region the frozen one writes to. */
    CHECK_OK(kvp_engine_read(e, seg, buf, (uint64_t)(uintptr_t)t.buf + 48 * MIB, MIB));
    CHECK(kvpt_verify(buf, MIB, SEED + 48 * MIB) == (size_t)-1);
    int64_t unreg_ms = kvpt_target_cmd(&t, KVPT_T_UNREGISTER, 0, BOUND_MS + 2000);
    CHECK(unreg_ms >= 0 && unreg_ms < BOUND_MS);
    fprintf(stderr, "  initiator signal %d: register %lld ms, unregister %lld ms\n", sig,
            (long long)reg_ms, (long long)unreg_ms);
    free(buf);
    kvp_engine_destroy(e);
    kill(w, SIGKILL);
    waitpid(w, NULL, 0);
    CHECK(kvpt_target_stop(&t, 0) == 0);
}

static void initiator_sigstop_mid_write(void)
{
    initiator_fault(SIGSTOP);
}

static void initiator_sigkill_mid_write(void)
{
    initiator_fault(SIGKILL);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    RUN_T(target_sigstop_mid_read, 60);
    RUN_T(target_sigstop_mid_write, 60);
    RUN_T(target_sigkill_mid_read, 60);
    RUN_T(target_sigkill_mid_write, 60);
    RUN_T(initiator_sigstop_mid_write, 60);
    RUN_T(initiator_sigkill_mid_write, 60);
    return kvpt_summary();
}
