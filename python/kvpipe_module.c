/* The kvpipe Python module: exceptions, status helpers and module init. */
#include "kvpy.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "kvpipe_aio_py.h"

#include "kvpipe/kvpipe.h"

PyObject *kvpy_error_type;

/* The detail of the last failure reported through an int return value. Only
 * touched with the GIL held, so one buffer serves every thread; a thread that
 * wants its own failure's text asks right after the failing call. */
static char last_error_text[1024];

static void format_failure(char *buf, size_t cap, kvp_status status, const char *what)
{
    const char *detail = kvp_last_error();
    if (!detail || !*detail) detail = kvp_strerror(status);
    snprintf(buf, cap, "%s: %s", what, detail);
}

PyObject *kvpy_raise_text(kvp_status status, const char *msg)
{
    PyObject *exc = PyObject_CallFunction(kvpy_error_type, "s", msg);
    if (!exc) return NULL;
    PyObject *code = PyLong_FromLong((long)status);
    if (code && PyObject_SetAttrString(exc, "status", code) == 0)
        PyErr_SetObject(kvpy_error_type, exc);
    Py_XDECREF(code);
    Py_DECREF(exc);
    return NULL;
}

PyObject *kvpy_raise(kvp_status status, const char *what)
{
    char msg[1024];
    format_failure(msg, sizeof msg, status, what);
    return kvpy_raise_text(status, msg);
}

int kvpy_fail(kvp_status status, const char *what)
{
    format_failure(last_error_text, sizeof last_error_text, status, what);
    return -(int)status;
}

int kvpy_fail_msg(kvp_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error_text, sizeof last_error_text, fmt, ap);
    va_end(ap);
    return -(int)status;
}

const char *kvpy_type_name(PyObject *obj)
{
    static char buf[200];
    PyObject *type = (PyObject *)Py_TYPE(obj);
    PyObject *qualname = PyType_GetQualName(Py_TYPE(obj));
    PyObject *module = PyObject_GetAttrString(type, "__module__");
    const char *q = qualname ? PyUnicode_AsUTF8AndSize(qualname, NULL) : NULL;
    const char *m =
        module && PyUnicode_Check(module) ? PyUnicode_AsUTF8AndSize(module, NULL) : NULL;
    if (!q)
        snprintf(buf, sizeof buf, "?");
    else if (!m || strcmp(m, "builtins") == 0)
        snprintf(buf, sizeof buf, "%s", q);
    else
        snprintf(buf, sizeof buf, "%s.%s", m, q);
    Py_XDECREF(qualname);
    Py_XDECREF(module);
    PyErr_Clear(); /* a name that could not be had: "?" or the bare qualname does */
    return buf;
}

PyObject *kvpy_alloc_instance(PyTypeObject *type)
{
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    return alloc ? alloc(type, 0) : PyType_GenericAlloc(type, 0);
}

int kvpy_add_type(PyObject *module, PyType_Spec *spec, const char *name, PyTypeObject **keep)
{
    PyObject *type = PyType_FromSpec(spec);
    if (!type) return -1;
    if (keep) {
        Py_INCREF(type);
        *keep = (PyTypeObject *)type;
    }
    return PyModule_AddObject(module, name, type);
}

void kvpy_free_instance(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    freefunc free_fn = (freefunc)PyType_GetSlot(type, Py_tp_free);
    if (free_fn)
        free_fn(self);
    else
        PyObject_Free(self);
    Py_DECREF(type);
}

static int to_u64(PyObject *obj, const char *what, unsigned long long *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, kvpy_type_name(obj));
        return 0;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_OverflowError, "%s must be a non-negative int below 2**64", what);
        return 0;
    }
    *out = v;
    return 1;
}

int kvpy_addr_conv(PyObject *obj, void *out)
{
    unsigned long long v;
    if (!to_u64(obj, "an address", &v)) return 0;
    *(uint64_t *)out = (uint64_t)v;
    return 1;
}

int kvpy_size_conv(PyObject *obj, void *out)
{
    unsigned long long v;
    if (!to_u64(obj, "a length", &v)) return 0;
    if (v > (unsigned long long)PY_SSIZE_T_MAX) {
        PyErr_SetString(PyExc_OverflowError, "a length must fit in a Py_ssize_t");
        return 0;
    }
    *(size_t *)out = (size_t)v;
    return 1;
}

int kvpy_eventfd(void)
{
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) PyErr_SetFromErrno(PyExc_OSError);
    return fd;
}

void kvpy_eventfd_done(struct kvp_batch *batch, void *user_data)
{
    (void)batch;
    uint64_t one = 1;
    /* An eventfd takes it unless full (2^64 - 2): nothing else can fail. */
    if (write((int)(intptr_t)user_data, &one, sizeof one) < 0) return;
}

uint64_t kvpy_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

int kvpy_wait_fd(int fd, int timeout_ms)
{
    uint64_t deadline = kvpy_now_ms() + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0);
    for (;;) {
        int wait = 1000;
        if (timeout_ms >= 0) {
            uint64_t now = kvpy_now_ms();
            if (now >= deadline) return 1;
            if (deadline - now < 1000) wait = (int)(deadline - now);
        }
        int r, err;
        Py_BEGIN_ALLOW_THREADS
        struct pollfd p = {.fd = fd, .events = POLLIN};
        r = poll(&p, 1, wait);
        err = errno;
        Py_END_ALLOW_THREADS
        if (r > 0) return 0;
        if (r < 0 && err != EINTR) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) return -1;
    }
}

PyObject *kvpy_aio;

PyObject *kvpy_aio_call(const char *name, PyObject *args)
{
    if (!args) return NULL;
    PyObject *fn = kvpy_aio ? PyDict_GetItemString(kvpy_aio, name) : NULL; /* borrowed */
    PyObject *out = fn ? PyObject_CallObject(fn, args) : NULL;
    if (!fn) PyErr_Format(PyExc_RuntimeError, "kvpipe: no asyncio glue function %s", name);
    Py_DECREF(args);
    return out;
}

/* Run the glue's source into a namespace of its own. */
static int aio_init(void)
{
    PyObject *builtins = PyImport_ImportModule("builtins");
    PyObject *ns = PyDict_New();
    PyObject *name = PyUnicode_FromString("kvpipe._aio");
    PyObject *r = NULL;
    if (builtins && ns && name && PyDict_SetItemString(ns, "__name__", name) == 0)
        r = PyObject_CallMethod(builtins, "exec", "sO", kvpy_aio_source, ns);
    Py_XDECREF(builtins);
    Py_XDECREF(name);
    if (!r) {
        Py_XDECREF(ns);
        return -1;
    }
    Py_DECREF(r);
    kvpy_aio = ns;
    return 0;
}

static PyObject *mod_last_error(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyUnicode_DecodeUTF8(last_error_text, (Py_ssize_t)strlen(last_error_text), "replace");
}

static PyObject *mod_strerror(PyObject *self, PyObject *arg)
{
    (void)self;
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred()) return NULL;
    if (code < 0) code = -code; /* accept the negative values the int API returns */
    return PyUnicode_FromString(kvp_strerror((kvp_status)code));
}

static PyMethodDef module_methods[] = {
    {"last_error", mod_last_error, METH_NOARGS,
     "last_error() -> str\n\nThe detail of the most recent failure that a TransferEngine method "
     "reported by returning a negative int (Mooncake's convention)."},
    {"strerror", mod_strerror, METH_O,
     "strerror(code) -> str\n\nFixed text of a kvpipe status code (negative values accepted)."},
    {NULL, NULL, 0, NULL},
};

/* The module's constants: each status code without its KVP_ prefix. */
#define NAME(name, value, text) {#name + 4, name},
static const struct {
    const char *name;
    kvp_status code;
} status_names[] = {KVP_STATUS_LIST(NAME)};
#undef NAME

static int add_status_constants(PyObject *module)
{
    for (size_t i = 0; i < sizeof status_names / sizeof status_names[0]; i++)
        if (PyModule_AddIntConstant(module, status_names[i].name, (long)status_names[i].code) < 0)
            return -1;
    return 0;
}

static int add_error_type(PyObject *module)
{
    kvpy_error_type = PyErr_NewExceptionWithDoc(
        "kvpipe.Error",
        "A kvpipe operation failed. .status is the kvpipe status code (kvpipe.ETIMEDOUT, ...);\n"
        "str(e) says what failed and why.",
        PyExc_RuntimeError, NULL);
    if (!kvpy_error_type) return -1;
    Py_INCREF(kvpy_error_type);
    if (PyModule_AddObject(module, "Error", kvpy_error_type) < 0) {
        Py_DECREF(kvpy_error_type);
        return -1;
    }
    return 0;
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvpipe",
    .m_doc = "kvpipe: move KV-cache tensors between prefill and decode instances.\n\n"
             "TransferEngine mirrors Mooncake's mooncake.engine.TransferEngine; Pipe mirrors\n"
             "vLLM's MooncakePipe (send_tensor / recv_tensor).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit_kvpipe(void);

PyMODINIT_FUNC PyInit_kvpipe(void)
{
    PyObject *module = PyModule_Create(&module_def);
    if (!module) return NULL;
    if (PyModule_AddStringConstant(module, "__version__", KVP_VERSION_STRING) < 0 ||
        add_status_constants(module) < 0 || add_error_type(module) < 0 || aio_init() < 0 ||
        kvpy_engine_init_type(module) < 0 || kvpy_notify_init_type(module) < 0 ||
        kvpy_tensor_init_type(module) < 0 || kvpy_pipe_init_type(module) < 0 ||
        kvpy_log_init(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
