/* Mooncake's C API on kvpipe (libkvpipe_mooncake, docs/mooncake-c-api.md):
 * tests/compat/mooncake_c_api_prog.c, written against Mooncake's
 * transfer_engine_c.h alone, runs as target and initiator in two processes
 * and moves verified bytes with READ and WRITE, a notification after the
 * WRITE (submitTransferWithNotify, getNotifsFromEngine on the other side)
 * and one back (genNotifyInEngine), and checks Mooncake's error codes; over
 * tcp (shm off), with P2PHANDSHAKE and with the HTTP metadata server.
 * tests/compat/mooncake_c_api_kvpipe.c checks kvpipe's answers where Mooncake
 * leaves the outcome open (docs/mooncake-c-api.md).
 *
 * Against a real Mooncake: with env KVPIPE_MOONCAKE_TE_LIB (the path of
 * Mooncake's libtransfer_engine.so) and KVPIPE_MOONCAKE_TE_INCLUDE (the
 * folder holding its transfer_engine_c.h), the same source is compiled
 * against them and each role runs once on Mooncake against the other on
 * kvpipe, then again with KVPIPE_INTEGRITY=1 (kvpipe keeps Mooncake's wire
 * and says the peer goes unchecked). Without them that case is skipped
 * (ctest shows mooncake_c_api_real_test as skipped). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "servers.h"
#include "test.h"

#ifndef KVPT_MC_PROG
#define KVPT_MC_PROG ""
#endif
#ifndef KVPT_MC_KVPIPE
#define KVPT_MC_KVPIPE ""
#endif
#ifndef KVPT_MC_PROG_SRC
#define KVPT_MC_PROG_SRC ""
#endif

/* Run target then initiator (each its own program), both must print ok and
 * exit 0 within 60 s; the initiator's log must hold ilog_has (NULL: any). */
static void run_pair_with(const char *target_prog, const char *initiator_prog, const char *metadata,
                          const char *ilog_has)
{
    char dir[] = "/tmp/kvpt-mcapi.XXXXXX";
    REQUIRE(mkdtemp(dir));
    char info[300], tlog[300], ilog[300];
    snprintf(info, sizeof info, "%s/info", dir);
    snprintf(tlog, sizeof tlog, "%s/target.log", dir);
    snprintf(ilog, sizeof ilog, "%s/initiator.log", dir);
    /* tcp between the two, not the same-host shm path; Mooncake's RPC on
     * loopback too (else it takes the first interface's address). */
    setenv("KVPIPE_DISABLE_SHM", "1", 1);
    setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1", 1);
    /* With a store a segment is named by its local_server_name: each role
     * its own (over P2PHANDSHAKE the handshake's address names it). */
    char thost[64] = "127.0.0.1", ihost[64] = "127.0.0.1";
    if (strcmp(metadata, "P2PHANDSHAKE") != 0) {
        snprintf(thost, sizeof thost, "127.0.0.1:%d", kvpt_free_port());
        snprintf(ihost, sizeof ihost, "127.0.0.1:%d", kvpt_free_port());
    }
    char *targv[] = {(char *)target_prog, "target", (char *)metadata, thost, info, NULL};
    /* Where the initiator's log is looked at, its stderr (kvpipe's log)
     * goes into that file too. */
    char *iargv[] = {"/bin/sh",
                     "-c",
                     "exec \"$@\" 2>&1",
                     "sh",
                     (char *)initiator_prog,
                     "initiator",
                     (char *)metadata,
                     ihost,
                     info,
                     NULL};
    pid_t t = kvpt_spawn(targv, tlog);
    pid_t i = kvpt_spawn(ilog_has ? iargv : iargv + 4, ilog);
    int irc = kvpt_wait_child(i, 60000);
    int trc = kvpt_wait_child(t, 60000);
    CHECK(irc == 0);
    CHECK(trc == 0);
    CHECK(kvpt_wait_file_has(ilog, "ok: initiator", 1000) == 0);
    CHECK(kvpt_wait_file_has(tlog, "ok: target", 1000) == 0);
    int has = !ilog_has || kvpt_wait_file_has(ilog, ilog_has, 1000) == 0;
    CHECK(has);
    if (irc || trc || !has) {
        char cmd[700];
        snprintf(cmd, sizeof cmd, "cat %s %s >&2", tlog, ilog);
        if (system(cmd)) {
        }
    }
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd)) {
    }
}

static void run_pair(const char *target_prog, const char *initiator_prog, const char *metadata)
{
    run_pair_with(target_prog, initiator_prog, metadata, NULL);
}

static void p2p_kvpipe_both_sides(void)
{
    if (!*KVPT_MC_PROG) SKIP("built without KVP_MOONCAKE_C");
    run_pair(KVPT_MC_PROG, KVPT_MC_PROG, "P2PHANDSHAKE");
}

static void http_metadata_kvpipe_both_sides(void)
{
    if (!*KVPT_MC_PROG) SKIP("built without KVP_MOONCAKE_C");
    kvpt_server s = {0};
    REQUIRE(kvpt_http_cli_start(&s, NULL) == KVPT_SERVER_OK);
    run_pair(KVPT_MC_PROG, KVPT_MC_PROG, s.conn);
    kvpt_server_stop(&s);
}

/* Where Mooncake leaves the outcome open, kvpipe's (one process, two
 * engines): tests/compat/mooncake_c_api_kvpipe.c. */
static void kvpipe_answers(void)
{
    if (!*KVPT_MC_KVPIPE) SKIP("built without KVP_MOONCAKE_C");
    char dir[] = "/tmp/kvpt-mcapi.XXXXXX";
    REQUIRE(mkdtemp(dir));
    char log[300];
    snprintf(log, sizeof log, "%s/log", dir);
    setenv("KVPIPE_DISABLE_SHM", "1", 1);
    char *argv[] = {KVPT_MC_KVPIPE, NULL};
    int rc = kvpt_wait_child(kvpt_spawn(argv, log), 60000);
    CHECK(rc == 0);
    CHECK(kvpt_wait_file_has(log, "ok: kvpipe's answers", 1000) == 0);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "%scat %s >&2; rm -rf %s", rc ? "" : ": ", log, dir);
    if (system(cmd)) {
    }
}

/* The program built against Mooncake's own header and library. */
static int build_real(char *out, size_t cap)
{
    const char *lib = getenv("KVPIPE_MOONCAKE_TE_LIB");
    const char *inc = getenv("KVPIPE_MOONCAKE_TE_INCLUDE");
    if (!lib || !*lib || !inc || !*inc) return 1;
    snprintf(out, cap, "/tmp/kvpt-mcapi-real-%d", (int)getpid());
    char cmd[2048];
    char libdir[1024];
    snprintf(libdir, sizeof libdir, "%s", lib);
    char *slash = strrchr(libdir, '/');
    if (slash) *slash = '\0';
    snprintf(cmd, sizeof cmd, "cc -o %s %s -I%s %s -Wl,-rpath,%s >&2", out, KVPT_MC_PROG_SRC, inc,
             lib, slash ? libdir : ".");
    return system(cmd) ? -1 : 0;
}

static void real_mooncake(void)
{
    if (!*KVPT_MC_PROG) SKIP("built without KVP_MOONCAKE_C");
    char real[256];
    int rc = build_real(real, sizeof real);
    if (rc > 0)
        SKIP("no real Mooncake: set KVPIPE_MOONCAKE_TE_LIB=/path/libtransfer_engine.so and "
             "KVPIPE_MOONCAKE_TE_INCLUDE=/dir/with/transfer_engine_c.h "
             "(docs/mooncake-c-api.md)");
    REQUIRE(rc == 0);
    run_pair(real, KVPT_MC_PROG, "P2PHANDSHAKE");
    run_pair(KVPT_MC_PROG, real, "P2PHANDSHAKE");
    kvpt_server s = {0};
    REQUIRE(kvpt_http_cli_start(&s, NULL) == KVPT_SERVER_OK);
    run_pair(real, KVPT_MC_PROG, s.conn);
    run_pair(KVPT_MC_PROG, real, s.conn);
    kvpt_server_stop(&s);
    /* Integrity on at kvpipe's side (docs/reliability.md): a Mooncake peer
     * keeps its wire and is not checked, and the initiator says so. The
     * environment reaches both programs; Mooncake ignores the variable. */
    setenv("KVPIPE_INTEGRITY", "1", 1);
    run_pair_with(real, KVPT_MC_PROG, "P2PHANDSHAKE", "does not check integrity");
    run_pair(KVPT_MC_PROG, real, "P2PHANDSHAKE");
    unsetenv("KVPIPE_INTEGRITY");
    unlink(real);
}

int main(void)
{
    RUN(p2p_kvpipe_both_sides);
    RUN(http_metadata_kvpipe_both_sides);
    RUN(kvpipe_answers);
    RUN_T(real_mooncake, 300);
    return kvpt_summary();
}
