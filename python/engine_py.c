/* kvpipe.TransferEngine: Mooncake's mooncake.engine.TransferEngine over the kvpipe engine.
 *
 * Names, argument order, defaults and return conventions follow Mooncake's
 * Python binding, so code written for it runs unchanged: ints are statuses (0 on
 * success, negative on failure; here -kvp_status, with kvpipe.last_error()
 * giving the detail), addresses are ints, allocate_managed_buffer returns the
 * address or 0, the batch_transfer_async_* calls return a batch id (0 on
 * failure). Misuse that Mooncake would crash on (a method before initialize(), a
 * byte copy outside this engine's memory) raises or fails cleanly instead.
 *
 * Threads: every method may be called from several Python threads; the GIL is
 * released while anything may block (metadata store, network, big copies).
 */
#include "kvpy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "kvpipe/engine.h"
#include "kvpipe/metrics.h"
#include "mooncake_core.h"

typedef struct kvpy_engine {
    PyObject_HEAD
    /* Mooncake's semantics - the region table, the segment-id and batch-id
     * maps, Mooncake's quirks - are compat/mooncake/mooncake_core.h, shared
     * with the C API; this file only binds them to Python. */
    kvmc_engine *core;
    int busy;         /* calls running with the GIL released; close() waits for none */
    PyObject *aio;    /* the asyncio glue's state (kvpy_aio_*), or NULL */
    kvpy_aio_op *ops; /* awaited batches not reaped yet */
} kvpy_engine;

#define KVP(self) kvmc_kvp((self)->core)

static PyObject *opcode_enum; /* kvpipe.TransferOpcode (an IntEnum) */

static void kvpy_aio_close(kvpy_engine *self);

/* A failed call reported Mooncake's way (a negative int), with the core's
 * detail (its own refusals, or kvpipe's). */
static int mc_fail(kvp_status st, const char *what)
{
    return kvpy_fail_msg(st, "%s: %s", what,
                         *kvmc_last_error() ? kvmc_last_error() : kvp_strerror(st));
}

/* ---- lifetime -------------------------------------------------------------- */

static int engine_ready(kvpy_engine *self)
{
    if (self->core) return 0;
    PyErr_SetString(kvpy_error_type,
                    "TransferEngine is not initialized (call initialize() first) or was closed");
    return -1;
}

static void engine_teardown(kvpy_engine *self)
{
    /* Awaited batches first: they point into the engine. */
    kvpy_aio_close(self);
    kvmc_engine *core = self->core;
    self->core = NULL;
    if (core) {
        Py_BEGIN_ALLOW_THREADS
        kvmc_destroy(core, 0);
        Py_END_ALLOW_THREADS
    }
}

static PyObject *engine_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    return kvpy_alloc_instance(type);
}

static void engine_dealloc(kvpy_engine *self)
{
    engine_teardown(self);
    Py_CLEAR(self->aio);
    kvpy_free_instance((PyObject *)self);
}

static PyObject *engine_close(kvpy_engine *self, PyObject *noargs)
{
    (void)noargs;
    if (self->busy) {
        PyErr_SetString(kvpy_error_type, "TransferEngine.close(): another thread is still "
                                         "running a call on this engine");
        return NULL;
    }
    engine_teardown(self);
    Py_RETURN_NONE;
}

/* ---- initialize ------------------------------------------------------------ */

/* A bare host gets a free port, as Mooncake picks one (callers learn it from
 * get_rpc_port()); KVPIPE_PROTOCOL and KVPIPE_DISABLE_SHM apply (the core). */
static PyObject *initialize_common(kvpy_engine *self, const char *host, const char *metadata,
                                   const char *protocol, const char *devices)
{
    if (self->core || self->busy)
        return PyLong_FromLong(kvpy_fail_msg(KVP_EBUSY, "TransferEngine.initialize: already "
                                                        "initialized"));
    kvp_status st;
    kvmc_engine *core = NULL;
    /* busy keeps a second initialize() (or close()) out while the GIL is free. */
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvmc_create(host, metadata, protocol, devices, &core);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (st) return PyLong_FromLong(mc_fail(st, "TransferEngine.initialize"));
    self->core = core;
    return PyLong_FromLong(0);
}

static PyObject *engine_initialize(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"local_hostname", "metadata_server", "protocol", "device_name", NULL};
    const char *host, *metadata, *protocol = "tcp", *devices = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "ss|zz:initialize", kwlist, &host, &metadata,
                                     &protocol, &devices))
        return NULL;
    return initialize_common(self, host, metadata, protocol, devices);
}

static PyObject *engine_initialize_ext(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"local_hostname", "metadata_server", "protocol",
                             "device_name",    "metadata_type",   NULL};
    const char *host, *metadata, *protocol, *devices, *type;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sszzs:initialize_ext", kwlist, &host, &metadata,
                                     &protocol, &devices, &type))
        return NULL;
    /* As Mooncake: a server without a scheme gets metadata_type as its scheme.
     * P2PHANDSHAKE in another case goes as it is, for the engine to say what
     * was meant rather than look up a host of that name. */
    if (strstr(metadata, "://") || strcasecmp(metadata, "P2PHANDSHAKE") == 0 || !*type)
        return initialize_common(self, host, metadata, protocol, devices);
    PyObject *conn = PyUnicode_FromFormat("%s://%s", type, metadata);
    if (!conn) return NULL;
    PyObject *ret =
        initialize_common(self, host, PyUnicode_AsUTF8AndSize(conn, NULL), protocol, devices);
    Py_DECREF(conn);
    return ret;
}

static PyObject *engine_get_rpc_port(kvpy_engine *self, PyObject *noargs)
{
    (void)noargs;
    if (engine_ready(self)) return NULL;
    return PyLong_FromLong(kvp_engine_rpc_port(KVP(self)));
}

static PyObject *engine_get_segment_name(kvpy_engine *self, PyObject *noargs)
{
    (void)noargs;
    if (engine_ready(self)) return NULL;
    return PyUnicode_FromString(kvp_engine_segment_name(KVP(self)));
}

/* stats(prometheus=False): the engine's metrics (docs/metrics.md) as a dict
 * named as in Prometheus less "kvpipe_engine_", nested by label values; with
 * prometheus=True the same as Prometheus text. Does not block. */
static PyObject *engine_stats(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prometheus", NULL};
    int prometheus = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:stats", kwlist, &prometheus) ||
        engine_ready(self))
        return NULL;
    kvp_metrics *m;
    kvp_status st = kvp_engine_metrics(KVP(self), &m);
    if (st) return kvpy_raise(st, "TransferEngine.stats");
    PyObject *out = prometheus ? kvpy_metrics_text(m) : PyDict_New();
    if (out && !prometheus && kvpy_metrics_into(m, "kvpipe_engine_", out) < 0) Py_CLEAR(out);
    kvp_metrics_free(m);
    return out;
}

/* The transport reaching an opened target ("tcp", "shm"), None before the
 * first transfer to it. */
static PyObject *engine_segment_transport(kvpy_engine *self, PyObject *args)
{
    const char *target;
    if (!PyArg_ParseTuple(args, "s:segment_transport", &target) || engine_ready(self)) return NULL;
    kvp_segment_id seg;
    const char *name =
        kvmc_lookup(self->core, target, &seg) ? kvp_engine_segment_transport(KVP(self), seg) : NULL;
    if (!name) Py_RETURN_NONE;
    return PyUnicode_FromString(name);
}

/* ---- managed buffers and registration ------------------------------------ */

static PyObject *engine_allocate_managed_buffer(kvpy_engine *self, PyObject *args)
{
    size_t length;
    if (!PyArg_ParseTuple(args, "O&:allocate_managed_buffer", kvpy_size_conv, &length)) return NULL;
    if (engine_ready(self)) return NULL;
    void *addr = NULL;
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvmc_alloc(self->core, length, &addr);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (st) {
        mc_fail(st, "TransferEngine.allocate_managed_buffer");
        return PyLong_FromLong(0);
    }
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)addr);
}

static PyObject *engine_free_managed_buffer(kvpy_engine *self, PyObject *args)
{
    uint64_t addr;
    size_t length;
    if (!PyArg_ParseTuple(args, "O&O&:free_managed_buffer", kvpy_addr_conv, &addr, kvpy_size_conv,
                          &length))
        return NULL;
    if (engine_ready(self)) return NULL;
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvmc_free(self->core, (void *)(uintptr_t)addr);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyLong_FromLong(st ? mc_fail(st, "TransferEngine.free_managed_buffer") : 0);
}

static kvp_status register_one(kvpy_engine *self, uint64_t addr, size_t length)
{
    kvmc_rc rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = kvmc_register(self->core, (void *)(uintptr_t)addr, length, 1);
    Py_END_ALLOW_THREADS
    self->busy--;
    return rc.st;
}

static kvp_status unregister_one(kvpy_engine *self, uint64_t addr)
{
    kvmc_rc rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = kvmc_unregister(self->core, (void *)(uintptr_t)addr);
    Py_END_ALLOW_THREADS
    self->busy--;
    return rc.st;
}

static PyObject *engine_register_memory(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer_addr", "capacity", "location", NULL};
    uint64_t addr;
    size_t length;
    const char *location = "*"; /* NUMA/device placement hint; kvpipe does not need it */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O&|s:register_memory", kwlist, kvpy_addr_conv,
                                     &addr, kvpy_size_conv, &length, &location))
        return NULL;
    if (engine_ready(self)) return NULL;
    kvp_status st = register_one(self, addr, length);
    return PyLong_FromLong(st ? mc_fail(st, "TransferEngine.register_memory") : 0);
}

static PyObject *engine_unregister_memory(kvpy_engine *self, PyObject *args)
{
    uint64_t addr;
    if (!PyArg_ParseTuple(args, "O&:unregister_memory", kvpy_addr_conv, &addr)) return NULL;
    if (engine_ready(self)) return NULL;
    kvp_status st = unregister_one(self, addr);
    return PyLong_FromLong(st ? mc_fail(st, "TransferEngine.unregister_memory") : 0);
}

/* A list of n ints (addresses or lengths) as a malloc'ed array; n_expected < 0
 * accepts any length. Returns NULL with a Python error on failure. */
static uint64_t *int_list(PyObject *seq, const char *what, Py_ssize_t n_expected, size_t *n_out)
{
    PyObject *fast = PySequence_Fast(seq, "expected a list of ints");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Size(fast);
    if (n_expected >= 0 && n != n_expected) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", what, n, n_expected);
        Py_DECREF(fast);
        return NULL;
    }
    uint64_t *out = malloc((size_t)(n ? n : 1) * sizeof *out);
    if (!out) {
        Py_DECREF(fast);
        return (uint64_t *)PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(fast, i);
        int ok = item && kvpy_addr_conv(item, &out[i]);
        Py_XDECREF(item);
        if (!ok) {
            free(out);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *n_out = (size_t)n;
    return out;
}

static PyObject *engine_batch_register_memory(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer_addresses", "capacities", "location", NULL};
    PyObject *addrs_obj, *lens_obj;
    const char *location = "*";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|s:batch_register_memory", kwlist, &addrs_obj,
                                     &lens_obj, &location))
        return NULL;
    if (engine_ready(self)) return NULL;
    size_t n = 0, n2 = 0;
    uint64_t *addrs = int_list(addrs_obj, "buffer_addresses", -1, &n);
    if (!addrs) return NULL;
    uint64_t *lens = int_list(lens_obj, "capacities", (Py_ssize_t)n, &n2);
    if (!lens) {
        free(addrs);
        return NULL;
    }
    /* All or nothing (the core undoes what it registered). */
    void **ptrs = malloc((n ? n : 1) * sizeof *ptrs);
    size_t *sizes = malloc((n ? n : 1) * sizeof *sizes);
    if (!ptrs || !sizes) {
        free(ptrs);
        free(sizes);
        free(addrs);
        free(lens);
        return PyErr_NoMemory();
    }
    for (size_t i = 0; i < n; i++) {
        ptrs[i] = (void *)(uintptr_t)addrs[i];
        sizes[i] = (size_t)lens[i];
    }
    kvmc_rc rc = {0, KVP_OK};
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = kvmc_register_all(self->core, ptrs, sizes, n);
    Py_END_ALLOW_THREADS
    self->busy--;
    free(ptrs);
    free(sizes);
    free(addrs);
    free(lens);
    return PyLong_FromLong(rc.st ? mc_fail(rc.st, "TransferEngine.batch_register_memory") : 0);
}

static PyObject *engine_batch_unregister_memory(kvpy_engine *self, PyObject *args)
{
    PyObject *addrs_obj;
    if (!PyArg_ParseTuple(args, "O:batch_unregister_memory", &addrs_obj)) return NULL;
    if (engine_ready(self)) return NULL;
    size_t n = 0;
    uint64_t *addrs = int_list(addrs_obj, "buffer_addresses", -1, &n);
    if (!addrs) return NULL;
    int ret = 0;
    for (size_t i = 0; i < n; i++) {
        /* Keep going past a failure so that one bad address does not leave the
         * rest registered; report the first failure. */
        kvp_status st = unregister_one(self, addrs[i]);
        if (st && ret == 0) ret = mc_fail(st, "TransferEngine.batch_unregister_memory");
    }
    free(addrs);
    return PyLong_FromLong(ret);
}

/* ---- byte copies ------------------------------------------------------------ */

static PyObject *engine_write_bytes_to_buffer(kvpy_engine *self, PyObject *args)
{
    uint64_t addr;
    Py_buffer src;
    size_t length;
    if (!PyArg_ParseTuple(args, "O&s*O&:write_bytes_to_buffer", kvpy_addr_conv, &addr, &src,
                          kvpy_size_conv, &length))
        return NULL;
    int ret = 0;
    const char *why;
    kvp_status st;
    if (engine_ready(self)) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (length > (size_t)src.len)
        ret = kvpy_fail_msg(KVP_EINVAL,
                            "write_bytes_to_buffer: length %zu exceeds the %zd "
                            "bytes given",
                            length, src.len);
    else if ((why = kvmc_copy_refusal(self->core, addr, length, &st)))
        ret = kvpy_fail_msg(st, "write_bytes_to_buffer: [0x%llx, +%zu) %s",
                            (unsigned long long)addr, length, why);
    else {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)(uintptr_t)addr, src.buf, length);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    return PyLong_FromLong(ret);
}

static PyObject *engine_read_bytes_from_buffer(kvpy_engine *self, PyObject *args)
{
    uint64_t addr;
    size_t length;
    if (!PyArg_ParseTuple(args, "O&O&:read_bytes_from_buffer", kvpy_addr_conv, &addr,
                          kvpy_size_conv, &length))
        return NULL;
    if (engine_ready(self)) return NULL;
    kvp_status st;
    const char *why = kvmc_copy_refusal(self->core, addr, length, &st);
    if (why) {
        /* snprintf: PyUnicode_FromFormat has no %llx before Python 3.12. */
        char text[256];
        snprintf(text, sizeof text, "read_bytes_from_buffer: [0x%llx, +%zu) %s",
                 (unsigned long long)addr, length, why);
        PyObject *exc_msg = PyUnicode_FromString(text);
        if (exc_msg) {
            PyErr_SetObject(kvpy_error_type, exc_msg);
            Py_DECREF(exc_msg);
        }
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (!out) return NULL;
    char *dst = PyBytes_AsString(out);
    Py_BEGIN_ALLOW_THREADS
    memcpy(dst, (const void *)(uintptr_t)addr, length);
    Py_END_ALLOW_THREADS
    return out;
}

/* ---- transfers --------------------------------------------------------------- */

/* kvpipe's id (and Mooncake's) of a segment by name: answered from the
 * core's map, or looked up with the GIL released. */
static kvp_status open_segment(kvpy_engine *self, const char *name, kvp_segment_id *out,
                               int32_t *mc_id)
{
    if (kvmc_lookup(self->core, name, out)) {
        if (mc_id) *mc_id = (int32_t)(*out + 1);
        return KVP_OK;
    }
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvmc_open(self->core, name, mc_id, out);
    Py_END_ALLOW_THREADS
    self->busy--;
    return st;
}

/* The requests of one call, built from the Python arguments. */
typedef struct xfer {
    kvp_request *reqs;
    size_t n;
} xfer;

static int xfer_build(xfer *x, kvp_opcode op, PyObject *bufs, PyObject *peers, PyObject *lens)
{
    size_t n = 0, n2 = 0, n3 = 0;
    uint64_t *b = int_list(bufs, "buffers", -1, &n);
    uint64_t *p = b ? int_list(peers, "peer_buffer_addresses", (Py_ssize_t)n, &n2) : NULL;
    uint64_t *l = p ? int_list(lens, "lengths", (Py_ssize_t)n, &n3) : NULL;
    x->reqs = l ? calloc(n ? n : 1, sizeof *x->reqs) : NULL;
    x->n = n;
    if (l && !x->reqs) PyErr_NoMemory();
    for (size_t i = 0; x->reqs && i < n; i++)
        x->reqs[i] = (kvp_request){op, (void *)(uintptr_t)b[i], p[i], (size_t)l[i]};
    free(b);
    free(p);
    free(l);
    return x->reqs ? 0 : -1;
}

static int parse_opcode(PyObject *obj, kvp_opcode *out)
{
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v != KVP_OP_READ && v != KVP_OP_WRITE) {
        PyErr_Format(PyExc_ValueError,
                     "opcode must be TransferOpcode.Read (0) or Write (1), "
                     "not %ld",
                     v);
        return -1;
    }
    *out = (kvp_opcode)v;
    return 0;
}

/* Run the requests to completion: submitted with a completion callback that
 * writes an eventfd this thread polls (kvpy_wait_fd), so the wait ends with
 * the batch, without slices, and Ctrl-C still interrupts it (the batch is then
 * cancelled and freed, its memory untouched once this returns). Returns -1
 * with a Python exception, 1 when the segment could not be opened (*st;
 * kvmc_last_error() says why), else 0 with *st the transfer status. */
static int xfer_run(kvpy_engine *self, const char *target, const xfer *x, kvp_status *st,
                    kvp_segment_id *segp)
{
    kvp_segment_id seg = 0;
    *st = open_segment(self, target, &seg, NULL);
    *segp = seg;
    if (*st) return 1;
    int fd = kvpy_eventfd();
    if (fd < 0) return -1;
    kvp_batch_opts o;
    kvp_batch_opts_init(&o);
    o.on_complete = kvpy_eventfd_done;
    o.user_data = (void *)(intptr_t)fd;
    kvp_batch *batch = NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    *st = kvp_batch_submit_with(KVP(self), seg, x->reqs, x->n, &o, &batch);
    Py_END_ALLOW_THREADS
    int rc = 0;
    if (*st == KVP_OK) {
        rc = kvpy_wait_fd(fd, -1);
        Py_BEGIN_ALLOW_THREADS
        if (rc == 0) *st = kvp_batch_wait(batch, 0);
        kvp_batch_free(batch); /* after an interruption: cancels, waits for what runs */
        Py_END_ALLOW_THREADS
    }
    self->busy--;
    close(fd);
    return rc;
}

/* Run, then, when every request succeeded and a notify was given, send it:
 * the target gets it only once the data is in place (a WRITE completes once
 * the target stored its bytes). Converted to Mooncake's int convention; a
 * notification that was not delivered fails the call (Mooncake only logs
 * it), with the data moved. Releases n. */
static PyObject *xfer_sync(kvpy_engine *self, const char *target, xfer *x, kvpy_notify_args *n,
                           const char *what)
{
    kvp_status st = KVP_OK;
    kvp_segment_id seg = 0;
    int rc = xfer_run(self, target, x, &st, &seg);
    free(x->reqs);
    if (rc == 1) {
        kvpy_notify_args_release(n);
        return PyLong_FromLong(mc_fail(st, what));
    }
    if (rc == 0 && st == KVP_OK && n->name) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        st = kvp_engine_notify(KVP(self), seg, n->name, n->msg);
        Py_END_ALLOW_THREADS
        self->busy--;
    }
    kvpy_notify_args_release(n);
    if (rc < 0) return NULL;
    return PyLong_FromLong(st ? kvpy_fail(st, what) : 0);
}

static PyObject *single_sync(kvpy_engine *self, PyObject *args, PyObject *kwds, int op_given,
                             kvp_opcode op, const char *what)
{
    /* transfer_sync_read/write: Mooncake's arguments, and notify= after them
     * (a kvpipe extension: Mooncake takes it in transfer_sync only). */
    static char *kw_rw[] = {
        "target_hostname", "buffer", "peer_buffer_address", "length", "transport_hint",
        "notify",          NULL};
    static char *kw_op[] = {"target_hostname", "buffer", "peer_buffer_address", "length",
                            "opcode",          "notify", "transport_hint",      NULL};
    const char *target, *hint = "";
    uint64_t buf, peer;
    size_t length;
    PyObject *opcode = NULL, *notify = NULL;
    int ok = op_given
                 ? PyArg_ParseTupleAndKeywords(args, kwds, "sO&O&O&|sO:transfer_sync", kw_rw,
                                               &target, kvpy_addr_conv, &buf, kvpy_addr_conv, &peer,
                                               kvpy_size_conv, &length, &hint, &notify)
                 : PyArg_ParseTupleAndKeywords(args, kwds, "sO&O&O&O|Os:transfer_sync", kw_op,
                                               &target, kvpy_addr_conv, &buf, kvpy_addr_conv, &peer,
                                               kvpy_size_conv, &length, &opcode, &notify, &hint);
    if (!ok || (!op_given && parse_opcode(opcode, &op)) || engine_ready(self)) return NULL;
    kvpy_notify_args n;
    if (kvpy_notify_parse(notify, &n)) return NULL;
    xfer x = {calloc(1, sizeof(kvp_request)), 1};
    if (!x.reqs) {
        kvpy_notify_args_release(&n);
        return PyErr_NoMemory();
    }
    x.reqs[0] = (kvp_request){op, (void *)(uintptr_t)buf, peer, length};
    return xfer_sync(self, target, &x, &n, what);
}

static PyObject *engine_transfer_sync_read(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return single_sync(self, args, kwds, 1, KVP_OP_READ, "TransferEngine.transfer_sync_read");
}

static PyObject *engine_transfer_sync_write(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return single_sync(self, args, kwds, 1, KVP_OP_WRITE, "TransferEngine.transfer_sync_write");
}

static PyObject *engine_transfer_sync(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return single_sync(self, args, kwds, 0, KVP_OP_READ, "TransferEngine.transfer_sync");
}

/* Parsed arguments of the batch_transfer_* family. */
typedef struct batch_args {
    const char *target;
    PyObject *bufs, *peers, *lens, *opcode, *notify;
    const char *hint;
} batch_args;

static int parse_batch_args(PyObject *args, PyObject *kwds, int with_opcode, int with_notify,
                            batch_args *a)
{
    /* The _read/_write forms: notify= after Mooncake's arguments (kvpipe's
     * extension); the async ones take none. */
    static char *kw_plain[] = {
        "target_hostname", "buffers", "peer_buffer_addresses", "lengths", "transport_hint",
        "notify",          NULL};
    static char *kw_plain_async[] = {"target_hostname", "buffers",        "peer_buffer_addresses",
                                     "lengths",         "transport_hint", NULL};
    static char *kw_op[] = {
        "target_hostname", "buffers", "peer_buffer_addresses", "lengths", "opcode",
        "transport_hint",  NULL};
    static char *kw_notify[] = {"target_hostname", "buffers", "peer_buffer_addresses", "lengths",
                                "opcode",          "notify",  "transport_hint",        NULL};
    *a = (batch_args){.hint = ""};
    if (!with_opcode && with_notify)
        return PyArg_ParseTupleAndKeywords(args, kwds, "sOOO|sO", kw_plain, &a->target, &a->bufs,
                                           &a->peers, &a->lens, &a->hint, &a->notify)
                   ? 0
                   : -1;
    if (!with_opcode)
        return PyArg_ParseTupleAndKeywords(args, kwds, "sOOO|s", kw_plain_async, &a->target,
                                           &a->bufs, &a->peers, &a->lens, &a->hint)
                   ? 0
                   : -1;
    if (!with_notify)
        return PyArg_ParseTupleAndKeywords(args, kwds, "sOOOO|s", kw_op, &a->target, &a->bufs,
                                           &a->peers, &a->lens, &a->opcode, &a->hint)
                   ? 0
                   : -1;
    return PyArg_ParseTupleAndKeywords(args, kwds, "sOOOO|Os", kw_notify, &a->target, &a->bufs,
                                       &a->peers, &a->lens, &a->opcode, &a->notify, &a->hint)
               ? 0
               : -1;
}

static PyObject *batch_sync(kvpy_engine *self, PyObject *args, PyObject *kwds, int op_given,
                            kvp_opcode op, const char *what)
{
    batch_args a;
    if (parse_batch_args(args, kwds, !op_given, 1, &a) ||
        (!op_given && parse_opcode(a.opcode, &op)) || engine_ready(self))
        return NULL;
    kvpy_notify_args n;
    if (kvpy_notify_parse(a.notify, &n)) return NULL;
    xfer x;
    if (xfer_build(&x, op, a.bufs, a.peers, a.lens)) {
        kvpy_notify_args_release(&n);
        return NULL;
    }
    return xfer_sync(self, a.target, &x, &n, what);
}

static PyObject *engine_batch_transfer_sync_read(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return batch_sync(self, args, kwds, 1, KVP_OP_READ, "TransferEngine.batch_transfer_sync_read");
}

static PyObject *engine_batch_transfer_sync_write(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return batch_sync(self, args, kwds, 1, KVP_OP_WRITE,
                      "TransferEngine.batch_transfer_sync_write");
}

static PyObject *engine_batch_transfer_sync(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return batch_sync(self, args, kwds, 0, KVP_OP_READ, "TransferEngine.batch_transfer_sync");
}

/* ---- asynchronous batches ------------------------------------------------------ */

/* Submit under a fresh batch id of the core's map; returns the id, or 0 (and
 * the detail for kvpipe.last_error()) on failure, as Mooncake does. */
static PyObject *submit_async(kvpy_engine *self, const char *target, xfer *x, const char *what)
{
    kvp_segment_id seg;
    int32_t mc_id = 0;
    uint64_t id = 0;
    kvp_status st = open_segment(self, target, &seg, &mc_id);
    kvmc_request *reqs = st ? NULL : malloc((x->n ? x->n : 1) * sizeof *reqs);
    if (!st && !reqs) st = KVP_ENOMEM;
    for (size_t i = 0; reqs && i < x->n; i++)
        reqs[i] = (kvmc_request){x->reqs[i].opcode, x->reqs[i].local, mc_id, x->reqs[i].remote,
                                 x->reqs[i].length};
    if (!st && !(id = kvmc_batch_new(self->core, x->n))) st = KVP_ENOMEM;
    if (!st) {
        kvmc_rc rc;
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        rc = kvmc_batch_submit(self->core, id, reqs, x->n, NULL, NULL);
        Py_END_ALLOW_THREADS
        self->busy--;
        if ((st = rc.st)) kvmc_batch_free(self->core, id, 1);
    }
    free(reqs);
    free(x->reqs);
    if (st) {
        mc_fail(st, what);
        return PyLong_FromLong(0);
    }
    return PyLong_FromUnsignedLongLong(id);
}

static PyObject *batch_async(kvpy_engine *self, PyObject *args, PyObject *kwds, int op_given,
                             kvp_opcode op, const char *what)
{
    batch_args a;
    if (parse_batch_args(args, kwds, !op_given, 0, &a) ||
        (!op_given && parse_opcode(a.opcode, &op)))
        return NULL;
    if (engine_ready(self)) return NULL;
    xfer x;
    if (xfer_build(&x, op, a.bufs, a.peers, a.lens)) return NULL;
    return submit_async(self, a.target, &x, what);
}

static PyObject *engine_batch_transfer_async_read(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return batch_async(self, args, kwds, 1, KVP_OP_READ,
                       "TransferEngine.batch_transfer_async_read");
}

static PyObject *engine_batch_transfer_async_write(kvpy_engine *self, PyObject *args,
                                                   PyObject *kwds)
{
    return batch_async(self, args, kwds, 1, KVP_OP_WRITE,
                       "TransferEngine.batch_transfer_async_write");
}

static PyObject *engine_batch_transfer_async(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    return batch_async(self, args, kwds, 0, KVP_OP_READ, "TransferEngine.batch_transfer_async");
}

static PyObject *engine_transfer_submit_write(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"target_hostname", "buffer",         "peer_buffer_address",
                             "length",          "transport_hint", NULL};
    const char *target, *hint = "";
    uint64_t buf, peer;
    size_t length;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO&O&O&|s:transfer_submit_write", kwlist, &target,
                                     kvpy_addr_conv, &buf, kvpy_addr_conv, &peer, kvpy_size_conv,
                                     &length, &hint))
        return NULL;
    if (engine_ready(self)) return NULL;
    xfer x = {calloc(1, sizeof(kvp_request)), 1};
    if (!x.reqs) return PyErr_NoMemory();
    x.reqs[0] = (kvp_request){KVP_OP_WRITE, (void *)(uintptr_t)buf, peer, length};
    return submit_async(self, target, &x, "TransferEngine.transfer_submit_write");
}

/* A batch id as the core's, or 0 (none is 0) with no exception set. */
static uint64_t batch_id_of(PyObject *id)
{
    unsigned long long v = PyLong_Check(id) ? PyLong_AsUnsignedLongLong(id) : 0;
    if (PyErr_Occurred()) PyErr_Clear();
    return (uint64_t)v;
}

/* Item i of what PySequence_Fast returned (a list or a tuple), borrowed. */
static PyObject *fast_item(PyObject *fast, Py_ssize_t i)
{
    return PyList_Check(fast) ? PyList_GetItem(fast, i) : PyTuple_GetItem(fast, i);
}

/* Wait for every request of batch id: the core writes an eventfd once they
 * completed (kvmc_batch_watch), which this thread polls. -1 with a Python
 * exception (Ctrl-C; the batch runs on), else 0 with *st the first failed
 * request's status, or the core's refusal (an unknown id). */
static int wait_batch(kvpy_engine *self, uint64_t id, kvp_status *st)
{
    int complete = 0;
    if ((*st = kvmc_batch_progress(self->core, id, &complete, st)) || complete) return 0;
    int fd = kvpy_eventfd();
    if (fd < 0) return -1;
    int rc = 0;
    if (!(*st = kvmc_batch_watch(self->core, id, fd))) {
        self->busy++;
        rc = kvpy_wait_fd(fd, -1);
        self->busy--;
        kvmc_batch_watch(self->core, id, -1);
        if (rc == 0) kvmc_batch_progress(self->core, id, &complete, st);
    }
    close(fd);
    return rc;
}

static PyObject *engine_get_batch_transfer_status(kvpy_engine *self, PyObject *args)
{
    PyObject *ids_obj;
    if (!PyArg_ParseTuple(args, "O:get_batch_transfer_status", &ids_obj)) return NULL;
    if (engine_ready(self)) return NULL;
    PyObject *ids = PySequence_Fast(ids_obj, "batch_ids must be a list of batch ids");
    if (!ids) return NULL;
    int ret = 0;
    /* ids is a list or a tuple (PySequence_Fast): its items are borrowed. */
    Py_ssize_t n = PySequence_Size(ids);
    for (Py_ssize_t i = 0; i < n; i++) {
        kvp_status st;
        if (wait_batch(self, batch_id_of(fast_item(ids, i)), &st) < 0) {
            Py_DECREF(ids);
            return NULL;
        }
        if (st && ret == 0) ret = mc_fail(st, "TransferEngine.get_batch_transfer_status");
    }
    /* As Mooncake: the ids are spent once their status has been collected. */
    for (Py_ssize_t i = 0; i < n; i++)
        kvmc_batch_free(self->core, batch_id_of(fast_item(ids, i)), 1);
    Py_DECREF(ids);
    return PyLong_FromLong(ret);
}

static PyObject *engine_transfer_check_status(kvpy_engine *self, PyObject *id_obj)
{
    if (engine_ready(self)) return NULL;
    uint64_t id = batch_id_of(id_obj);
    int complete = 0;
    kvp_status st;
    if (kvmc_batch_progress(self->core, id, &complete, &st)) {
        mc_fail(KVP_EINVAL, "TransferEngine.transfer_check_status");
        return PyLong_FromLong(-1);
    }
    if (!complete) return PyLong_FromLong(0);
    kvmc_task_status(self->core, id, 0, &st, NULL);
    /* Mooncake: 1 completed, -1 failed, -2 timed out; a finished id is spent. */
    int ret = st == KVP_OK ? 1 : st == KVP_ETIMEDOUT ? -2 : -1;
    if (st) mc_fail(st, "TransferEngine.transfer_check_status");
    kvmc_batch_free(self->core, id, 1);
    return PyLong_FromLong(ret);
}

/* ---- awaitable transfers (asyncio) --------------------------------------------- */

/* One awaited batch: submitted with kvp_batch_opts.reap (user_data: this),
 * reaped off the engine's completion fd by the glue's reader
 * (python/kvpipe_aio.py). Owned by a capsule the future holds (_kvp_op), so
 * a cancel after the reap finds batch NULL instead of freed memory; while
 * unreaped it is on the engine's list and holds its future. */
struct kvpy_aio_op {
    kvpy_aio_op *prev, *next;
    kvp_batch *batch; /* NULL once reaped or freed */
    PyObject *fut;    /* until resolved */
};

static void op_capsule_free(PyObject *capsule)
{
    free(PyCapsule_GetPointer(capsule, "kvpipe.aio_op"));
}

static void op_unlink(kvpy_engine *self, kvpy_aio_op *op)
{
    if (op->prev)
        op->prev->next = op->next;
    else
        self->ops = op->next;
    if (op->next) op->next->prev = op->prev;
    op->prev = op->next = NULL;
}

/* The result of a completed batch: 0, or -status with the detail recorded
 * for kvpipe.last_error(). */
static PyObject *op_value(kvp_batch *batch)
{
    kvp_status st = kvp_batch_wait(batch, 0);
    return PyLong_FromLong(st ? kvpy_fail(st, "TransferEngine transfer") : 0);
}

/* (future, value) for every batch reaped now; the glue resolves them. */
static PyObject *engine_aio_reap(kvpy_engine *self, PyObject *noargs)
{
    (void)noargs;
    PyObject *out = PyList_New(0);
    if (!out || !self->core) return out;
    kvp_completion c[32];
    size_t n;
    while ((n = kvp_engine_reap(KVP(self), c, 32)) > 0) {
        for (size_t i = 0; i < n; i++) {
            kvpy_aio_op *op = c[i].user_data;
            PyObject *value = op_value(c[i].batch);
            kvp_batch_free(c[i].batch); /* complete: returns at once */
            op->batch = NULL;
            op_unlink(self, op);
            PyObject *pair = value ? PyTuple_Pack(2, op->fut, value) : NULL;
            Py_XDECREF(value);
            Py_CLEAR(op->fut);
            if (!pair || PyList_Append(out, pair) < 0) PyErr_Clear(); /* out of memory: lost */
            Py_XDECREF(pair);
        }
    }
    return out;
}

/* The future's cancel(): kvp_batch_cancel, which does not wait. */
static PyObject *engine_aio_cancel(kvpy_engine *self, PyObject *capsule)
{
    (void)self;
    kvpy_aio_op *op = PyCapsule_GetPointer(capsule, "kvpipe.aio_op");
    if (!op) return NULL;
    if (op->batch) kvp_batch_cancel(op->batch);
    Py_RETURN_NONE;
}

/* Close: cancel and free every awaited batch (waiting for what runs), take
 * the readers off the fd, and resolve the futures with -KVP_ECLOSED. */
static void kvpy_aio_close(kvpy_engine *self)
{
    if (!self->aio) return;
    PyObject *pending = PyList_New(0);
    PyObject *closed = PyLong_FromLong(-(long)KVP_ECLOSED);
    while (self->ops) {
        kvpy_aio_op *op = self->ops;
        op_unlink(self, op);
        kvp_batch *batch = op->batch;
        op->batch = NULL;
        Py_BEGIN_ALLOW_THREADS
        kvp_batch_free(batch);
        Py_END_ALLOW_THREADS
        PyObject *pair = pending && closed ? PyTuple_Pack(2, op->fut, closed) : NULL;
        if (!pair || PyList_Append(pending, pair) < 0) PyErr_Clear();
        Py_XDECREF(pair);
        Py_CLEAR(op->fut);
    }
    PyObject *r = pending ? kvpy_aio_call("close", PyTuple_Pack(2, self->aio, pending)) : NULL;
    if (!r) PyErr_Clear(); /* at teardown: nothing to raise to */
    Py_XDECREF(r);
    Py_XDECREF(pending);
    Py_XDECREF(closed);
    Py_CLEAR(self->aio);
}

/* Submit x as one batch and return the future of its completion (the
 * Mooncake-style int: 0, or negative). A failed submit resolves it at once. */
static PyObject *submit_aio(kvpy_engine *self, const char *target, xfer *x)
{
    PyObject *fut = kvpy_aio_call("new_future", PyTuple_New(0)); /* needs a running loop */
    if (!fut) {
        free(x->reqs);
        return NULL;
    }
    if (!self->aio) {
        PyObject *fd = PyLong_FromLong(kvp_engine_completion_fd(KVP(self)));
        self->aio = fd ? kvpy_aio_call("State", PyTuple_Pack(1, fd)) : NULL;
        Py_XDECREF(fd);
        if (!self->aio) goto fail;
    }
    kvp_segment_id seg;
    kvp_status st = open_segment(self, target, &seg, NULL);
    kvpy_aio_op *op = st ? NULL : calloc(1, sizeof *op);
    PyObject *capsule = op ? PyCapsule_New(op, "kvpipe.aio_op", op_capsule_free) : NULL;
    if (!st && !capsule) {
        free(op);
        PyErr_NoMemory();
        goto fail;
    }
    if (!st) {
        kvp_batch_opts o;
        kvp_batch_opts_init(&o);
        o.reap = 1;
        o.user_data = op;
        /* Never blocks (a lookup goes to the engine's workers). */
        st = kvp_batch_submit_with(KVP(self), seg, x->reqs, x->n, &o, &op->batch);
    }
    free(x->reqs);
    x->reqs = NULL;
    if (st) {
        Py_XDECREF(capsule);
        PyObject *v = PyLong_FromLong(mc_fail(st, "TransferEngine transfer"));
        PyObject *r = v ? PyObject_CallMethod(fut, "set_result", "O", v) : NULL;
        Py_XDECREF(v);
        if (!r) goto fail;
        Py_DECREF(r);
        PyObject *w = kvpy_aio_call("wait", PyTuple_Pack(1, fut));
        Py_DECREF(fut);
        return w;
    }
    op->fut = fut;
    Py_INCREF(fut);
    op->next = self->ops;
    if (self->ops) self->ops->prev = op;
    self->ops = op;
    PyObject *me = (PyObject *)self;
    if (PyObject_SetAttrString(fut, "_kvp_op", capsule) < 0 ||
        PyObject_SetAttrString(fut, "_kvp_engine", me) < 0) {
        Py_DECREF(capsule);
        goto fail; /* the op stays on the list: reaped or closed later */
    }
    Py_DECREF(capsule);
    PyObject *r = kvpy_aio_call("watch", PyTuple_Pack(3, me, self->aio, fut));
    if (!r) goto fail;
    Py_DECREF(r);
    r = kvpy_aio_call("wait", PyTuple_Pack(1, fut));
    Py_DECREF(fut);
    return r;
fail:
    free(x->reqs);
    Py_DECREF(fut);
    return NULL;
}

/* transfer_aio(target_hostname, buffer, peer_buffer_address, length, opcode)
 * -> awaitable int. */
static PyObject *engine_transfer_aio(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"target_hostname", "buffer", "peer_buffer_address",
                             "length",          "opcode", NULL};
    const char *target;
    uint64_t buf, peer;
    size_t length;
    PyObject *opcode;
    kvp_opcode op;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sO&O&O&O:transfer_aio", kwlist, &target,
                                     kvpy_addr_conv, &buf, kvpy_addr_conv, &peer, kvpy_size_conv,
                                     &length, &opcode) ||
        parse_opcode(opcode, &op) || engine_ready(self))
        return NULL;
    xfer x = {calloc(1, sizeof(kvp_request)), 1};
    if (!x.reqs) return PyErr_NoMemory();
    x.reqs[0] = (kvp_request){op, (void *)(uintptr_t)buf, peer, length};
    return submit_aio(self, target, &x);
}

/* batch_transfer_aio(target_hostname, buffers, peer_buffer_addresses,
 * lengths, opcode) -> awaitable int. */
static PyObject *engine_batch_transfer_aio(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    batch_args a;
    kvp_opcode op;
    if (parse_batch_args(args, kwds, 1, 0, &a) || parse_opcode(a.opcode, &op) || engine_ready(self))
        return NULL;
    xfer x;
    if (xfer_build(&x, op, a.bufs, a.peers, a.lens)) return NULL;
    return submit_aio(self, a.target, &x);
}

/* ---- notifications, probes and the rest of Mooncake's surface ------------------ */

/* get_notifies() -> [TransferNotify]: every notification received and not
 * yet taken, oldest first; the queue is empty afterwards (Mooncake's
 * getNotifies). */
static PyObject *engine_get_notifies(kvpy_engine *self, PyObject *noargs)
{
    (void)noargs;
    if (engine_ready(self)) return NULL;
    kvp_notify *list = NULL;
    size_t n = 0;
    kvp_status st = kvp_engine_get_notifies(KVP(self), &list, &n);
    if (st) return kvpy_raise(st, "TransferEngine.get_notifies");
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out && i < n; i++) {
        PyObject *item = kvpy_notify_from(list[i].name, list[i].msg);
        if (!item || PyList_SetItem(out, (Py_ssize_t)i, item) < 0) { /* it takes item */
            Py_CLEAR(out);
            break;
        }
    }
    kvp_engine_notifies_free(list, n);
    return out;
}

/* send_probe(peer_server_name) -> int: as SGLang uses it, 0 when the peer
 * answers a PROBE handshake and its session was refreshed, negative
 * otherwise. */
static PyObject *engine_send_probe(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"peer_server_name", NULL};
    const char *peer;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s:send_probe", kwlist, &peer)) return NULL;
    /* Mooncake returns -1 before initialize(). */
    if (!self->core)
        return PyLong_FromLong(kvpy_fail_msg(KVP_EINVAL, "send_probe: the engine is not "
                                                         "initialized"));
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    /* The probe opens the segment, which the map remembers like a transfer. */
    st = kvmc_probe(self->core, peer, NULL, NULL);
    Py_END_ALLOW_THREADS
    self->busy--;
    return PyLong_FromLong(st ? mc_fail(st, "TransferEngine.send_probe") : 0);
}

/* get_first_buffer_address(segment_name) -> int: the lowest registered
 * address of a peer segment, 0 when it has none or cannot be opened
 * (Mooncake's buffers[0], 0 likewise). */
static PyObject *engine_get_first_buffer_address(kvpy_engine *self, PyObject *args)
{
    const char *target;
    if (!PyArg_ParseTuple(args, "s:get_first_buffer_address", &target) || engine_ready(self))
        return NULL;
    kvp_segment_id seg;
    kvp_status st = open_segment(self, target, &seg, NULL);
    kvp_remote_buffer first = {0, 0};
    size_t count = 0;
    if (st == KVP_OK) {
        self->busy++;
        Py_BEGIN_ALLOW_THREADS
        st = kvp_engine_segment_buffers(KVP(self), seg, &first, 1, &count);
        Py_END_ALLOW_THREADS
        self->busy--;
    }
    if (st) {
        mc_fail(st, "TransferEngine.get_first_buffer_address");
        return PyLong_FromLong(0);
    }
    if (count == 0)
        kvpy_fail_msg(KVP_ENOTFOUND, "get_first_buffer_address: segment %s registers no buffer",
                      target);
    return PyLong_FromUnsignedLongLong(count ? (unsigned long long)first.addr : 0);
}

/* get_local_topology(device_name=None) -> str: Mooncake's JSON of the RDMA
 * devices preferred per memory location. kvpipe does not choose devices per
 * location (UCX does, for rdma), so it has none to tell: "{}", the answer
 * Mooncake gives where it finds none. */
static PyObject *engine_get_local_topology(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"device_name", NULL};
    const char *device = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|z:get_local_topology", kwlist, &device))
        return NULL;
    return PyUnicode_FromString("{}");
}

/* warmup_efa_segment(segment_name) -> 0: kvpipe has no EFA transport, so
 * there is nothing to warm up; Mooncake returns 0 likewise where EFA is not
 * installed. */
static PyObject *engine_warmup_efa_segment(kvpy_engine *self, PyObject *args, PyObject *kwds)
{
    (void)self;
    static char *kwlist[] = {"segment_name", NULL};
    const char *segment;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s:warmup_efa_segment", kwlist, &segment))
        return NULL;
    return PyLong_FromLong(0);
}

/* get_engine() / get_engine_ptr(): Mooncake hands out its C++ engine for
 * Mooncake Store, Mooncake EP and other C++ extensions to share. kvpipe has
 * none to give: say so rather than return something they would crash on. */
static PyObject *no_cpp_engine(const char *what)
{
    PyErr_Format(PyExc_NotImplementedError,
                 "TransferEngine.%s(): kvpipe's engine is not Mooncake's C++ "
                 "mooncake::TransferEngine and cannot be shared with code that takes one "
                 "(Mooncake Store, Mooncake EP, other extensions built against Mooncake); use "
                 "Mooncake's own binding for those, or kvpipe's methods here",
                 what);
    return NULL;
}

static PyObject *engine_get_engine(kvpy_engine *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return no_cpp_engine("get_engine");
}

static PyObject *engine_get_engine_ptr(kvpy_engine *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return no_cpp_engine("get_engine_ptr");
}

/* ---- type --------------------------------------------------------------------- */

#define KW (METH_VARARGS | METH_KEYWORDS)
#define FN(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef engine_methods[] = {
    {"initialize", FN(engine_initialize), KW,
     "initialize(local_hostname, metadata_server, protocol='tcp', device_name='') -> int\n\n"
     "Start the engine. local_hostname is 'host:port' (the port answers handshakes and names\n"
     "the segment) or a bare host (a free port is picked; see get_rpc_port()). Returns 0, or a\n"
     "negative status with kvpipe.last_error() saying why."},
    {"initialize_ext", FN(engine_initialize_ext), KW,
     "initialize_ext(local_hostname, metadata_server, protocol, device_name, metadata_type) -> "
     "int\n\nAs initialize(); a metadata_server without '://' gets metadata_type as scheme."},
    {"get_rpc_port", FN(engine_get_rpc_port), METH_NOARGS,
     "get_rpc_port() -> int: the handshake port (the port of the segment name)."},
    {"get_segment_name", FN(engine_get_segment_name), METH_NOARGS,
     "get_segment_name() -> str: this engine's segment name 'host:port' (kvpipe extension)."},
    {"stats", FN(engine_stats), KW,
     "stats(prometheus=False) -> dict or str\n\nThe engine's metrics (kvpipe extension; "
     "docs/metrics.md): requests, bytes and errors by opcode, transport and status, the "
     "request latency histogram, in-flight requests and bytes, descriptor lookups, what it "
     "served as target, its memory. Keys are the Prometheus names less 'kvpipe_engine_', "
     "nested by label values: stats()['bytes_total']['read']['tcp']. With prometheus=True, "
     "the Prometheus text instead."},
    {"segment_transport", FN(engine_segment_transport), METH_VARARGS,
     "segment_transport(target_hostname) -> str or None: the transport used to reach an "
     "opened target ('tcp', 'shm'; kvpipe extension)."},
    {"allocate_managed_buffer", FN(engine_allocate_managed_buffer), METH_VARARGS,
     "allocate_managed_buffer(length) -> int: address of registered engine memory, 0 on "
     "failure."},
    {"free_managed_buffer", FN(engine_free_managed_buffer), METH_VARARGS,
     "free_managed_buffer(buffer_addr, length) -> int: 0, or negative on failure."},
    {"transfer_sync_read", FN(engine_transfer_sync_read), KW,
     "transfer_sync_read(target_hostname, buffer, peer_buffer_address, length, "
     "transport_hint='', notify=None) -> int\n\nRead length bytes of the peer's segment into "
     "local memory; then send notify (a TransferNotify) to the peer, if given."},
    {"transfer_sync_write", FN(engine_transfer_sync_write), KW,
     "transfer_sync_write(target_hostname, buffer, peer_buffer_address, length, "
     "transport_hint='', notify=None) -> int\n\nWrite length bytes of local memory into the "
     "peer's segment; once they are in place, send notify (a TransferNotify), if given."},
    {"transfer_sync", FN(engine_transfer_sync), KW,
     "transfer_sync(target_hostname, buffer, peer_buffer_address, length, opcode, notify=None, "
     "transport_hint='') -> int\n\nnotify (a TransferNotify) is sent to the peer once the "
     "transfer succeeded; a notification not delivered fails the call."},
    {"batch_transfer_sync_read", FN(engine_batch_transfer_sync_read), KW,
     "batch_transfer_sync_read(target_hostname, buffers, peer_buffer_addresses, lengths, "
     "transport_hint='', notify=None) -> int"},
    {"batch_transfer_sync_write", FN(engine_batch_transfer_sync_write), KW,
     "batch_transfer_sync_write(target_hostname, buffers, peer_buffer_addresses, lengths, "
     "transport_hint='', notify=None) -> int"},
    {"batch_transfer_sync", FN(engine_batch_transfer_sync), KW,
     "batch_transfer_sync(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, "
     "notify=None, transport_hint='') -> int"},
    {"batch_transfer_async_read", FN(engine_batch_transfer_async_read), KW,
     "batch_transfer_async_read(target_hostname, buffers, peer_buffer_addresses, lengths, "
     "transport_hint='') -> batch id (0 on failure)"},
    {"batch_transfer_async_write", FN(engine_batch_transfer_async_write), KW,
     "batch_transfer_async_write(target_hostname, buffers, peer_buffer_addresses, lengths, "
     "transport_hint='') -> batch id (0 on failure)"},
    {"batch_transfer_async", FN(engine_batch_transfer_async), KW,
     "batch_transfer_async(target_hostname, buffers, peer_buffer_addresses, lengths, opcode, "
     "transport_hint='') -> batch id (0 on failure)"},
    {"transfer_aio", FN(engine_transfer_aio), KW,
     "transfer_aio(target_hostname, buffer, peer_buffer_address, length, opcode) -> "
     "awaitable int\n\nasyncio: submit one transfer and return a future of its result (0, or "
     "negative as transfer_sync's), resolved from the engine's completion fd by the running "
     "loop (no thread per wait). Cancelling the awaiting task cancels the transfer; it raises "
     "CancelledError once nothing of kvpipe touches the memory any more (kvpipe extension)."},
    {"batch_transfer_aio", FN(engine_batch_transfer_aio), KW,
     "batch_transfer_aio(target_hostname, buffers, peer_buffer_addresses, lengths, opcode) -> "
     "awaitable int\n\nasyncio: as transfer_aio(), for a batch (kvpipe extension)."},
    {"_aio_reap", FN(engine_aio_reap), METH_NOARGS, "The asyncio glue's: reap completions."},
    {"_aio_cancel", FN(engine_aio_cancel), METH_O, "The asyncio glue's: cancel a batch."},
    {"get_batch_transfer_status", FN(engine_get_batch_transfer_status), METH_VARARGS,
     "get_batch_transfer_status(batch_ids) -> int\n\nWait for every batch; 0 if all succeeded, "
     "else negative. The ids are spent afterwards."},
    {"transfer_submit_write", FN(engine_transfer_submit_write), KW,
     "transfer_submit_write(target_hostname, buffer, peer_buffer_address, length, "
     "transport_hint='') -> batch id (0 on failure)"},
    {"transfer_check_status", FN(engine_transfer_check_status), METH_O,
     "transfer_check_status(batch_id) -> int: 1 done, 0 running, -1 failed, -2 timed out."},
    {"register_memory", FN(engine_register_memory), KW,
     "register_memory(buffer_addr, capacity, location='*') -> int"},
    {"unregister_memory", FN(engine_unregister_memory), METH_VARARGS,
     "unregister_memory(buffer_addr) -> int"},
    {"batch_register_memory", FN(engine_batch_register_memory), KW,
     "batch_register_memory(buffer_addresses, capacities, location='*') -> int (all or "
     "nothing)"},
    {"batch_unregister_memory", FN(engine_batch_unregister_memory), METH_VARARGS,
     "batch_unregister_memory(buffer_addresses) -> int"},
    {"write_bytes_to_buffer", FN(engine_write_bytes_to_buffer), METH_VARARGS,
     "write_bytes_to_buffer(dest_address, src, length) -> int\n\nCopy length bytes of src "
     "(bytes-like or str) into a managed or registered buffer of this engine."},
    {"read_bytes_from_buffer", FN(engine_read_bytes_from_buffer), METH_VARARGS,
     "read_bytes_from_buffer(source_address, length) -> bytes"},
    {"get_notifies", FN(engine_get_notifies), METH_NOARGS,
     "get_notifies() -> list[TransferNotify]\n\nEvery notification received and not yet "
     "taken, oldest first; they are gone from the engine afterwards."},
    {"send_probe", FN(engine_send_probe), KW,
     "send_probe(peer_server_name) -> int\n\nProbe the peer's handshake port and refresh "
     "the session to it (its descriptor fetched anew, transports opened): 0 when it answers, "
     "negative otherwise. SGLang's warm-up and recovery of a failed peer."},
    {"get_first_buffer_address", FN(engine_get_first_buffer_address), METH_VARARGS,
     "get_first_buffer_address(segment_name) -> int: the lowest registered address of the "
     "peer segment, 0 when it has none or cannot be opened."},
    {"get_local_topology", FN(engine_get_local_topology), KW,
     "get_local_topology(device_name=None) -> str: '{}' (kvpipe does not choose RDMA devices "
     "per memory location; UCX does)."},
    {"warmup_efa_segment", FN(engine_warmup_efa_segment), KW,
     "warmup_efa_segment(segment_name) -> int: 0, a no-op (kvpipe has no EFA transport)."},
    {"get_engine", FN(engine_get_engine), METH_NOARGS,
     "get_engine(): raises NotImplementedError: kvpipe has no Mooncake C++ engine to share."},
    {"get_engine_ptr", FN(engine_get_engine_ptr), METH_NOARGS,
     "get_engine_ptr(): raises NotImplementedError: kvpipe has no Mooncake C++ engine to "
     "share."},
    {"close", FN(engine_close), METH_NOARGS,
     "close(): destroy the engine now instead of at garbage collection (kvpipe extension)."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot engine_slots[] = {
    {Py_tp_doc, "TransferEngine()\n\nMooncake's TransferEngine API over kvpipe's engine. Call "
                "initialize() first."},
    {Py_tp_new, engine_new},
    {Py_tp_dealloc, engine_dealloc},
    {Py_tp_methods, engine_methods},
    {0, NULL},
};

/* Not immutable: kvpy_engine_init_type sets TransferOpcode on it. */
static PyType_Spec engine_spec = {"kvpipe.TransferEngine", sizeof(kvpy_engine), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, engine_slots};

/* kvpipe.TransferOpcode: an IntEnum, so ints and members both work. */
static PyObject *make_opcode_enum(void)
{
    PyObject *enum_mod = PyImport_ImportModule("enum");
    if (!enum_mod) return NULL;
    PyObject *result = PyObject_CallMethod(enum_mod, "IntEnum", "s[(si)(si)]", "TransferOpcode",
                                           "Read", (int)KVP_OP_READ, "Write", (int)KVP_OP_WRITE);
    Py_DECREF(enum_mod);
    PyObject *name = result ? PyUnicode_FromString("kvpipe") : NULL;
    if (result && (!name || PyObject_SetAttrString(result, "__module__", name) < 0))
        Py_CLEAR(result);
    Py_XDECREF(name);
    return result;
}

int kvpy_engine_init_type(PyObject *module)
{
    PyObject *engine_type = PyType_FromSpec(&engine_spec);
    if (!engine_type) return -1;
    opcode_enum = make_opcode_enum();
    /* Mooncake exposes the enum on the class and its values on the module. */
    if (!opcode_enum || PyObject_SetAttrString(engine_type, "TransferOpcode", opcode_enum) < 0) {
        Py_DECREF(engine_type);
        return -1;
    }
    Py_INCREF(opcode_enum);
    if (PyModule_AddObject(module, "TransferOpcode", opcode_enum) < 0) return -1;
    PyObject *rd = PyObject_GetAttrString(opcode_enum, "Read");
    PyObject *wr = PyObject_GetAttrString(opcode_enum, "Write");
    if (!rd || !wr || PyModule_AddObject(module, "Read", rd) < 0 ||
        PyModule_AddObject(module, "Write", wr) < 0)
        return -1;
    return PyModule_AddObject(module, "TransferEngine", engine_type);
}
