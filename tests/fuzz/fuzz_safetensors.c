/* The safetensors header of a pipe message (src/pipe/safetensors.c): what a
 * peer's announced buffer holds once READ. Invariants of an accepted message:
 * the tensor covers the data area exactly, dtype size x shape == that length,
 * and writing the tensor again gives a message that parses to the same
 * tensor. */
#include "fuzz.h"
#include "common/net.h"
#include "pipe/safetensors.h"

KVPF_QUIET_INITIALIZE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    kvp_tensor t;
    if (kvpi_safetensors_parse(data, size, &t) != KVP_OK) return 0;

    FUZZ_CHECK(t.ndim >= 0 && t.ndim <= KVP_TENSOR_MAX_NDIM);
    for (int i = 0; i < t.ndim; i++)
        FUZZ_CHECK(t.shape[i] >= 0);
    size_t nbytes;
    FUZZ_CHECK(kvp_tensor_size(t.dtype, t.ndim, t.shape, NULL, &nbytes) == KVP_OK);
    FUZZ_CHECK(nbytes == t.nbytes);
    /* The data area is what follows the header, all of it. */
    uint64_t hlen = kvpi_get_le64(data);
    FUZZ_CHECK((const uint8_t *)t.data == data + 8 + hlen);
    FUZZ_CHECK(8 + hlen + t.nbytes == size);
    FUZZ_CHECK(t.release == NULL);

    size_t need;
    FUZZ_CHECK(kvpi_safetensors_size(&t, &need) == KVP_OK);
    uint8_t *again = malloc(need);
    FUZZ_CHECK(again);
    size_t written;
    FUZZ_CHECK(kvpi_safetensors_write(&t, again, need, &written) == KVP_OK);
    FUZZ_CHECK(written == need && kvpi_get_le64(again) % 8 == 0);
    kvp_tensor back;
    FUZZ_CHECK(kvpi_safetensors_parse(again, written, &back) == KVP_OK);
    FUZZ_CHECK(back.dtype == t.dtype && back.ndim == t.ndim && back.nbytes == t.nbytes);
    FUZZ_CHECK(memcmp(back.shape, t.shape, sizeof t.shape[0] * (size_t)t.ndim) == 0);
    FUZZ_CHECK(t.nbytes == 0 || memcmp(back.data, t.data, t.nbytes) == 0);
    /* One byte short is refused. */
    FUZZ_CHECK(kvpi_safetensors_parse(again, written - 1, &back) != KVP_OK);
    free(again);
    return 0;
}
