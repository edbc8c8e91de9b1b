/* The authenticated mode (docs/security.md) against a target's UCX worker: a
 * stranger speaking the ucx transport's control messages by hand, without a
 * key, with a wrong one, and replaying a recorded challenge, is refused; an
 * initiator with the key is served. Over UCX's tcp and shared-memory
 * lanes. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "common/clock.h"
#include "common/error.h"
#include "peer.h"
#include "metadata/metadata.h"
#include "test.h"
#include "transport/transport.h"
#if KVP_HAVE_UCX
#include "engine/descriptor.h"
#include "transport/ucx/ucx.h"
#endif

#define SEED 0xa17
#define LEN ((size_t)1 << 20)
#define WAIT_MS 10000 /* bounds a wait that succeeds at once when the code is right */

/* ---------------------------------------------------------------- ucx --- */

#if KVP_HAVE_UCX
/* A stranger on the target's UCX worker: a UCP worker of our own that speaks
 * the ucx transport's control messages by hand (transport/ucx/wire.h), so
 * that the test sees every byte the target answers. */
typedef struct raw_msg {
    unsigned id;
    size_t len;
    uint8_t data[4096];
} raw_msg;

typedef struct raw_ucx {
    ucp_context_h ctx;
    ucp_worker_h w;
    ucp_ep_h ep;
    raw_msg got[8];
    int n_got;
    struct raw_handler {
        struct raw_ucx *r;
        unsigned id;
    } h[8];
} raw_ucx;

static ucs_status_t raw_recv(void *arg, const void *header, size_t header_length, void *data,
                             size_t length, const ucp_am_recv_param_t *param)
{
    (void)header, (void)header_length, (void)param;
    struct raw_handler *h = arg;
    raw_ucx *r = h->r;
    if (r->n_got < 8 && length <= sizeof r->got[0].data) {
        r->got[r->n_got].id = h->id;
        r->got[r->n_got].len = length;
        memcpy(r->got[r->n_got].data, data, length);
        r->n_got++;
    }
    return UCS_OK;
}

static void raw_failed(void *arg, ucp_ep_h ep, ucs_status_t st)
{
    (void)arg, (void)ep, (void)st;
}

/* A worker with an endpoint to the target's worker (hex, from its descriptor). */
static int raw_open(raw_ucx *r, const char *worker_hex)
{
    memset(r, 0, sizeof *r);
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_AM | UCP_FEATURE_RMA};
    ucp_config_t *cfg;
    if (ucp_config_read(NULL, NULL, &cfg) != UCS_OK) return -1;
    const char *tls = getenv("UCX_TLS");
    if (tls && strstr(tls, "sm")) ucp_config_modify(cfg, "MM_ERROR_HANDLING", "y");
    ucs_status_t st = ucp_init(&p, cfg, &r->ctx);
    ucp_config_release(cfg);
    if (st != UCS_OK) return -1;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if (ucp_worker_create(r->ctx, &wp, &r->w) != UCS_OK) return -1;
    for (unsigned id = 1; id < 8; id++) {
        r->h[id] = (struct raw_handler){r, id};
        ucp_am_handler_param_t hp = {
            .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                          UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
            .id = id,
            .flags = UCP_AM_FLAG_WHOLE_MSG,
            .cb = raw_recv,
            .arg = &r->h[id]};
        if (ucp_worker_set_am_recv_handler(r->w, &hp) != UCS_OK) return -1;
    }
    void *addr;
    size_t len;
    if (kvpi_ucx_unhex(worker_hex, &addr, &len) != KVP_OK) return -1;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = addr,
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = raw_failed}};
    st = ucp_ep_create(r->w, &ep, &r->ep);
    free(addr);
    return st == UCS_OK ? 0 : -1;
}

static void raw_close(raw_ucx *r)
{
    if (r->ep) kvpi_ucx_ep_close_force(r->ep);
    if (r->w) {
        for (int i = 0; i < 100; i++)
            ucp_worker_progress(r->w);
        ucp_worker_destroy(r->w);
    }
    if (r->ctx) ucp_cleanup(r->ctx);
}

/* Progress until a message of id arrived (its index) or ms passed (-1). */
static int raw_wait(raw_ucx *r, unsigned id, int ms)
{
    uint64_t deadline = kvpi_deadline_ns(ms);
    int seen = 0;
    while (kvpi_now_ns() < deadline) {
        ucp_worker_progress(r->w);
        for (; seen < r->n_got; seen++)
            if (r->got[seen].id == id) return seen;
        usleep(100);
    }
    return -1;
}

static void raw_send(raw_ucx *r, unsigned id, const void *msg, size_t len)
{
    CHECK_OK(kvpi_ucx_am_send(r->ep, id, msg, len, UCP_AM_SEND_FLAG_REPLY));
}

/* A HELLO of epoch 0 with our worker address; authenticated (flag set) with
 * kid and nc when kid is non-NULL. */
static void raw_hello(raw_ucx *r, const uint8_t *kid, const uint8_t *nc)
{
    ucp_address_t *addr;
    size_t len;
    REQUIRE(ucp_worker_get_address(r->w, &addr, &len) == UCS_OK);
    uint8_t msg[4096];
    size_t head = kid ? KVPI_UCX_HELLO_AUTH_LEN : KVPI_UCX_HELLO_LEN;
    REQUIRE(head + len <= sizeof msg);
    uint64_t flags = kid ? KVPI_UCX_HELLO_FLAG_AUTH : 0;
    kvpi_put_le64(msg, KVPI_UCX_MAGIC | (uint64_t)KVPI_UCX_VERSION << 32 | flags << 48);
    kvpi_put_le64(msg + 8, 0);
    if (kid) {
        memcpy(msg + KVPI_UCX_HELLO_LEN, kid, KVPI_AUTH_KID_LEN);
        memcpy(msg + KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN, nc, KVPI_AUTH_NONCE_LEN);
    }
    memcpy(msg + head, addr, len);
    ucp_worker_release_address(r->w, addr);
    raw_send(r, KVPI_UCX_AM_HELLO, msg, head + len);
}

/* The status of a HELLO_ACK. */
static unsigned ack_status(const raw_msg *m)
{
    return (unsigned)(kvpi_get_le64(m->data) >> 32 & 0xffff);
}

/* The HELLO_ACK a stranger got is a bare refusal of status want: no
 * connection, no rkey (16 bytes, nothing after). */
static void refused_bare(raw_ucx *r, unsigned want)
{
    int i = raw_wait(r, KVPI_UCX_AM_HELLO_ACK, WAIT_MS);
    CHECK(i >= 0);
    if (i < 0) return;
    CHECK(ack_status(&r->got[i]) == want);
    CHECK(r->got[i].len == KVPI_UCX_HELLO_ACK_LEN);
    if (ack_status(&r->got[i]) != want)
        fprintf(stderr, "  HELLO_ACK status %u, want %u\n", ack_status(&r->got[i]), want);
}

/* The target's descriptor, asked for with the key; its worker address. */
static cJSON *ucx_desc(const kvpt_target *t, const kvpi_auth *a, char *worker, size_t len)
{
    char *reply = NULL;
    if (kvpi_rpc_call_auth("127.0.0.1", t->rpc_port, a, KVPI_RPC_METADATA, "{}", WAIT_MS, &reply) !=
        KVP_OK)
        return NULL;
    cJSON *d = cJSON_Parse(reply);
    free(reply);
    const cJSON *u = cJSON_GetObjectItemCaseSensitive(d, KVPI_UCX_FIELD);
    const cJSON *w = cJSON_GetObjectItemCaseSensitive(u, "worker");
    if (!cJSON_IsString(w)) {
        cJSON_Delete(d);
        return NULL;
    }
    snprintf(worker, len, "%s", w->valuestring);
    return d;
}

/* A challenge answered with the key: the CHALLENGE's MAC checks, and the
 * PROOF (written into proof) gets the rkeys. Returns the HELLO_ACK's index. */
static int raw_prove(raw_ucx *r, const kvpi_auth *a, const uint8_t *kid, const uint8_t *nc,
                     uint8_t chal[KVPI_UCX_CHALLENGE_LEN], uint8_t proof[KVPI_UCX_PROOF_LEN])
{
    raw_hello(r, kid, nc);
    int i = raw_wait(r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    CHECK(i >= 0 && r->got[i].len == KVPI_UCX_CHALLENGE_LEN);
    if (i < 0 || r->got[i].len != KVPI_UCX_CHALLENGE_LEN) return -1;
    memcpy(chal, r->got[i].data, KVPI_UCX_CHALLENGE_LEN);
    const uint8_t *ns = chal + 16;
    CHECK(kvpi_auth_mac_check(a, kid, "server", "ucx", nc, ns, ns + KVPI_AUTH_NONCE_LEN) == 0);
    kvpi_put_le64(proof, KVPI_UCX_MAGIC);
    memcpy(proof + 8, chal + 8, 8);
    CHECK(kvpi_auth_mac(a, kid, "client", "ucx", nc, ns, proof + 16) == 0);
    raw_send(r, KVPI_UCX_AM_PROOF, proof, KVPI_UCX_PROOF_LEN);
    return raw_wait(r, KVPI_UCX_AM_HELLO_ACK, WAIT_MS);
}

/* Whether a HELLO_ACK holds an rkey entry for [addr, +len). */
static int ack_has_rkey(const raw_msg *m, uint64_t addr, uint64_t len)
{
    size_t n = (size_t)(kvpi_get_le64(m->data) >> 48);
    size_t at = KVPI_UCX_HELLO_ACK_LEN + 16 * n;
    if (at + 8 > m->len) return 0;
    uint64_t count = kvpi_get_le64(m->data + at);
    at += 8;
    for (uint64_t j = 0; j < count && at + 24 <= m->len; j++) {
        uint64_t klen = kvpi_get_le64(m->data + at + 16);
        if (kvpi_get_le64(m->data + at) == addr && kvpi_get_le64(m->data + at + 8) == len &&
            klen > 0)
            return 1;
        at += 24 + (klen + 7) / 8 * 8;
    }
    return 0;
}

/* The ucx transport of this process opened on the target's descriptor
 * directly (what an engine's lookup does once the descriptor passed), with
 * key a (NULL: none). */
static kvp_status ucx_peer_try(const cJSON *desc_json, const kvpi_auth *a, const char *segment)
{
    char *text = cJSON_PrintUnformatted(desc_json);
    kvpi_descriptor d;
    kvp_status st = text ? kvpi_descriptor_parse(text, &d) : KVP_ENOMEM;
    free(text);
    if (st) return st;
    kvpi_region_table regions;
    kvpi_region_table_init(&regions);
    kvpi_server_ctx sc = {.segment = "auth-test",
                          .host = "127.0.0.1",
                          .regions = &regions,
                          .timeout_ms = 3000,
                          .auth = a};
    void *server = NULL;
    if ((st = kvpi_transport_ucx.server_start(&sc, &server))) {
        kvpi_region_table_destroy(&regions);
        kvpi_descriptor_free(&d);
        return st;
    }
    kvpi_peer_ctx pc = {.segment = segment,
                        .host = "127.0.0.1",
                        .desc = d.json,
                        .regions = d.regions,
                        .buffers = d.buffers,
                        .n_regions = d.n_regions,
                        .server = server,
                        .timeout_ms = 3000,
                        .auth = a};
    void *peer = NULL;
    st = kvpi_transport_ucx.peer_open(&pc, &peer);
    char why[512];
    snprintf(why, sizeof why, "%s", kvp_last_error());
    if (peer) kvpi_transport_ucx.peer_close(peer);
    kvpi_transport_ucx.server_stop(server);
    kvpi_region_table_destroy(&regions);
    kvpi_descriptor_free(&d);
    if (st) kvpi_error(st, "%s", why);
    return st;
}

/* The ucx transport in the authenticated mode, on UCX's tcp or shared
 * memory: its descriptor carries no rkey; a stranger on its worker gets no
 * rkey without the key (a plain HELLO, a key it does not hold, a wrong
 * proof); a recorded proof replayed fails on the fresh nonce; our
 * transport without the key, or with another, is refused with KVP_EAUTH;
 * an engine with the key reads through ucx. */
static void ucx_refuses_strangers(const char *tls)
{
    if (!kvpi_transport_lookup("ucx")) SKIP("no ucx transport in this build");
    setenv("UCX_TLS", tls, 1); /* the target inherits it */
    kvpt_keys_make();
    kvpi_auth *good = kvpt_auth_load(kvpt_key1), *bad = kvpt_auth_load(kvpt_key2);
    REQUIRE(good && bad);
    kvpt_target t;
    kvpt_target_opts o = {
        .protocol = "rdma", .len = LEN, .seed = SEED, .disable_shm = 1, .timeout_ms = 3000};
    REQUIRE(kvpt_auth_target(&o, &t, kvpt_key1) == 0);
    const char *log = t.peer.err;
    uint64_t addr = (uint64_t)(uintptr_t)t.buf;
    char worker[4096];
    cJSON *desc = ucx_desc(&t, good, worker, sizeof worker);
    REQUIRE(desc);
    /* The descriptor: the endpoint says it authenticates, no buffer has an rkey. */
    {
        char *text = cJSON_PrintUnformatted(desc);
        CHECK(text && strstr(text, "\"" KVPI_UCX_FIELD "\":{") && strstr(text, "\"auth\":true"));
        CHECK(text && !strstr(text, KVPI_UCX_RKEY_FIELD) && strstr(text, "\"buffers\""));
        free(text);
    }
    uint8_t kid[KVPI_AUTH_KID_LEN], bad_kid[KVPI_AUTH_KID_LEN], nc[KVPI_AUTH_NONCE_LEN];
    kvpi_auth_kid_bytes(good, kid);
    kvpi_auth_kid_bytes(bad, bad_kid);
    kvpi_auth_nonce(nc);
    raw_ucx r;
    /* A plain HELLO (kvpipe without the key, or an older one). */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, NULL, NULL);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_REQUIRED);
    raw_close(&r);
    /* A key the target does not hold. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, bad_kid, nc);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_KEY);
    CHECK(raw_wait(&r, KVPI_UCX_AM_CHALLENGE, 0) < 0);
    raw_close(&r);
    /* The right key id, a proof that is not the key's. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, kid, nc);
    int i = raw_wait(&r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    REQUIRE(i >= 0);
    uint8_t forged[KVPI_UCX_PROOF_LEN];
    kvpi_put_le64(forged, KVPI_UCX_MAGIC);
    memcpy(forged + 8, r.got[i].data + 8, 8);
    kvpi_auth_nonce(forged + 16);
    raw_send(&r, KVPI_UCX_AM_PROOF, forged, sizeof forged);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_PROOF);
    raw_close(&r);
    /* With the key: the rkey of the buffer comes with the answer. */
    uint8_t chal[KVPI_UCX_CHALLENGE_LEN], proof[KVPI_UCX_PROOF_LEN];
    REQUIRE(raw_open(&r, worker) == 0);
    i = raw_prove(&r, good, kid, nc, chal, proof);
    CHECK(i >= 0 && ack_status(&r.got[i]) == KVPI_UCX_HELLO_OK);
    CHECK(i >= 0 && ack_has_rkey(&r.got[i], addr, LEN));
    raw_close(&r);
    /* That HELLO and PROOF replayed: a fresh nonce of the target's, so the
     * recorded proof (as recorded, and with the new challenge's id) fails. */
    REQUIRE(raw_open(&r, worker) == 0);
    raw_hello(&r, kid, nc);
    i = raw_wait(&r, KVPI_UCX_AM_CHALLENGE, WAIT_MS);
    REQUIRE(i >= 0);
    CHECK(memcmp(r.got[i].data + 16, chal + 16, KVPI_AUTH_NONCE_LEN) != 0);
    raw_send(&r, KVPI_UCX_AM_PROOF, proof, sizeof proof);
    CHECK(raw_wait(&r, KVPI_UCX_AM_HELLO_ACK, 300) < 0); /* not its challenge: ignored */
    memcpy(proof + 8, r.got[i].data + 8, 8);
    raw_send(&r, KVPI_UCX_AM_PROOF, proof, sizeof proof);
    refused_bare(&r, KVPI_UCX_HELLO_AUTH_PROOF);
    raw_close(&r);
    /* Our own transport: without a key it says the segment is
     * authenticated; with another key the target refuses it. */
    CHECK_ST(ucx_peer_try(desc, NULL, t.name), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "is authenticated") && strstr(kvp_last_error(), t.name));
    CHECK_ST(ucx_peer_try(desc, bad, t.name), KVP_EAUTH);
    CHECK(strstr(kvp_last_error(), "refused our key") && strstr(kvp_last_error(), t.name));
    CHECK_OK(ucx_peer_try(desc, good, t.name));
    /* Engines: with the key through ucx, and still after all that - with
     * the rkeys of a thousand regions in the HELLO's answer, more than an
     * eager message of UCX carries in one fragment. */
    for (int k = 0; k < 1000; k++)
        REQUIRE(kvpt_target_cmd(&t, KVPT_T_REGISTER, 4096, WAIT_MS) >= 0);
    kvp_engine_opts eo;
    kvp_engine_opts_init(&eo);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", kvpt_free_port());
    eo.local_server_name = name;
    eo.metadata = "P2PHANDSHAKE";
    eo.protocol = "rdma";
    eo.disable_shm = 1;
    eo.auth_key_file = kvpt_key1;
    kvp_engine *e = NULL;
    REQUIRE_OK(kvp_engine_create(&eo, &e));
    CHECK(kvpt_read_ok(e, t.name, &t, SEED, "ucx"));
    kvp_engine_destroy(e);
    cJSON_Delete(desc);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    /* Refusals logged, rate-limited: one line for the lot. */
    int lines = kvpt_file_lines(log, "refused a connection");
    CHECK(lines >= 1 && lines <= 2);
    kvpt_keep_log_if_failed(log);
    kvpi_auth_free(good);
    kvpi_auth_free(bad);
    kvpt_keys_drop();
}

/* An impostor at the worker address an authenticated descriptor names
 * cannot pass as the target: it answers our HELLO with a CHALLENGE it
 * recorded from the genuine target, which fails on our fresh nonce; our
 * transport sends it no proof and fails with KVP_EAUTH. */
typedef struct open_run {
    const cJSON *desc;
    const kvpi_auth *auth;
    kvp_status st;
    char err[512];
    int done;
} open_run;

static void *open_main(void *arg)
{
    open_run *o = arg;
    o->st = ucx_peer_try(o->desc, o->auth, "impostor");
    snprintf(o->err, sizeof o->err, "%s", kvp_last_error());
    __atomic_store_n(&o->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void ucx_replayed_challenge_fails(const char *tls)
{
    if (!kvpi_transport_lookup("ucx")) SKIP("no ucx transport in this build");
    setenv("UCX_TLS", tls, 1);
    kvpt_keys_make();
    kvpi_auth *good = kvpt_auth_load(kvpt_key1);
    REQUIRE(good);
    kvpt_target t;
    kvpt_target_opts o = {.protocol = "rdma", .len = LEN, .seed = SEED, .disable_shm = 1};
    REQUIRE(kvpt_auth_target(&o, &t, kvpt_key1) == 0);
    const char *log = t.peer.err;
    char worker[4096];
    cJSON *desc = ucx_desc(&t, good, worker, sizeof worker);
    REQUIRE(desc);
    /* Record a genuine challenge. */
    uint8_t kid[KVPI_AUTH_KID_LEN], nc[KVPI_AUTH_NONCE_LEN];
    uint8_t chal[KVPI_UCX_CHALLENGE_LEN], proof[KVPI_UCX_PROOF_LEN];
    kvpi_auth_kid_bytes(good, kid);
    kvpi_auth_nonce(nc);
    raw_ucx r;
    REQUIRE(raw_open(&r, worker) == 0);
    CHECK(raw_prove(&r, good, kid, nc, chal, proof) >= 0);
    raw_close(&r);
    /* The impostor: a worker of ours, named in a copy of the descriptor. */
    raw_ucx imp;
    REQUIRE(raw_open(&imp, worker) == 0);
    ucp_address_t *addr;
    size_t len;
    REQUIRE(ucp_worker_get_address(imp.w, &addr, &len) == UCS_OK);
    char *hex = kvpi_ucx_hex(addr, len);
    ucp_worker_release_address(imp.w, addr);
    cJSON *fake = cJSON_Duplicate(desc, 1);
    cJSON *u = cJSON_GetObjectItemCaseSensitive(fake, KVPI_UCX_FIELD);
    cJSON_ReplaceItemInObjectCaseSensitive(u, "worker", cJSON_CreateString(hex));
    free(hex);
    open_run run = {.desc = fake, .auth = good};
    pthread_t th;
    pthread_create(&th, NULL, open_main, &run);
    int i = raw_wait(&imp, KVPI_UCX_AM_HELLO, WAIT_MS);
    REQUIRE(i >= 0 && imp.got[i].len > KVPI_UCX_HELLO_AUTH_LEN);
    const uint8_t *h = imp.got[i].data;
    CHECK(kvpi_get_le64(h) >> 48 & KVPI_UCX_HELLO_FLAG_AUTH);
    CHECK(memcmp(h + KVPI_UCX_HELLO_LEN + KVPI_AUTH_KID_LEN, nc, KVPI_AUTH_NONCE_LEN) != 0);
    /* Answer on an endpoint back to the initiator's worker. */
    ucp_ep_h back;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)(h + KVPI_UCX_HELLO_AUTH_LEN),
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = raw_failed}};
    REQUIRE(ucp_ep_create(imp.w, &ep, &back) == UCS_OK);
    CHECK_OK(kvpi_ucx_am_send(back, KVPI_UCX_AM_CHALLENGE, chal, sizeof chal, 0));
    uint64_t deadline = kvpi_deadline_ns(WAIT_MS);
    while (!__atomic_load_n(&run.done, __ATOMIC_ACQUIRE) && kvpi_now_ns() < deadline) {
        ucp_worker_progress(imp.w);
        usleep(100);
    }
    pthread_join(th, NULL);
    CHECK(run.st == KVP_EAUTH && strstr(run.err, "failed to prove"));
    if (run.st != KVP_EAUTH) fprintf(stderr, "  impostor: %s\n", run.err);
    for (int k = 0; k < 50; k++) /* whatever else came in */
        ucp_worker_progress(imp.w);
    CHECK(raw_wait(&imp, KVPI_UCX_AM_PROOF, 0) < 0); /* no proof went to it */
    kvpi_ucx_ep_close_force(back);
    raw_close(&imp);
    cJSON_Delete(fake);
    cJSON_Delete(desc);
    CHECK(kvpt_target_stop(&t, 0) == 0);
    unlink(log);
    kvpi_auth_free(good);
    kvpt_keys_drop();
}

static void ucx_tcp_refuses_strangers(void)
{
    ucx_refuses_strangers("tcp");
}

static void ucx_sm_refuses_strangers(void)
{
    ucx_refuses_strangers("sm,self");
}

static void ucx_tcp_replayed_challenge_fails(void)
{
    ucx_replayed_challenge_fails("tcp");
}

static void ucx_sm_replayed_challenge_fails(void)
{
    ucx_replayed_challenge_fails("sm,self");
}
#endif

int main(void)
{
    unsetenv(KVPI_AUTH_ENV);
#if KVP_HAVE_UCX
    RUN(ucx_tcp_refuses_strangers);
    RUN(ucx_sm_refuses_strangers);
    RUN(ucx_tcp_replayed_challenge_fails);
    RUN(ucx_sm_replayed_challenge_fails);
#endif
    return kvpt_summary();
}
