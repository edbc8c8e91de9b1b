/* kvpipe.Pipe: the tensor pipe (vLLM's MooncakePipe semantics) for Python.
 *
 * send_tensor() takes any object that exports DLPack (torch, numpy >= 1.22,
 * ...) or the buffer protocol, in CPU memory or on a CUDA device (DLPack, or
 * __cuda_array_interface__), or None; the bytes are copied once, into the
 * engine's registered memory (by the CUDA driver from a device), before it
 * returns. recv_tensor() returns a kvpipe.Tensor whose data lives in the buffer
 * the peer's bytes were READ into (no copy), or None; with a CUDA device (its
 * device= or the Pipe's), a kvpipe.Tensor on that device (one host-to-device
 * copy), as MooncakePipe's tensor.to(self.device).
 *
 * Sending without the copy: alloc_tensor() returns a kvpipe.Tensor whose data
 * already lies in registered memory (kvp_pipe_tensor_alloc); the caller fills
 * it through numpy / torch / memoryview and send_tensor_take() announces it in
 * place (kvp_pipe_send_take). The pipe then owns the memory and frees it when
 * the peer acknowledges, so the take is refused (BufferError) while any array,
 * memoryview or DLPack capsule made from the tensor is alive, and the tensor
 * is dead afterwards (its exports raise ValueError). A failed take changes
 * nothing. A tensor never taken is freed with the Tensor, also after close().
 * Such a tensor is tagged with its kvp_pipe: the library keeps that struct
 * alive while the tensor lives, so no other pipe can have its address.
 *
 * Threads: one thread may send while another receives; the GIL is released
 * while either waits. close() refuses while another thread is inside a call.
 */
#include "kvpy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpipe/metrics.h"
#include "kvpipe/pipe.h"
#include "kvpipe/tensor.h"

typedef struct kvpy_pipe {
    PyObject_HEAD
    kvp_pipe *pipe;
    kvp_pipe_config *cfg;
    int busy;            /* calls running with the GIL released */
    int device;          /* recv_tensor's default: -1 CPU, else the CUDA device */
    int device_ok;       /* 1 + the CUDA device a tensor was put on, 0: none yet */
    int send_timeout_ms; /* opts.send_timeout_ms, for send_tensor_async */
} kvpy_pipe;

/* ---- dtypes between kvpipe and DLPack ----------------------------------------- */

static const struct {
    kvp_dtype kvp;
    uint8_t code, bits;
} dtype_map[] = {
    {KVP_DTYPE_BOOL, kDLBool, 8},
    {KVP_DTYPE_U8, kDLUInt, 8},
    {KVP_DTYPE_I8, kDLInt, 8},
    {KVP_DTYPE_I16, kDLInt, 16},
    {KVP_DTYPE_U16, kDLUInt, 16},
    {KVP_DTYPE_I32, kDLInt, 32},
    {KVP_DTYPE_U32, kDLUInt, 32},
    {KVP_DTYPE_I64, kDLInt, 64},
    {KVP_DTYPE_U64, kDLUInt, 64},
    {KVP_DTYPE_F16, kDLFloat, 16},
    {KVP_DTYPE_BF16, kDLBfloat, 16},
    {KVP_DTYPE_F32, kDLFloat, 32},
    {KVP_DTYPE_F64, kDLFloat, 64},
    {KVP_DTYPE_F8_E4M3, kDLFloat8_e4m3fn, 8},
    {KVP_DTYPE_F8_E5M2, kDLFloat8_e5m2, 8},
};
#define N_DTYPE_MAP (sizeof dtype_map / sizeof dtype_map[0])

static int dl_from_kvp(kvp_dtype d, DLDataType *out)
{
    for (size_t i = 0; i < N_DTYPE_MAP; i++) {
        if (dtype_map[i].kvp == d) {
            *out = (DLDataType){dtype_map[i].code, dtype_map[i].bits, 1};
            return 0;
        }
    }
    return -1;
}

static int kvp_from_dl(DLDataType dt, kvp_dtype *out)
{
    for (size_t i = 0; i < N_DTYPE_MAP; i++) {
        if (dt.lanes == 1 && dtype_map[i].code == dt.code && dtype_map[i].bits == dt.bits) {
            *out = dtype_map[i].kvp;
            return 0;
        }
    }
    return -1;
}

/* A struct-module format code (native or little-endian) to a dtype. */
static int kvp_from_format(const char *fmt, Py_ssize_t itemsize, kvp_dtype *out)
{
    if (!fmt) fmt = "B";
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return -1;
    int is_signed = 0;
    switch (fmt[0]) {
    case '?':
        *out = KVP_DTYPE_BOOL;
        return itemsize == 1 ? 0 : -1;
    case 'e':
        *out = KVP_DTYPE_F16;
        return itemsize == 2 ? 0 : -1;
    case 'f':
        *out = KVP_DTYPE_F32;
        return itemsize == 4 ? 0 : -1;
    case 'd':
        *out = KVP_DTYPE_F64;
        return itemsize == 8 ? 0 : -1;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
    case 'n':
        is_signed = 1;
        break;
    case 'B':
    case 'c':
    case 'H':
    case 'I':
    case 'L':
    case 'Q':
    case 'N':
        break;
    default:
        return -1;
    }
    /* Integer codes: the width is the item size ('l' is 8 bytes here, 4 on
     * other ABIs). */
    static const kvp_dtype s[] = {KVP_DTYPE_I8, KVP_DTYPE_I16, KVP_DTYPE_I32, KVP_DTYPE_I64};
    static const kvp_dtype u[] = {KVP_DTYPE_U8, KVP_DTYPE_U16, KVP_DTYPE_U32, KVP_DTYPE_U64};
    int idx = itemsize == 1 ? 0 : itemsize == 2 ? 1 : itemsize == 4 ? 2 : itemsize == 8 ? 3 : -1;
    if (idx < 0) return -1;
    *out = is_signed ? s[idx] : u[idx];
    return 0;
}

/* ---- what send_tensor() holds while it sends ------------------------------------ */

/* A borrowed view of the caller's object: the DLPack capsule's managed tensor
 * or a buffer view, released after the send. */
typedef struct src_view {
    kvp_tensor t;
    DLManagedTensor *dl;
    Py_buffer buf;
    int have_buf;
} src_view;

static void src_release(src_view *v)
{
    if (v->dl && v->dl->deleter) v->dl->deleter(v->dl);
    v->dl = NULL;
    if (v->have_buf) PyBuffer_Release(&v->buf);
    v->have_buf = 0;
}

static int dl_is_compact(const DLTensor *dl)
{
    if (!dl->strides) return 1;
    int64_t expect = 1;
    for (int i = dl->ndim - 1; i >= 0; i--) {
        if (dl->shape[i] == 0) return 1; /* empty: no element to misplace */
        if (dl->shape[i] != 1 && dl->strides[i] != expect) return 0;
        expect *= dl->shape[i];
    }
    return 1;
}

static int view_from_dltensor(src_view *v, const DLTensor *dl)
{
    kvp_dtype dt;
    /* CUDA memory goes as it is: kvp_pipe_send copies it with the driver. */
    int type = (int)dl->device.device_type;
    if (type != kDLCPU && type != kDLCUDA && type != kDLCUDAHost && type != kDLCUDAManaged) {
        PyErr_Format(PyExc_ValueError,
                     "send_tensor: the tensor is on DLPack device type %d; kvpipe "
                     "sends CPU and CUDA memory (move it to one of them first)",
                     type);
        return -1;
    }
    if (kvp_from_dl(dl->dtype, &dt)) {
        PyErr_Format(PyExc_TypeError,
                     "send_tensor: DLPack dtype (code %d, %d bits, %d lanes) "
                     "has no safetensors equivalent",
                     dl->dtype.code, dl->dtype.bits, dl->dtype.lanes);
        return -1;
    }
    if (!dl_is_compact(dl)) {
        PyErr_SetString(PyExc_ValueError, "send_tensor: the tensor is not contiguous (call "
                                          ".contiguous() / numpy.ascontiguousarray first)");
        return -1;
    }
    void *data = dl->data ? (char *)dl->data + dl->byte_offset : NULL;
    kvp_status st = kvp_tensor_init(&v->t, dt, dl->ndim, dl->shape, data);
    if (st) {
        kvpy_raise(st, "send_tensor");
        return -1;
    }
    return 0;
}

/* Take obj through DLPack. Returns 1 on success, 0 when obj could not export
 * (the caller tries the buffer protocol; the exception is cleared when it can),
 * -1 on an error to report. */
static int view_from_dlpack(src_view *v, PyObject *obj)
{
    /* A CUDA producer is asked for the legacy default stream (1), which the
     * driver's copy in kvp_pipe_send runs on: the producer orders its pending
     * work before it (the DLPack protocol's stream argument). */
    int cuda = 0;
    PyObject *dev = PyObject_HasAttrString(obj, "__dlpack_device__")
                        ? PyObject_CallMethod(obj, "__dlpack_device__", NULL)
                        : NULL;
    if (dev) {
        int type = 0, id = 0;
        cuda =
            PyArg_ParseTuple(dev, "ii", &type, &id) && (type == kDLCUDA || type == kDLCUDAManaged);
        Py_DECREF(dev);
    }
    PyErr_Clear(); /* no device, or a strange one: __dlpack__ says more */
    PyObject *capsule;
    if (cuda) {
        PyObject *args = PyTuple_New(0), *kw = Py_BuildValue("{s:i}", "stream", 1);
        PyObject *meth = PyObject_GetAttrString(obj, "__dlpack__");
        capsule = args && kw && meth ? PyObject_Call(meth, args, kw) : NULL;
        Py_XDECREF(args);
        Py_XDECREF(kw);
        Py_XDECREF(meth);
    } else {
        capsule = PyObject_CallMethod(obj, "__dlpack__", NULL);
    }
    if (!capsule) return PyObject_CheckBuffer(obj) ? (PyErr_Clear(), 0) : -1;
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
    if (!mt) {
        Py_DECREF(capsule);
        return -1;
    }
    /* Consumed: from here on the deleter is ours to call, not the capsule's. */
    if (PyCapsule_SetName(capsule, "used_dltensor") < 0) {
        Py_DECREF(capsule);
        return -1;
    }
    Py_DECREF(capsule);
    v->dl = mt;
    return view_from_dltensor(v, &mt->dl_tensor) ? -1 : 1;
}

static int view_from_buffer(src_view *v, PyObject *obj)
{
    if (PyObject_GetBuffer(obj, &v->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    v->have_buf = 1;
    kvp_dtype dt;
    if (kvp_from_format(v->buf.format, v->buf.itemsize, &dt)) {
        PyErr_Format(PyExc_TypeError,
                     "send_tensor: buffer format '%s' (item size %zd) has no "
                     "safetensors dtype",
                     v->buf.format ? v->buf.format : "B", v->buf.itemsize);
        return -1;
    }
    int64_t shape[KVP_TENSOR_MAX_NDIM];
    if (v->buf.ndim > KVP_TENSOR_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "send_tensor: %d dimensions, at most %d", v->buf.ndim,
                     KVP_TENSOR_MAX_NDIM);
        return -1;
    }
    for (int i = 0; i < v->buf.ndim; i++)
        shape[i] = v->buf.shape[i];
    kvp_status st = kvp_tensor_init(&v->t, dt, v->buf.ndim, shape, v->buf.len ? v->buf.buf : NULL);
    if (st) {
        kvpy_raise(st, "send_tensor");
        return -1;
    }
    return 0;
}

/* numpy's typestr (as __cuda_array_interface__ writes it) to a dtype. */
static int dtype_from_typestr(const char *ts, kvp_dtype *out)
{
    static const struct {
        const char *ts;
        kvp_dtype dt;
    } t[] = {{"b1", KVP_DTYPE_BOOL}, {"i1", KVP_DTYPE_I8},  {"i2", KVP_DTYPE_I16},
             {"i4", KVP_DTYPE_I32},  {"i8", KVP_DTYPE_I64}, {"u1", KVP_DTYPE_U8},
             {"u2", KVP_DTYPE_U16},  {"u4", KVP_DTYPE_U32}, {"u8", KVP_DTYPE_U64},
             {"f2", KVP_DTYPE_F16},  {"f4", KVP_DTYPE_F32}, {"f8", KVP_DTYPE_F64}};
    if (!ts || (ts[0] != '<' && ts[0] != '|')) return -1; /* little-endian only */
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        if (strcmp(ts + 1, t[i].ts) == 0) {
            *out = t[i].dt;
            return 0;
        }
    }
    return -1;
}

/* An object on a CUDA device that has __cuda_array_interface__ (version 2 or
 * 3) and no DLPack: contiguous, little-endian, and with no stream to
 * synchronise with (kvpipe cannot wait for a foreign stream). */
static int view_from_cai(src_view *v, PyObject *obj)
{
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");
    if (!cai) return -1;
    int rc = -1;
    PyObject *shape = PyDict_Check(cai) ? PyDict_GetItemString(cai, "shape") : NULL;
    PyObject *ts = PyDict_Check(cai) ? PyDict_GetItemString(cai, "typestr") : NULL;
    PyObject *data = PyDict_Check(cai) ? PyDict_GetItemString(cai, "data") : NULL;
    PyObject *strides = PyDict_Check(cai) ? PyDict_GetItemString(cai, "strides") : NULL;
    PyObject *stream = PyDict_Check(cai) ? PyDict_GetItemString(cai, "stream") : NULL;
    PyObject *mask = PyDict_Check(cai) ? PyDict_GetItemString(cai, "mask") : NULL;
    kvp_dtype dt;
    int64_t dims[KVP_TENSOR_MAX_NDIM];
    Py_ssize_t ndim = shape && PyTuple_Check(shape) ? PyTuple_Size(shape) : -1;
    if (!shape || !ts || !data || !PyTuple_Check(data) || PyTuple_Size(data) < 1 || ndim < 0) {
        PyErr_SetString(PyExc_ValueError, "send_tensor: malformed __cuda_array_interface__ (shape, "
                                          "typestr and data are required)");
    } else if (!PyUnicode_Check(ts) || dtype_from_typestr(PyUnicode_AsUTF8AndSize(ts, NULL), &dt)) {
        PyErr_Format(PyExc_TypeError,
                     "send_tensor: __cuda_array_interface__ typestr %R has no safetensors "
                     "dtype (little-endian bool, ints and floats)",
                     ts);
    } else if (ndim > KVP_TENSOR_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "send_tensor: %zd dimensions, at most %d", ndim,
                     KVP_TENSOR_MAX_NDIM);
    } else if ((strides && strides != Py_None) || (mask && mask != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "send_tensor: the __cuda_array_interface__ object is "
                                          "strided or masked; make it contiguous first");
    } else if (stream && stream != Py_None) {
        PyErr_SetString(PyExc_ValueError,
                        "send_tensor: the __cuda_array_interface__ names a stream, which kvpipe "
                        "cannot wait for; synchronise it first, or pass an object with DLPack");
    } else {
        rc = 0;
        for (Py_ssize_t i = 0; i < ndim && rc == 0; i++) {
            long long d = PyLong_AsLongLong(PyTuple_GetItem(shape, i));
            if (d == -1 && PyErr_Occurred()) rc = -1;
            dims[i] = d;
        }
        unsigned long long ptr = rc ? 0 : PyLong_AsUnsignedLongLong(PyTuple_GetItem(data, 0));
        if (!rc && PyErr_Occurred()) rc = -1;
        kvp_status st =
            rc ? KVP_OK : kvp_tensor_init(&v->t, dt, (int)ndim, dims, (void *)(uintptr_t)ptr);
        if (!rc && st) rc = (kvpy_raise(st, "send_tensor"), -1);
    }
    Py_DECREF(cai);
    return rc;
}

static int view_from_object(src_view *v, PyObject *obj)
{
    memset(v, 0, sizeof *v);
    /* DLPack first: it carries bfloat16 and float8, which buffers cannot. */
    if (PyObject_HasAttrString(obj, "__dlpack__")) {
        int rc = view_from_dlpack(v, obj);
        if (rc != 0) return rc > 0 ? 0 : -1;
    }
    if (!PyObject_CheckBuffer(obj) && PyObject_HasAttrString(obj, "__cuda_array_interface__"))
        return view_from_cai(v, obj);
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "send_tensor: expected None or an object exporting DLPack, "
                     "__cuda_array_interface__ or the buffer protocol, not %.100s",
                     kvpy_type_name(obj));
        return -1;
    }
    return view_from_buffer(v, obj);
}

/* ---- Pipe ------------------------------------------------------------------------ */

static int pipe_ready(kvpy_pipe *self)
{
    if (self->pipe) return 0;
    PyErr_SetString(kvpy_error_type, "the Pipe is closed");
    return -1;
}

static void pipe_teardown(kvpy_pipe *self)
{
    kvp_pipe *p = self->pipe;
    self->pipe = NULL;
    if (p) {
        Py_BEGIN_ALLOW_THREADS
        kvp_pipe_close(p);
        Py_END_ALLOW_THREADS
    }
    kvp_pipe_config_free(self->cfg);
    self->cfg = NULL;
}

static void pipe_dealloc(kvpy_pipe *self)
{
    pipe_teardown(self);
    kvpy_free_instance((PyObject *)self);
}

/* config: a path (str / os.PathLike), a dict, or None for MOONCAKE_CONFIG_PATH. */
static kvp_status load_config(PyObject *config, kvp_pipe_config **out)
{
    kvp_status st;
    if (config == Py_None) return kvp_pipe_config_load_env(out);
    if (PyDict_Check(config)) {
        PyObject *json = PyImport_ImportModule("json");
        PyObject *text = json ? PyObject_CallMethod(json, "dumps", "O", config) : NULL;
        Py_XDECREF(json);
        Py_ssize_t len = 0;
        const char *s = text ? PyUnicode_AsUTF8AndSize(text, &len) : NULL;
        if (!s) {
            Py_XDECREF(text);
            return KVP_EINTR; /* a Python error is set */
        }
        st = kvp_pipe_config_parse(s, (size_t)len, out);
        Py_DECREF(text);
        return st;
    }
    PyObject *path = NULL;
    if (!PyUnicode_FSConverter(config, &path)) return KVP_EINTR;
    st = kvp_pipe_config_load(PyBytes_AsString(path), out);
    Py_DECREF(path);
    return st;
}

static int ms_from_seconds(PyObject *obj, int *out, const char *what)
{
    if (!obj || obj == Py_None) return 0;
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred()) return -1;
    if (!(s >= 0 && s < 2e6)) {
        PyErr_Format(PyExc_ValueError, "%s must be between 0 and 2e6 seconds", what);
        return -1;
    }
    *out = (int)(s * 1000.0 + 0.5);
    return 0;
}

/* A device as torch names it: None or "cpu" (-1), "cuda" (device 0),
 * "cuda:N", an int N, or an object whose str() is one of these (a
 * torch.device). Returns 0, or -1 with ValueError. */
static int device_conv(PyObject *obj, int *out)
{
    if (!obj || obj == Py_None) {
        *out = -1;
        return 0;
    }
    if (PyLong_Check(obj)) {
        long d = PyLong_AsLong(obj);
        if (d >= 0 && d < 1024) {
            *out = (int)d;
            return 0;
        }
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "device %ld is out of range", d);
        return -1;
    }
    PyObject *str = PyObject_Str(obj);
    const char *name = str ? PyUnicode_AsUTF8AndSize(str, NULL) : NULL;
    int rc = -1, n = -1, used = 0;
    if (name && strcmp(name, "cpu") == 0) {
        *out = -1;
        rc = 0;
    } else if (name && strcmp(name, "cuda") == 0) {
        *out = 0;
        rc = 0;
    } else if (name && sscanf(name, "cuda:%d%n", &n, &used) == 1 && name[used] == '\0' && n >= 0 &&
               n < 1024) {
        *out = n;
        rc = 0;
    }
    if (rc && name)
        PyErr_Format(PyExc_ValueError,
                     "device %R: expected None, 'cpu', 'cuda', 'cuda:N' or an int N", obj);
    Py_XDECREF(str);
    return rc;
}

/* kv_buffer_size as vLLM writes it: an int or an integral float such as 1e9. */
static int buffer_size_conv(PyObject *obj, void *out)
{
    if (!PyFloat_Check(obj)) return kvpy_size_conv(obj, out);
    double d = PyFloat_AsDouble(obj);
    if (!(d >= 0 && d <= 9.0e18) || d != (double)(unsigned long long)d) {
        PyErr_SetString(PyExc_ValueError, "kv_buffer_size must be a non-negative whole number");
        return 0;
    }
    *(size_t *)out = (size_t)d;
    return 1;
}

static int pipe_init(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {
        "config",           "local_rank",  "kv_rank",           "kv_buffer_size",
        "send_timeout",     "io_timeout",  "max_message_bytes", "disable_shm",
        "inline_max_bytes", "recv_window", "recv_window_bytes", "max_control_frame",
        "redial_min",       "redial_max",  "ack_timeout",       "ack_linger",
        "ack_delay_us",     "zmq_hwm",     "busy_poll_us",      "device",
        "integrity",        NULL};
    PyObject *config, *send_timeout = NULL, *io_timeout = NULL, *redial_min = NULL,
                      *redial_max = NULL, *ack_timeout = NULL, *ack_linger = NULL, *device = NULL,
                      *integrity = NULL;
    int local_rank, kv_rank, disable_shm = 0;
    kvp_pipe_opts opts;
    kvp_pipe_opts_init(&opts);
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "Oii|$O&OOO&pO&iO&O&OOOOiiiOO:Pipe", kwlist, &config, &local_rank, &kv_rank,
            buffer_size_conv, &opts.kv_buffer_size, &send_timeout, &io_timeout, kvpy_size_conv,
            &opts.max_message_bytes, &disable_shm, kvpy_size_conv, &opts.inline_max_bytes,
            &opts.recv_window, kvpy_size_conv, &opts.recv_window_bytes, kvpy_size_conv,
            &opts.max_control_frame, &redial_min, &redial_max, &ack_timeout, &ack_linger,
            &opts.ack_delay_us, &opts.zmq_hwm, &opts.busy_poll_us, &device, &integrity))
        return -1;
    /* None (the default): env KVPIPE_INTEGRITY, off when unset. */
    if (integrity && integrity != Py_None) {
        int on = PyObject_IsTrue(integrity);
        if (on < 0) return -1;
        opts.integrity = on;
    }
    if (device_conv(device, &self->device)) return -1;
    self->device_ok = 0;
    if (ms_from_seconds(send_timeout, &opts.send_timeout_ms, "send_timeout") ||
        ms_from_seconds(io_timeout, &opts.io_timeout_ms, "io_timeout") ||
        ms_from_seconds(redial_min, &opts.redial_min_ms, "redial_min") ||
        ms_from_seconds(redial_max, &opts.redial_max_ms, "redial_max") ||
        ms_from_seconds(ack_timeout, &opts.ack_timeout_ms, "ack_timeout") ||
        ms_from_seconds(ack_linger, &opts.ack_linger_ms, "ack_linger"))
        return -1;
    opts.disable_shm = disable_shm;
    self->send_timeout_ms = opts.send_timeout_ms;
    if (self->busy) {
        PyErr_SetString(kvpy_error_type, "Pipe.__init__: the pipe is in use by another thread");
        return -1;
    }
    if (self->pipe) pipe_teardown(self); /* __init__ called again */
    kvp_status st = load_config(config, &self->cfg);
    if (st == KVP_EINTR && PyErr_Occurred()) return -1;
    if (st) return kvpy_raise(st, "kvpipe.Pipe: config"), -1;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_pipe_open(self->cfg, local_rank, kv_rank, &opts, &self->pipe);
    Py_END_ALLOW_THREADS
    if (st) return kvpy_raise(st, "kvpipe.Pipe"), -1;
    return 0;
}

/* Send obj (None included) with kvp_pipe_send_timeout: timeout_ms as the
 * pipe's send_timeout (negative), or 0, a try that does not wait: then
 * False when it would have had to (nothing sent), True when it went. */
static PyObject *send_object(kvpy_pipe *self, PyObject *obj, int timeout_ms)
{
    if (pipe_ready(self)) return NULL;
    src_view v;
    const kvp_tensor *t = NULL;
    if (obj != Py_None) {
        if (view_from_object(&v, obj) < 0) {
            src_release(&v);
            return NULL;
        }
        t = &v.t;
    }
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = timeout_ms ? kvp_pipe_send(self->pipe, t) : kvp_pipe_send_timeout(self->pipe, t, 0);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (t) src_release(&v);
    if (!timeout_ms && st == KVP_ETIMEDOUT) Py_RETURN_FALSE;
    if (st) return kvpy_raise(st, "send_tensor");
    if (!timeout_ms) Py_RETURN_TRUE;
    Py_RETURN_NONE;
}

static PyObject *pipe_send_tensor(kvpy_pipe *self, PyObject *obj)
{
    return send_object(self, obj, -1);
}

/* The asyncio glue's try (python/kvpipe_aio.py, pipe_send). */
static PyObject *pipe_aio_send(kvpy_pipe *self, PyObject *obj)
{
    return send_object(self, obj, 0);
}

static PyObject *received(kvpy_pipe *self, kvp_status st, kvp_tensor *t, int device);

/* Receive within timeout_ms (negative: no limit): kvp_pipe_recv without
 * waiting, and between tries a wait on the pipe's recv_fd with the GIL
 * released. Returns 0 with *status (and *t), 1 when the time ran out, -1
 * when a signal handler raised (Ctrl-C): nothing was consumed. */
static int recv_waiting(kvpy_pipe *self, int timeout_ms, kvp_status *status, kvp_tensor **t)
{
    uint64_t deadline = kvpy_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    int last = 0; /* the wait reached the deadline: this try is the last */
    for (;;) {
        /* The last try waits a millisecond: kvp_pipe_recv counts a timeout
         * (recv_timeouts) only for a wait, never for a look. */
        Py_BEGIN_ALLOW_THREADS
        *status = kvp_pipe_recv(self->pipe, last, t);
        Py_END_ALLOW_THREADS
        if (*status != KVP_ETIMEDOUT) return 0;
        if (last) return 1;
        int left = -1;
        if (timeout_ms >= 0) {
            uint64_t now = kvpy_now_ms();
            left = now >= deadline ? 0 : (int)(deadline - now);
        }
        int rc = kvpy_wait_fd(kvp_pipe_recv_fd(self->pipe), left);
        if (rc < 0) return -1;
        last = rc;
    }
}

static void release_pipe_tensor(void *ctx)
{
    kvp_tensor_free(ctx);
}

/* A kvpipe.Tensor owning t, a heap tensor of the pipe (received or allocated);
 * take_tag as kvpy_tensor_new(). t is freed on failure. */
static PyObject *wrap_pipe_tensor(kvp_tensor *t, const void *take_tag, const char *what)
{
    DLDataType dt;
    if (dl_from_kvp(t->dtype, &dt)) {
        int dtype = (int)t->dtype;
        kvp_tensor_free(t);
        return PyErr_Format(kvpy_error_type, "%s: dtype %d has no DLPack equivalent", what, dtype);
    }
    return kvpy_tensor_new(t->data, dt, t->ndim, t->shape, release_pipe_tensor, t, take_tag);
}

/* A received tensor t put on CUDA device `device`: one host-to-device copy;
 * the host tensor goes back to the pipe. t is freed either way. */
static PyObject *wrap_on_device(kvpy_pipe *self, kvp_tensor *t, int device)
{
    kvp_tensor *d = NULL;
    kvp_status st;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_tensor_to_cuda(t, device, &d);
    Py_END_ALLOW_THREADS
    kvp_tensor_free(t);
    if (st)
        return kvpy_raise(st, "recv_tensor: the tensor arrived but could not be put on the device");
    self->device_ok = device + 1;
    PyObject *obj = wrap_pipe_tensor(d, NULL, "recv_tensor");
    if (obj) kvpy_tensor_set_cuda(obj, device);
    return obj;
}

/* Before a tensor is taken from the pipe for a device: that the device
 * serves (once per Pipe and device), so that a missing driver or a wrong
 * ordinal loses no tensor. */
static int check_device(kvpy_pipe *self, int device)
{
    if (device < 0 || self->device_ok == device + 1) return 0;
    int64_t zero = 0;
    kvp_tensor empty, *d = NULL;
    kvp_status st = kvp_tensor_init(&empty, KVP_DTYPE_U8, 1, &zero, NULL);
    if (!st) {
        Py_BEGIN_ALLOW_THREADS
        st = kvp_tensor_to_cuda(&empty, device, &d);
        Py_END_ALLOW_THREADS
    }
    kvp_tensor_free(d);
    if (st) return kvpy_raise(st, "recv_tensor: device"), -1;
    self->device_ok = device + 1;
    return 0;
}

static PyObject *pipe_recv_tensor(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", "device", NULL};
    PyObject *timeout = Py_None, *device_obj = Py_None;
    int timeout_ms = -1, device = self->device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:recv_tensor", kwlist, &timeout,
                                     &device_obj) ||
        ms_from_seconds(timeout, &timeout_ms, "timeout") ||
        (device_obj != Py_None && device_conv(device_obj, &device)) || pipe_ready(self) ||
        check_device(self, device))
        return NULL;
    kvp_status st = KVP_OK;
    kvp_tensor *t = NULL;
    self->busy++;
    int rc = recv_waiting(self, timeout_ms, &st, &t);
    self->busy--;
    if (rc < 0) return NULL; /* Ctrl-C: nothing was consumed */
    if (rc > 0)
        return kvpy_raise_text(KVP_ETIMEDOUT, "recv_tensor: nothing arrived within the timeout");
    return received(self, st, t, device);
}

/* What recv_tensor hands out for kvp_pipe_recv's answer. */
static PyObject *received(kvpy_pipe *self, kvp_status st, kvp_tensor *t, int device)
{
    if (st) return kvpy_raise(st, "recv_tensor");
    if (!t) Py_RETURN_NONE;
    if (device >= 0) return wrap_on_device(self, t, device);
    return wrap_pipe_tensor(t, NULL, "recv_tensor");
}

/* The asyncio glue's try (python/kvpipe_aio.py, pipe_recv): (True, tensor
 * or None) when one was handed out, (False, None) when none is ready. */
static PyObject *pipe_aio_recv(kvpy_pipe *self, PyObject *args)
{
    PyObject *device_obj;
    int last; /* the deadline passed: wait 1 ms, so that the timeout counts */
    int device = self->device;
    if (!PyArg_ParseTuple(args, "Op:_aio_recv", &device_obj, &last) ||
        (device_obj != Py_None && device_conv(device_obj, &device)) || pipe_ready(self) ||
        check_device(self, device))
        return NULL;
    kvp_status st;
    kvp_tensor *t = NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_pipe_recv(self->pipe, last, &t);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (st == KVP_ETIMEDOUT) return Py_BuildValue("(OO)", Py_False, Py_None);
    PyObject *obj = received(self, st, t, device);
    if (!obj) return NULL;
    PyObject *r = Py_BuildValue("(OO)", Py_True, obj);
    Py_DECREF(obj);
    return r;
}

/* recv_tensor_async / send_tensor_async: coroutines of the asyncio glue. */
static PyObject *pipe_recv_tensor_async(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", "device", NULL};
    PyObject *timeout = Py_None, *device_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:recv_tensor_async", kwlist, &timeout,
                                     &device_obj) ||
        pipe_ready(self))
        return NULL;
    PyObject *fd = PyLong_FromLong(kvp_pipe_recv_fd(self->pipe));
    PyObject *r =
        fd ? kvpy_aio_call("pipe_recv", PyTuple_Pack(4, (PyObject *)self, fd, timeout, device_obj))
           : NULL;
    Py_XDECREF(fd);
    return r;
}

static PyObject *pipe_send_tensor_async(kvpy_pipe *self, PyObject *obj)
{
    if (pipe_ready(self)) return NULL;
    PyObject *fd = PyLong_FromLong(kvp_pipe_send_fd(self->pipe));
    PyObject *to = PyFloat_FromDouble((double)self->send_timeout_ms / 1000.0);
    PyObject *r = fd && to
                      ? kvpy_aio_call("pipe_send", PyTuple_Pack(4, (PyObject *)self, fd, obj, to))
                      : NULL;
    Py_XDECREF(fd);
    Py_XDECREF(to);
    return r;
}

/* alloc_tensor's dtype: a name as torch spells it, or an object whose str() is
 * one, possibly after "torch." (numpy.dtype("float32"), torch.float32). */
static int dtype_conv(PyObject *obj, void *out)
{
    PyObject *str = PyObject_Str(obj);
    Py_ssize_t len = 0;
    const char *name = str ? PyUnicode_AsUTF8AndSize(str, &len) : NULL;
    if (!name) {
        Py_XDECREF(str);
        return 0;
    }
    int ok = strlen(name) == (size_t)len; /* no NUL inside */
    if (strncmp(name, "torch.", 6) == 0) name += 6;
    DLDataType dl;
    ok = ok && kvpy_dtype_from_name(name, &dl) == 0 && kvp_from_dl(dl, out) == 0;
    Py_DECREF(str);
    if (!ok)
        PyErr_Format(PyExc_ValueError,
                     "alloc_tensor: unknown dtype %R (expected a name such as 'float32', "
                     "'bfloat16', 'uint8', 'float8_e4m3fn', or a torch.dtype / numpy.dtype of one)",
                     obj);
    return ok;
}

/* alloc_tensor's shape: a sequence of non-negative ints, at most
 * KVP_TENSOR_MAX_NDIM of them. */
static int shape_from_object(PyObject *obj, int64_t *shape, int *ndim)
{
    PyObject *seq = PySequence_Fast(obj, "alloc_tensor: shape must be a sequence of ints");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Size(seq);
    if (n > KVP_TENSOR_MAX_NDIM) {
        PyErr_Format(PyExc_ValueError, "alloc_tensor: %zd dimensions, at most %d", n,
                     KVP_TENSOR_MAX_NDIM);
        Py_DECREF(seq);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        PyObject *index = item ? PyNumber_Index(item) : NULL;
        Py_XDECREF(item);
        long long d = index ? PyLong_AsLongLong(index) : -1;
        Py_XDECREF(index);
        if (d == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
        if (d < 0) {
            PyErr_Format(PyExc_ValueError, "alloc_tensor: dimension %zd is negative (%lld)", i, d);
            Py_DECREF(seq);
            return -1;
        }
        shape[i] = d;
    }
    *ndim = (int)n;
    Py_DECREF(seq);
    return 0;
}

static PyObject *pipe_alloc_tensor(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"shape", "dtype", NULL};
    PyObject *shape_obj;
    kvp_dtype dtype = KVP_DTYPE_U8;
    int64_t shape[KVP_TENSOR_MAX_NDIM];
    int ndim = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O&:alloc_tensor", kwlist, &shape_obj,
                                     dtype_conv, &dtype) ||
        shape_from_object(shape_obj, shape, &ndim) || pipe_ready(self))
        return NULL;
    kvp_tensor *t = NULL;
    kvp_status st;
    /* The engine may have to map and register fresh memory. */
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_pipe_tensor_alloc(self->pipe, dtype, ndim, shape, &t);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (st) return kvpy_raise(st, "alloc_tensor");
    return wrap_pipe_tensor(t, self->pipe, "alloc_tensor");
}

static PyObject *pipe_send_tensor_take(kvpy_pipe *self, PyObject *obj)
{
    if (pipe_ready(self)) return NULL;
    kvp_tensor *t = kvpy_tensor_take_begin(obj, self->pipe);
    if (!t) return NULL;
    kvp_status st;
    /* Until take_end the tensor refuses exports and other takes; the reference
     * keeps it alive while the GIL is released. */
    Py_INCREF(obj);
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_pipe_send_take(self->pipe, t);
    Py_END_ALLOW_THREADS
    self->busy--;
    kvpy_tensor_take_end(obj, st == KVP_OK);
    Py_DECREF(obj);
    if (st) return kvpy_raise(st, "send_tensor_take");
    Py_RETURN_NONE;
}

static PyObject *pipe_flush(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout = Py_None;
    int timeout_ms = 30000;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:flush", kwlist, &timeout) ||
        ms_from_seconds(timeout, &timeout_ms, "timeout") || pipe_ready(self))
        return NULL;
    kvp_status st;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    st = kvp_pipe_flush(self->pipe, timeout_ms);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (st) return kvpy_raise(st, "flush");
    Py_RETURN_NONE;
}

static PyObject *pipe_close(kvpy_pipe *self, PyObject *noargs)
{
    (void)noargs;
    if (self->busy) {
        PyErr_SetString(kvpy_error_type, "Pipe.close(): another thread is still sending or "
                                         "receiving on this pipe");
        return NULL;
    }
    pipe_teardown(self);
    Py_RETURN_NONE;
}

static PyObject *pipe_enter(kvpy_pipe *self, PyObject *noargs)
{
    (void)noargs;
    Py_INCREF((PyObject *)self);
    return (PyObject *)self;
}

static PyObject *pipe_exit(kvpy_pipe *self, PyObject *args)
{
    (void)args;
    return pipe_close(self, NULL);
}

/* stats(prometheus=False): the pipe's counters (as before: sent, received,
 * bytes_sent, ...), its timeouts, and under "engine" its engine's metrics as
 * TransferEngine.stats() gives them; or all of it as Prometheus text. */
static PyObject *pipe_stats(kvpy_pipe *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"prometheus", NULL};
    int prometheus = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|p:stats", kwlist, &prometheus) ||
        pipe_ready(self))
        return NULL;
    kvp_metrics *m;
    kvp_status st = kvp_pipe_metrics(self->pipe, &m);
    if (st) return kvpy_raise(st, "Pipe.stats");
    if (prometheus) {
        PyObject *text = kvpy_metrics_text(m);
        kvp_metrics_free(m);
        return text;
    }
    kvp_pipe_stats s;
    kvp_pipe_get_stats(self->pipe, &s);
    const kvp_metric *send_to = kvp_metrics_find(m, "kvpipe_pipe_timeouts_total", "op=send");
    const kvp_metric *recv_to = kvp_metrics_find(m, "kvpipe_pipe_timeouts_total", "op=recv");
    PyObject *engine = PyDict_New();
    PyObject *out = NULL;
    if (engine && kvpy_metrics_into(m, "kvpipe_engine_", engine) == 0)
        out = Py_BuildValue(
            "{sKsKsKsKsKsKsKsnsnsKsKsnsKsKsKsO}", "sent", (unsigned long long)s.sent, "received",
            (unsigned long long)s.received, "bytes_sent", (unsigned long long)s.bytes_sent,
            "bytes_received", (unsigned long long)s.bytes_received, "acks",
            (unsigned long long)s.acks, "bad_messages", (unsigned long long)s.bad_messages,
            "bad_acks", (unsigned long long)s.bad_acks, "inflight_bytes",
            (Py_ssize_t)s.inflight_bytes, "inflight_count", (Py_ssize_t)s.inflight_count,
            "inline_sent", (unsigned long long)s.inline_sent, "inline_received",
            (unsigned long long)s.inline_received, "peer_inline_max", (Py_ssize_t)s.peer_inline_max,
            "peer_lookups", (unsigned long long)s.peer_lookups, "send_timeouts",
            send_to ? (unsigned long long)send_to->value : 0ull, "recv_timeouts",
            recv_to ? (unsigned long long)recv_to->value : 0ull, "engine", engine);
    Py_XDECREF(engine);
    kvp_metrics_free(m);
    return out;
}

static PyObject *pipe_get_segment_name(kvpy_pipe *self, void *closure)
{
    (void)closure;
    if (pipe_ready(self)) return NULL;
    return PyUnicode_FromString(kvp_pipe_get_endpoints(self->pipe)->local_segment);
}

static PyObject *pipe_get_usable(kvpy_pipe *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->pipe && kvp_pipe_usable(self->pipe));
}

#define FN(f) ((PyCFunction)(void (*)(void))(f))

static PyMethodDef pipe_methods[] = {
    {"send_tensor", FN(pipe_send_tensor), METH_O,
     "send_tensor(tensor)\n\nSend a CPU tensor (DLPack or buffer protocol, contiguous) "
     "or None. The data is copied before this returns. Raises kvpipe.Error."},
    {"alloc_tensor", FN(pipe_alloc_tensor), METH_VARARGS | METH_KEYWORDS,
     "alloc_tensor(shape, dtype=\"uint8\") -> kvpipe.Tensor\n\nA writable tensor whose data "
     "lies in the pipe's registered memory (256-byte aligned, contents unspecified), for "
     "send_tensor_take(). dtype: a name as torch spells it ('float32', 'bfloat16', ...) or a "
     "torch / numpy dtype. Raises kvpipe.Error."},
    {"send_tensor_take", FN(pipe_send_tensor_take), METH_O,
     "send_tensor_take(tensor)\n\nSend a tensor from this pipe's alloc_tensor() without "
     "copying it. BufferError while any array, memoryview or DLPack capsule made from it is "
     "alive. On success the pipe owns the memory and the tensor can no longer be used; on "
     "kvpipe.Error it is unchanged."},
    {"recv_tensor", FN(pipe_recv_tensor), METH_VARARGS | METH_KEYWORDS,
     "recv_tensor(timeout=None, device=None) -> kvpipe.Tensor or None\n\nWait (timeout in "
     "seconds; None: no limit) for the next tensor. device: 'cpu', 'cuda', 'cuda:N', an int "
     "or a torch.device (None: the Pipe's device); on a CUDA device the tensor is copied "
     "there once (the device is checked before a tensor is taken). Ctrl-C interrupts the "
     "wait. Raises kvpipe.Error (status kvpipe.ETIMEDOUT on timeout; after EPROTO / ERANGE "
     "the bad message is dropped and the pipe goes on)."},
    {"recv_tensor_async", FN(pipe_recv_tensor_async), METH_VARARGS | METH_KEYWORDS,
     "recv_tensor_async(timeout=None, device=None) -> coroutine\n\nrecv_tensor() for asyncio: "
     "await it for the next tensor (or None). It waits on the pipe's receive descriptor with "
     "the running loop's add_reader, never on a thread; cancelling the awaiting task takes "
     "nothing from the pipe. Raises as recv_tensor()."},
    {"send_tensor_async", FN(pipe_send_tensor_async), METH_O,
     "send_tensor_async(tensor) -> coroutine\n\nsend_tensor() for asyncio: the data is "
     "copied when the send goes; while the peer's ACKs have not made room (kv_buffer_size) "
     "it waits on the pipe's send descriptor with add_reader, and retries every 10 ms while "
     "the peer is not connected, up to send_timeout. Cancelling the awaiting task sends "
     "nothing more. Raises as send_tensor()."},
    {"_aio_recv", FN(pipe_aio_recv), METH_VARARGS, NULL},
    {"_aio_send", FN(pipe_aio_send), METH_O, NULL},
    {"flush", FN(pipe_flush), METH_VARARGS | METH_KEYWORDS,
     "flush(timeout=30.0)\n\nWait until the peer has acknowledged every sent tensor."},
    {"stats", FN(pipe_stats), METH_VARARGS | METH_KEYWORDS,
     "stats(prometheus=False) -> dict or str\n\nThe pipe's counters: sent, received, "
     "bytes_sent, bytes_received, acks, bad_messages, bad_acks, inflight_bytes, "
     "inflight_count, send_timeouts, recv_timeouts, and under 'engine' its engine's metrics "
     "as TransferEngine.stats() has them. With prometheus=True, the pipe's and its engine's "
     "metrics as Prometheus text (docs/metrics.md)."},
    {"close", FN(pipe_close), METH_NOARGS,
     "close()\n\nClose at once (received tensors stay valid). Call flush() first on a sender."},
    {"__enter__", FN(pipe_enter), METH_NOARGS, NULL},
    {"__exit__", FN(pipe_exit), METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pipe_getset[] = {
    {"segment_name", (getter)pipe_get_segment_name, NULL, "the engine's segment 'host:port'", NULL},
    {"usable", (getter)pipe_get_usable, NULL, "False once the pipe can no longer work", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot pipe_slots[] = {
    {Py_tp_doc, "Pipe(config, local_rank, kv_rank, *, kv_buffer_size=1e9, send_timeout=30.0,\n"
                "     io_timeout=5.0, max_message_bytes=32 GiB, disable_shm=False,\n"
                "     inline_max_bytes=131072, recv_window=32, recv_window_bytes=64 MiB,\n"
                "     max_control_frame=4096, redial_min=0.2, redial_max=5.0, ack_timeout=2.0,\n"
                "     ack_linger=0.5, ack_delay_us=1000, zmq_hwm=1000, busy_poll_us=0,\n"
                "     device=None, integrity=None)\n\n"
                "One side of a tensor pipe (vLLM's MooncakePipe wire). config: a path to the "
                "mooncake JSON, a dict of it, or None for $MOONCAKE_CONFIG_PATH. kv_rank 0 is "
                "prefill, 1 decode. Times in seconds; the options are kvp_pipe_opts' "
                "(docs/pipe.md); device: where recv_tensor() puts tensors ('cpu', 'cuda:N'; "
                "docs/gpu.md); integrity: check each message's digest (None: env "
                "KVPIPE_INTEGRITY, off when unset; docs/pipe.md)."},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_init, pipe_init},
    {Py_tp_dealloc, pipe_dealloc},
    {Py_tp_methods, pipe_methods},
    {Py_tp_getset, pipe_getset},
    {0, NULL},
};

static PyType_Spec pipe_spec = {"kvpipe.Pipe", sizeof(kvpy_pipe), 0,
                                Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_IMMUTABLETYPE,
                                pipe_slots};

int kvpy_pipe_init_type(PyObject *module)
{
    return kvpy_add_type(module, &pipe_spec, "Pipe", NULL);
}
