/* The tensor type and the safetensors codec of pipe messages. */
#include <stdlib.h>
#include <string.h>

#include "common/net.h"
#include "kvpipe/tensor.h"
#include "pipe/safetensors.h"
#include "test.h"

/* Encode t into a malloc'ed buffer of exactly the encoded size. */
static uint8_t *encode(const kvp_tensor *t, size_t *len)
{
    size_t n;
    if (kvpi_safetensors_size(t, &n) != KVP_OK) return NULL;
    uint8_t *buf = malloc(n);
    size_t written = 0;
    if (!buf || kvpi_safetensors_write(t, buf, n, &written) != KVP_OK || written != n) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

/* A message built from header text and data bytes, as another writer could. */
static uint8_t *craft(const char *header, size_t data_len, size_t *len)
{
    size_t h = strlen(header);
    uint8_t *buf = calloc(1, 8 + h + data_len + 1);
    kvpi_put_le64(buf, h);
    memcpy(buf + 8, header, h);
    *len = 8 + h + data_len;
    return buf;
}

static kvp_status parse_header(const char *header, size_t data_len)
{
    size_t len;
    uint8_t *buf = craft(header, data_len, &len);
    kvp_tensor t;
    kvp_status st = kvpi_safetensors_parse(buf, len, &t);
    free(buf);
    return st;
}

static void test_dtype_names(void)
{
    for (int i = 0; i < KVP_DTYPE_COUNT; i++) {
        const char *name = kvp_dtype_name((kvp_dtype)i);
        REQUIRE(name != NULL);
        kvp_dtype back;
        CHECK_OK(kvp_dtype_from_name(name, &back));
        CHECK(back == (kvp_dtype)i);
        CHECK(kvp_dtype_size((kvp_dtype)i) >= 1);
    }
    CHECK(kvp_dtype_size(KVP_DTYPE_BF16) == 2);
    CHECK(kvp_dtype_size(KVP_DTYPE_F8_E5M2) == 1);
    CHECK(kvp_dtype_size(KVP_DTYPE_I64) == 8);
    CHECK(kvp_dtype_size(KVP_DTYPE_COUNT) == 0);
    CHECK(kvp_dtype_name(KVP_DTYPE_COUNT) == NULL);
    kvp_dtype d;
    CHECK_ST(kvp_dtype_from_name("f32", &d), KVP_EINVAL);
    CHECK_ST(kvp_dtype_from_name("F128", &d), KVP_EINVAL);
}

static void test_tensor_size(void)
{
    size_t numel, nbytes;
    int64_t s[3] = {2, 3, 4};
    CHECK_OK(kvp_tensor_size(KVP_DTYPE_F32, 3, s, &numel, &nbytes));
    CHECK(numel == 24 && nbytes == 96);
    CHECK_OK(kvp_tensor_size(KVP_DTYPE_F64, 0, NULL, &numel, &nbytes));
    CHECK(numel == 1 && nbytes == 8);
    int64_t z[2] = {0, 7};
    CHECK_OK(kvp_tensor_size(KVP_DTYPE_I16, 2, z, &numel, &nbytes));
    CHECK(numel == 0 && nbytes == 0);
    int64_t neg[2] = {3, -1};
    CHECK_ST(kvp_tensor_size(KVP_DTYPE_U8, 2, neg, NULL, &nbytes), KVP_EINVAL);
    int64_t big[3] = {1LL << 40, 1LL << 40, 0};
    CHECK_ST(kvp_tensor_size(KVP_DTYPE_U8, 3, big, NULL, &nbytes), KVP_EINVAL);
    int64_t bytes_over[1] = {INT64_MAX / 2};
    CHECK_ST(kvp_tensor_size(KVP_DTYPE_I64, 1, bytes_over, NULL, &nbytes), KVP_EINVAL);
    CHECK_ST(kvp_tensor_size(KVP_DTYPE_U8, KVP_TENSOR_MAX_NDIM + 1, s, NULL, &nbytes), KVP_EINVAL);
    CHECK_ST(kvp_tensor_size((kvp_dtype)99, 1, s, NULL, &nbytes), KVP_EINVAL);
    kvp_tensor t;
    CHECK_ST(kvp_tensor_init(&t, KVP_DTYPE_U8, 1, s, NULL), KVP_EINVAL);
    CHECK_OK(kvp_tensor_init(&t, KVP_DTYPE_U8, 2, z, NULL));
}

static int released;
static void count_release(void *owner, void *data)
{
    (void)data;
    released += *(int *)owner;
}

static void test_tensor_ownership(void)
{
    int64_t s[1] = {16};
    kvp_tensor *t;
    REQUIRE_OK(kvp_tensor_alloc(KVP_DTYPE_F32, 1, s, &t));
    CHECK(t->nbytes == 64 && t->data != NULL);
    CHECK(((float *)t->data)[15] == 0.0f);
    kvp_tensor_free(t);
    static float mem[4];
    int one = 1;
    int64_t s4[1] = {4};
    REQUIRE_OK(kvp_tensor_wrap(KVP_DTYPE_F32, 1, s4, mem, count_release, &one, &t));
    CHECK(t->data == mem);
    released = 0;
    kvp_tensor_free(t);
    CHECK(released == 1);
    kvp_tensor_free(NULL);
}

static void round_trip(kvp_dtype dtype, int ndim, const int64_t *shape, uint64_t seed)
{
    size_t nbytes;
    REQUIRE_OK(kvp_tensor_size(dtype, ndim, shape, NULL, &nbytes));
    void *data = malloc(nbytes ? nbytes : 1);
    kvpt_fill(data, nbytes, seed);
    kvp_tensor t;
    REQUIRE_OK(kvp_tensor_init(&t, dtype, ndim, shape, data));
    size_t len = 0;
    uint8_t *buf = encode(&t, &len);
    REQUIRE(buf != NULL);
    uint64_t hlen = kvpi_get_le64(buf);
    CHECK(hlen % 8 == 0);
    CHECK(len == 8 + hlen + nbytes);
    kvp_tensor back;
    CHECK_OK(kvpi_safetensors_parse(buf, len, &back));
    CHECK(kvp_tensor_equal(&t, &back));
    CHECK((uint8_t *)back.data == buf + 8 + hlen); /* in place, no copy */
    CHECK(back.release == NULL);
    free(buf);
    free(data);
}

static void test_round_trip_every_dtype(void)
{
    int64_t shape[3] = {3, 5, 7};
    for (int d = 0; d < KVP_DTYPE_COUNT; d++)
        round_trip((kvp_dtype)d, 3, shape, 100 + d);
}

static void test_round_trip_0d_and_empty(void)
{
    for (int d = 0; d < KVP_DTYPE_COUNT; d++)
        round_trip((kvp_dtype)d, 0, NULL, 7);
    int64_t z1[2] = {0, 4}, z2[3] = {4, 0, 2}, z3[1] = {0};
    round_trip(KVP_DTYPE_F32, 2, z1, 1);
    round_trip(KVP_DTYPE_BF16, 3, z2, 1);
    round_trip(KVP_DTYPE_I64, 1, z3, 1);
    int64_t many[KVP_TENSOR_MAX_NDIM];
    for (int i = 0; i < KVP_TENSOR_MAX_NDIM; i++)
        many[i] = 1;
    many[3] = 3;
    round_trip(KVP_DTYPE_U8, KVP_TENSOR_MAX_NDIM, many, 9);
}

/* The bytes safetensors itself writes for {"tensor": float32 [[1, 2]]}. */
static void test_wire_format(void)
{
    float v[2] = {1.0f, 2.0f};
    int64_t s[2] = {1, 2};
    kvp_tensor t;
    REQUIRE_OK(kvp_tensor_init(&t, KVP_DTYPE_F32, 2, s, v));
    size_t len;
    uint8_t *buf = encode(&t, &len);
    REQUIRE(buf != NULL);
    const char *want = "{\"tensor\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]}}";
    size_t wl = strlen(want), padded = (wl + 7) / 8 * 8;
    CHECK(kvpi_get_le64(buf) == padded);
    CHECK(memcmp(buf + 8, want, wl) == 0);
    for (size_t i = wl; i < padded; i++)
        CHECK(buf[8 + i] == ' ');
    CHECK(memcmp(buf + 8 + padded, v, 8) == 0);
    CHECK(len == 8 + padded + 8);
    free(buf);
    /* The None sentinel as vLLM sends it: int64 [-150886311]. */
    int64_t none = -150886311, one = 1;
    REQUIRE_OK(kvp_tensor_init(&t, KVP_DTYPE_I64, 1, &one, &none));
    buf = encode(&t, &len);
    REQUIRE(buf != NULL);
    CHECK(strstr((char *)buf + 8, "\"dtype\":\"I64\",\"shape\":[1]") != NULL);
    free(buf);
}

static void test_parse_foreign_writers(void)
{
    /* Metadata, other key order, unpadded header: all legal safetensors. */
    CHECK_OK(parse_header("{\"__metadata__\":{\"format\":\"pt\"},\"tensor\":{\"shape\":[2],"
                          "\"data_offsets\":[0,8],\"dtype\":\"F32\"}}",
                          8));
    CHECK_OK(parse_header("{ \"tensor\" : { \"dtype\" : \"U8\", \"shape\" : [ ], "
                          "\"data_offsets\" : [ 0, 1 ] } }   \n",
                          1));
    CHECK_OK(
        parse_header("{\"tensor\":{\"dtype\":\"F16\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0));
}

static void test_malformed(void)
{
    uint8_t small[7] = {0};
    kvp_tensor t;
    CHECK_ST(kvpi_safetensors_parse(small, sizeof small, &t), KVP_EPROTO);
    /* header length beyond the buffer, beyond the limit, and absurd */
    uint8_t hdr[64] = {0};
    kvpi_put_le64(hdr, 57);
    memcpy(hdr + 8, "{}", 2);
    CHECK_ST(kvpi_safetensors_parse(hdr, sizeof hdr, &t), KVP_EPROTO);
    kvpi_put_le64(hdr, (uint64_t)KVPI_SAFETENSORS_MAX_HEADER + 1);
    CHECK_ST(kvpi_safetensors_parse(hdr, sizeof hdr, &t), KVP_EPROTO);
    kvpi_put_le64(hdr, UINT64_MAX - 3);
    CHECK_ST(kvpi_safetensors_parse(hdr, sizeof hdr, &t), KVP_EPROTO);
    kvpi_put_le64(hdr, 0);
    CHECK_ST(kvpi_safetensors_parse(hdr, sizeof hdr, &t), KVP_EPROTO);

    static const struct {
        const char *header;
        size_t data;
    } bad[] = {
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8}, /* bad JSON */
        {"[1,2,3]", 0},
        {"{\"tensor\":{\"dtype\":\"F33\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":32,\"shape\":[2],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 12},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,12]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 12},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,9]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,-8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":2,\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,8]}}", 8},
        {"{\"tensor\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,4294967296],"
         "\"data_offsets\":[0,0]}}",
         0},
        {"{\"tensor\":{\"dtype\":\"U8\",\"shape\":[9007199254740992,9007199254740992,0],"
         "\"data_offsets\":[0,0]}}",
         0},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8],\"x\":1}}", 8},
        {"{\"tensor\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
         8},
        {"{\"tensor\":[1]}", 0},
        {"{\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"other\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
         2},
        {"{\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}",
         1},
        {"{\"other\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1},
        {"{}", 0},
        {"{\"__metadata__\":{\"a\":1},\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],"
         "\"data_offsets\":[0,1]}}",
         1},
        {"{\"__metadata__\":[],\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],"
         "\"data_offsets\":[0,1]}}",
         1},
        {"{\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}} x", 1},
        {" {\"tensor\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        kvp_status st = parse_header(bad[i].header, bad[i].data);
        if (st != KVP_EPROTO) fprintf(stderr, "  case %zu: %s\n", i, bad[i].header);
        CHECK_ST(st, KVP_EPROTO);
        CHECK(kvp_last_error()[0] != '\0');
    }
    /* A header with a NUL byte inside a string. */
    char nul[] = "{\"tensor\":{\"dtype\":\"U8\\u0000\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    CHECK_ST(parse_header(nul, 1), KVP_EPROTO);
    /* too many dimensions */
    char many[512] = "{\"tensor\":{\"dtype\":\"U8\",\"shape\":[";
    for (int i = 0; i <= KVP_TENSOR_MAX_NDIM; i++)
        strcat(many, i ? ",1" : "1");
    strcat(many, "],\"data_offsets\":[0,1]}}");
    CHECK_ST(parse_header(many, 1), KVP_EPROTO);
}

static void test_truncated(void)
{
    int64_t s[2] = {4, 4};
    float v[16];
    kvpt_fill(v, sizeof v, 3);
    kvp_tensor t;
    REQUIRE_OK(kvp_tensor_init(&t, KVP_DTYPE_F32, 2, s, v));
    size_t len;
    uint8_t *buf = encode(&t, &len);
    REQUIRE(buf != NULL);
    for (size_t cut = 0; cut < len; cut++) {
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, buf, cut);
        kvp_tensor back;
        CHECK_ST(kvpi_safetensors_parse(copy, cut, &back), KVP_EPROTO);
        free(copy);
    }
    /* Extra bytes after the data are refused too: offsets must cover it all. */
    uint8_t *longer = calloc(1, len + 8);
    memcpy(longer, buf, len);
    kvp_tensor back;
    CHECK_ST(kvpi_safetensors_parse(longer, len + 8, &back), KVP_EPROTO);
    free(longer);
    free(buf);
}

static void test_writer_errors(void)
{
    int64_t s[1] = {4};
    float v[4] = {0};
    kvp_tensor t;
    REQUIRE_OK(kvp_tensor_init(&t, KVP_DTYPE_F32, 1, s, v));
    size_t n, written;
    REQUIRE_OK(kvpi_safetensors_size(&t, &n));
    uint8_t *buf = malloc(n);
    CHECK_ST(kvpi_safetensors_write(&t, buf, n - 1, &written), KVP_EINVAL);
    t.nbytes = 12; /* lies about its size */
    CHECK_ST(kvpi_safetensors_write(&t, buf, n, &written), KVP_EINVAL);
    CHECK_ST(kvpi_safetensors_size(&t, &n), KVP_EINVAL);
    free(buf);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

/* Random mutations of valid messages: the parser returns OK or EPROTO, and an
 * accepted tensor lies inside the buffer. Buffers are exactly sized so that a
 * sanitizer build catches any overread. */
static void test_fuzz_mutations(void)
{
    int64_t s[3] = {2, 3, 4};
    uint8_t data[2 * 3 * 4 * 8];
    kvpt_fill(data, sizeof data, 11);
    int accepted = 0;
    for (int iter = 0; iter < 20000; iter++) {
        kvp_tensor t;
        kvp_dtype dt = (kvp_dtype)(rnd() % KVP_DTYPE_COUNT);
        REQUIRE_OK(kvp_tensor_init(&t, dt, (int)(rnd() % 4), s, data));
        size_t len;
        uint8_t *buf = encode(&t, &len);
        REQUIRE(buf != NULL);
        int flips = 1 + (int)(rnd() % 4);
        for (int f = 0; f < flips; f++) {
            size_t at = rnd() % len;
            switch (rnd() % 4) {
            case 0:
                buf[at] ^= (uint8_t)(1u << (rnd() % 8));
                break;
            case 1:
                buf[at] = (uint8_t)rnd();
                break;
            case 2:
                buf[rnd() % 8] = (uint8_t)rnd();
                break; /* header length */
            default:
                buf[8 + rnd() % (len - 8)] = (uint8_t) "{}[]\",:0-9 e"[rnd() % 12];
                break;
            }
        }
        size_t cut = rnd() % 8 == 0 ? rnd() % (len + 1) : len;
        uint8_t *copy = malloc(cut ? cut : 1);
        memcpy(copy, buf, cut);
        kvp_tensor back;
        kvp_status st = kvpi_safetensors_parse(copy, cut, &back);
        CHECK(st == KVP_OK || st == KVP_EPROTO);
        if (st == KVP_OK) {
            accepted++;
            CHECK((uint8_t *)back.data >= copy && (uint8_t *)back.data + back.nbytes <= copy + cut);
            CHECK(back.ndim >= 0 && back.ndim <= KVP_TENSOR_MAX_NDIM);
        }
        free(copy);
        free(buf);
        if (kvpt_failures) return;
    }
    CHECK(accepted > 0); /* mutations that only touch data stay valid */
}

int main(void)
{
    RUN(test_dtype_names);
    RUN(test_tensor_size);
    RUN(test_tensor_ownership);
    RUN(test_round_trip_every_dtype);
    RUN(test_round_trip_0d_and_empty);
    RUN(test_wire_format);
    RUN(test_parse_foreign_writers);
    RUN(test_malformed);
    RUN(test_truncated);
    RUN(test_writer_errors);
    RUN(test_fuzz_mutations);
    return kvpt_summary();
}
