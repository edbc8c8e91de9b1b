/* The authenticated mode's keys (docs/security.md): key files are checked
 * (mode, format), a rotated key file still accepts the old key, and a
 * transport that does not authenticate is left out of an authenticated
 * engine's descriptor. (auth_listeners_test, auth_store_test and
 * auth_ucx_test try the listeners of an authenticated target.) */
#include <sys/socket.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "peer.h"
#include "engine/engine_internal.h"
#include "test.h"
#include "transport/shm_internal.h"

#define WAIT_MS 10000 /* bounds a wait that succeeds at once when the code is right */

/* ---------------------------------------------------------- key files --- */

static void key_files(void)
{
    kvpt_keys_make();
    kvpi_auth *a = NULL;
    char path[64];
    CHECK_ST(kvpi_auth_load("/nonexistent/kvpipe.key", &a), KVP_ECONFIG);
    kvpt_key_file(path, sizeof path, "0123456789abcdef0123456789abcdef\n", 0644);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "chmod 600"));
    unlink(path);
    kvpt_key_file(path, sizeof path, "short\n", 0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "line 1"));
    unlink(path);
    kvpt_key_file(path, sizeof path, "# nothing but a comment\n\n", 0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "holds no key"));
    unlink(path);
    kvpt_key_file(path, sizeof path,
                  "0123456789abcdef0123456789abcdef1\n0123456789abcdef0123456789abcdef2\n"
                  "0123456789abcdef0123456789abcdef3\n0123456789abcdef0123456789abcdef4\n"
                  "0123456789abcdef0123456789abcdef5\n",
                  0600);
    CHECK_ST(kvpi_auth_load(path, &a), KVP_ECONFIG);
    unlink(path);
    CHECK(a == NULL);
    /* Off unless asked for: "" and an unset env. */
    unsetenv(KVPI_AUTH_ENV);
    CHECK_OK(kvpi_auth_resolve(NULL, &a));
    CHECK(a == NULL);
    setenv(KVPI_AUTH_ENV, kvpt_key1, 1);
    CHECK_OK(kvpi_auth_resolve("", &a));
    CHECK(a == NULL);
    CHECK_OK(kvpi_auth_resolve(NULL, &a));
    CHECK(a != NULL);
    kvpi_auth_free(a);
    unsetenv(KVPI_AUTH_ENV);
    /* An engine with an unusable key file does not start. */
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = "P2PHANDSHAKE";
    eo.auth_key_file = "/nonexistent/kvpipe.key";
    kvp_engine *e = NULL;
    CHECK_ST(kvp_engine_create(&eo, &e), KVP_ECONFIG);
    CHECK(strstr(kvp_last_error(), "/nonexistent/kvpipe.key"));
    kvpt_keys_drop();
}

/* The rotation story: a process whose file holds (new, old) proves with new
 * and accepts both; one holding only old then still gets in, and signs
 * descriptors the other accepts. */
static void rotation(void)
{
    kvpt_keys_make();
    char both[64];
    kvpt_key_file(both, sizeof both,
                  "fedcba9876543210fedcba9876543210-two\n0123456789abcdef0123456789abcdef-one\n",
                  0600);
    kvpi_auth *old = kvpt_auth_load(kvpt_key1), *rotated = kvpt_auth_load(both),
              *other = kvpt_auth_load(kvpt_key2);
    REQUIRE(old && rotated && other);
    int sv[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0);
    pid_t pid = fork();
    if (pid == 0) _exit(kvpi_auth_server(rotated, sv[1], "tcp", kvpi_deadline_ns(WAIT_MS)));
    CHECK_OK(kvpi_auth_client(old, sv[0], "tcp", kvpi_deadline_ns(WAIT_MS)));
    CHECK(kvpt_wait_child(pid, WAIT_MS) == 0);
    char *signed_old = kvpi_auth_desc_sign(old, "{\"name\":\"h:1\"}");
    char *signed_new = kvpi_auth_desc_sign(rotated, "{\"name\":\"h:1\"}");
    CHECK_OK(kvpi_auth_desc_verify(rotated, signed_old, "h:1", 0));
    CHECK_OK(kvpi_auth_desc_verify(other, signed_new, "h:1", 0)); /* "two" is other's key */
    CHECK_ST(kvpi_auth_desc_verify(old, signed_new, "h:1", 0), KVP_EAUTH);
    free(signed_old);
    free(signed_new);
    close(sv[0]);
    close(sv[1]);
    unlink(both);
    kvpi_auth_free(old);
    kvpi_auth_free(rotated);
    kvpi_auth_free(other);
    kvpt_keys_drop();
}

/* A transport that does not declare KVPI_CAP_AUTH is not run in the
 * authenticated mode: the engine leaves it out of its descriptor, so no peer
 * without the key finds a way in through it. Every transport built
 * authenticates, so shown with a copy of the shm transport's table without
 * the flag. */
static int describes(const kvpi_transport_ops *const *list, const char *key, const char *field)
{
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    eo.local_server_name = "127.0.0.1:0";
    eo.metadata = "P2PHANDSHAKE";
    eo.auth_key_file = key;
    kvp_engine *e = NULL;
    if (kvpi_engine_create_with(&eo, list, &e) != KVP_OK) {
        fprintf(stderr, "  engine: %s\n", kvp_last_error());
        return -1;
    }
    static char buf[4096];
    kvpi_auth *a = *key ? kvpt_auth_load(key) : NULL;
    char *reply = NULL;
    kvp_status st = kvp_engine_register(e, buf, sizeof buf);
    if (!st)
        st = kvpi_rpc_call_auth("127.0.0.1", kvp_engine_rpc_port(e), a, KVPI_RPC_METADATA, "{}",
                                WAIT_MS, &reply);
    int has = !st && reply && strstr(reply, "\"buffers\"") ? strstr(reply, field) != NULL : -1;
    free(reply);
    kvpi_auth_free(a);
    kvp_engine_destroy(e);
    return has;
}

static void unauthenticated_transport_left_out(void)
{
    kvpt_keys_make();
    kvpi_transport_ops plain = kvpi_transport_shm;
    plain.caps &= ~KVPI_CAP_AUTH;
    const kvpi_transport_ops *with[] = {&kvpi_transport_tcp, &kvpi_transport_shm, NULL};
    const kvpi_transport_ops *without[] = {&kvpi_transport_tcp, &plain, NULL};
    const char *field = "\"" KVPI_SHM_FIELD "\"";
    CHECK(describes(with, kvpt_key1, field) == 1);
    CHECK(describes(without, "", field) == 1);
    CHECK(describes(without, kvpt_key1, field) == 0);
    kvpt_keys_drop();
}

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
    RUN(key_files);
    RUN(rotation);
    RUN(unauthenticated_transport_left_out);
    return kvpt_summary();
}
