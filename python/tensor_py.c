/* kvpipe.Tensor: a tensor in CPU memory, exported without a copy through
 * DLPack (__dlpack__ / __dlpack_device__) and the buffer protocol; or in the
 * memory of a CUDA device (Pipe.recv_tensor(device="cuda:N")), exported
 * through DLPack and __cuda_array_interface__ only (the CPU cannot read it).
 *
 * The tensor views memory it does not allocate (for a Pipe: the managed buffer
 * the bytes were READ into, or one from Pipe.alloc_tensor()) and keeps it alive
 * through an owner context. Every export holds a reference to the tensor, so
 * the memory stays valid until the last numpy array / torch tensor / memoryview
 * made from it is gone; only then does the owner's release run.
 *
 * A tensor from Pipe.alloc_tensor() may instead be handed over whole: the pipe
 * takes the memory and frees it when the peer acknowledges, long before Python
 * would. That is only safe while nothing else points into it, so the tensor
 * counts its live exports (buffer views until released, DLPack managed tensors
 * until their deleter runs) and a take is refused while any is alive. A taken
 * tensor keeps its shape and dtype but refuses every export and data_ptr().
 */
#include "kvpy.h"

#include <stdlib.h>
#include <string.h>

typedef struct kvpy_tensor {
    PyObject_HEAD
    void *data;
    DLDataType dtype;
    int ndim;
    size_t itemsize, nbytes;
    int64_t *shape;         /* elements, for DLPack */
    int64_t *strides;       /* elements, for DLPack */
    Py_ssize_t *py_shape;   /* for the buffer protocol */
    Py_ssize_t *py_strides; /* bytes, for the buffer protocol */
    kvpy_release_fn release;
    void *ctx;
    const void *take_tag; /* who may take the memory; NULL: nobody */
    Py_ssize_t exports;   /* live buffer views and DLPack managed tensors */
    enum { TENSOR_OWNED, TENSOR_TAKING, TENSOR_TAKEN } state;
    int cuda_device; /* -1: CPU memory */
} kvpy_tensor;

static PyTypeObject *tensor_type; /* a heap type (kvpy_tensor_init_type) */

/* Stands in for the data pointer of an empty tensor: DLPack consumers may
 * reject NULL even when there is nothing to read. */
static char empty_data[8];

/* ---- dtypes ----------------------------------------------------------------- */

static const struct {
    uint8_t code, bits;
    const char *format;
    const char *name;
} dtypes[] = {
    {kDLBool, 8, "?", "bool"},
    {kDLInt, 8, "b", "int8"},
    {kDLInt, 16, "h", "int16"},
    {kDLInt, 32, "i", "int32"},
    {kDLInt, 64, "q", "int64"},
    {kDLUInt, 8, "B", "uint8"},
    {kDLUInt, 16, "H", "uint16"},
    {kDLUInt, 32, "I", "uint32"},
    {kDLUInt, 64, "Q", "uint64"},
    {kDLFloat, 16, "e", "float16"},
    {kDLFloat, 32, "f", "float32"},
    {kDLFloat, 64, "d", "float64"},
    {kDLBfloat, 16, "H", "bfloat16"},
    {kDLFloat8_e4m3fn, 8, "B", "float8_e4m3fn"},
    {kDLFloat8_e5m2, 8, "B", "float8_e5m2"},
};
#define N_DTYPES (sizeof dtypes / sizeof dtypes[0])

static int dtype_index(DLDataType dt)
{
    if (dt.lanes != 1) return -1;
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtypes[i].code == dt.code && dtypes[i].bits == dt.bits) return (int)i;
    return -1;
}

const char *kvpy_dtype_format(DLDataType dtype, size_t *itemsize)
{
    int i = dtype_index(dtype);
    if (i < 0) return NULL;
    *itemsize = dtype.bits / 8;
    return dtypes[i].format;
}

const char *kvpy_dtype_name(DLDataType dtype)
{
    int i = dtype_index(dtype);
    return i < 0 ? "unknown" : dtypes[i].name;
}

int kvpy_dtype_from_name(const char *name, DLDataType *out)
{
    for (size_t i = 0; i < N_DTYPES; i++) {
        if (strcmp(dtypes[i].name, name) == 0) {
            *out = (DLDataType){dtypes[i].code, dtypes[i].bits, 1};
            return 0;
        }
    }
    return -1;
}

/* ---- lifetime ------------------------------------------------------------------ */

static void tensor_dealloc(kvpy_tensor *self)
{
    if (self->release) self->release(self->ctx);
    free(self->shape);
    free(self->strides);
    free(self->py_shape);
    free(self->py_strides);
    kvpy_free_instance((PyObject *)self);
}

static int tensor_set_shape(kvpy_tensor *t, int ndim, const int64_t *shape)
{
    size_t n = ndim > 0 ? (size_t)ndim : 1;
    t->shape = calloc(n, sizeof *t->shape);
    t->strides = calloc(n, sizeof *t->strides);
    t->py_shape = calloc(n, sizeof *t->py_shape);
    t->py_strides = calloc(n, sizeof *t->py_strides);
    if (!t->shape || !t->strides || !t->py_shape || !t->py_strides) return -1;
    int64_t stride = 1;
    for (int i = ndim - 1; i >= 0; i--) {
        t->shape[i] = shape[i];
        t->strides[i] = stride;
        t->py_shape[i] = (Py_ssize_t)shape[i];
        t->py_strides[i] = (Py_ssize_t)(stride * (int64_t)t->itemsize);
        stride *= shape[i] > 0 ? shape[i] : 1;
    }
    return 0;
}

PyObject *kvpy_tensor_new(void *data, DLDataType dtype, int ndim, const int64_t *shape,
                          kvpy_release_fn release, void *ctx, const void *take_tag)
{
    size_t itemsize = 0;
    if (!kvpy_dtype_format(dtype, &itemsize) || ndim < 0) {
        if (release) release(ctx);
        return PyErr_Format(PyExc_ValueError,
                            "kvpipe.Tensor: unsupported dtype (code %d, "
                            "%d bits) or rank %d",
                            dtype.code, dtype.bits, ndim);
    }
    kvpy_tensor *t = (kvpy_tensor *)kvpy_alloc_instance(tensor_type);
    if (!t) {
        if (release) release(ctx);
        return NULL;
    }
    t->data = data;
    t->dtype = dtype;
    t->ndim = ndim;
    t->itemsize = itemsize;
    t->shape = t->strides = NULL;
    t->py_shape = t->py_strides = NULL;
    t->release = release;
    t->ctx = ctx;
    t->take_tag = take_tag;
    t->exports = 0;
    t->state = TENSOR_OWNED;
    t->cuda_device = -1;
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        n *= (size_t)shape[i];
    t->nbytes = n * itemsize;
    if (tensor_set_shape(t, ndim, shape)) {
        Py_DECREF(t);
        return PyErr_NoMemory();
    }
    return (PyObject *)t;
}

void kvpy_tensor_set_cuda(PyObject *obj, int device)
{
    ((kvpy_tensor *)obj)->cuda_device = device;
}

static PyObject *raise_taken(void)
{
    PyErr_SetString(PyExc_ValueError,
                    "kvpipe.Tensor was sent by Pipe.send_tensor_take(); its memory belongs to the "
                    "pipe now (only shape, dtype, ndim and nbytes can be read)");
    return NULL;
}

/* Whether the memory of self can be exported now: a taken tensor's belongs to
 * the pipe, and one being taken may be gone by the time the export is used.
 * Returns -1 with the exception set, 0 when exports are fine. */
static int check_exportable(kvpy_tensor *self)
{
    if (self->state == TENSOR_TAKEN) {
        raise_taken();
        return -1;
    }
    if (self->state == TENSOR_TAKING) {
        PyErr_SetString(PyExc_BufferError,
                        "kvpipe.Tensor is being sent by Pipe.send_tensor_take() in another thread");
        return -1;
    }
    return 0;
}

void *kvpy_tensor_take_begin(PyObject *obj, const void *take_tag)
{
    if (!PyObject_TypeCheck(obj, tensor_type)) {
        PyErr_Format(PyExc_TypeError,
                     "send_tensor_take: expected a kvpipe.Tensor from Pipe.alloc_tensor(), not "
                     "%.100s (send_tensor() sends any tensor, with a copy)",
                     kvpy_type_name(obj));
        return NULL;
    }
    kvpy_tensor *t = (kvpy_tensor *)obj;
    if (t->state == TENSOR_TAKEN) {
        PyErr_SetString(PyExc_ValueError,
                        "send_tensor_take: this kvpipe.Tensor was sent already; its memory "
                        "belongs to the pipe now");
        return NULL;
    }
    if (t->state == TENSOR_TAKING) {
        PyErr_SetString(PyExc_ValueError,
                        "send_tensor_take: this kvpipe.Tensor is being sent by another thread");
        return NULL;
    }
    if (!t->take_tag) {
        PyErr_SetString(PyExc_ValueError,
                        "send_tensor_take: this kvpipe.Tensor did not come from "
                        "Pipe.alloc_tensor() (a received one?); send it with send_tensor(), "
                        "which copies");
        return NULL;
    }
    if (t->take_tag != take_tag) {
        PyErr_SetString(PyExc_ValueError,
                        "send_tensor_take: this kvpipe.Tensor was allocated by another Pipe (or "
                        "by this one before it was closed or reopened); send it with "
                        "send_tensor(), which copies");
        return NULL;
    }
    if (t->exports > 0) {
        PyErr_Format(PyExc_BufferError,
                     "send_tensor_take: %zd export(s) of this kvpipe.Tensor are alive (numpy "
                     "arrays, memoryviews, DLPack capsules or torch tensors made from it); the "
                     "pipe frees the memory once the peer acknowledges, so delete them first, "
                     "or send with send_tensor(), which copies",
                     t->exports);
        return NULL;
    }
    t->state = TENSOR_TAKING;
    return t->ctx;
}

void kvpy_tensor_take_end(PyObject *obj, int taken)
{
    kvpy_tensor *t = (kvpy_tensor *)obj;
    if (!taken) {
        t->state = TENSOR_OWNED;
        return;
    }
    /* The memory is the taker's now: never released, never shown again. */
    t->state = TENSOR_TAKEN;
    t->release = NULL;
    t->ctx = NULL;
    t->take_tag = NULL;
    t->data = NULL;
}

/* ---- DLPack ---------------------------------------------------------------------- */

static void fill_dltensor(kvpy_tensor *self, DLTensor *dl)
{
    dl->data = self->nbytes ? self->data : (void *)empty_data;
    dl->device =
        self->cuda_device < 0 ? (DLDevice){kDLCPU, 0} : (DLDevice){kDLCUDA, self->cuda_device};
    dl->ndim = self->ndim;
    dl->dtype = self->dtype;
    dl->shape = self->shape;
    dl->strides = self->strides;
    dl->byte_offset = 0;
}

/* Every managed tensor counts as an export of its tensor until its deleter
 * runs: by the consumer once done with the data, or by the capsule's
 * destructor when nobody consumed it. */
static kvpy_tensor *export_begin(kvpy_tensor *self)
{
    Py_INCREF((PyObject *)self);
    self->exports++;
    return self;
}

/* The deleter may run on any thread, with or without the GIL. */
static void export_end(kvpy_tensor *self)
{
    PyGILState_STATE g = PyGILState_Ensure();
    self->exports--;
    Py_DECREF(self);
    PyGILState_Release(g);
}

static void legacy_deleter(DLManagedTensor *mt)
{
    export_end(mt->manager_ctx);
    free(mt);
}

static void versioned_deleter(DLManagedTensorVersioned *mt)
{
    export_end(mt->manager_ctx);
    free(mt);
}

/* A capsule nobody consumed still owns its tensor. */
static void legacy_capsule_free(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, "dltensor")) return;
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
    if (mt && mt->deleter) mt->deleter(mt);
}

static void versioned_capsule_free(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, "dltensor_versioned")) return;
    DLManagedTensorVersioned *mt = PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (mt && mt->deleter) mt->deleter(mt);
}

static PyObject *legacy_capsule(kvpy_tensor *self)
{
    DLManagedTensor *mt = calloc(1, sizeof *mt);
    if (!mt) return PyErr_NoMemory();
    fill_dltensor(self, &mt->dl_tensor);
    mt->manager_ctx = export_begin(self);
    mt->deleter = legacy_deleter;
    PyObject *capsule = PyCapsule_New(mt, "dltensor", legacy_capsule_free);
    if (!capsule) legacy_deleter(mt);
    return capsule;
}

static PyObject *versioned_capsule(kvpy_tensor *self, unsigned minor)
{
    DLManagedTensorVersioned *mt = calloc(1, sizeof *mt);
    if (!mt) return PyErr_NoMemory();
    mt->version = (DLPackVersion){KVPY_DLPACK_MAJOR, minor};
    fill_dltensor(self, &mt->dl_tensor);
    mt->manager_ctx = export_begin(self);
    mt->deleter = versioned_deleter;
    mt->flags = 0; /* writable, not a copy */
    PyObject *capsule = PyCapsule_New(mt, "dltensor_versioned", versioned_capsule_free);
    if (!capsule) versioned_deleter(mt);
    return capsule;
}

static int check_dl_device(kvpy_tensor *self, PyObject *dl_device)
{
    if (!dl_device || dl_device == Py_None) return 0;
    int type = -1, id = -1;
    if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return -1;
    if (self->cuda_device < 0 ? type == kDLCPU && id == 0
                              : type == kDLCUDA && id == self->cuda_device)
        return 0;
    PyErr_Format(PyExc_BufferError,
                 "kvpipe.Tensor lives in %s memory of device %d; it cannot be exported to DLPack "
                 "device (%d, %d) without a copy",
                 self->cuda_device < 0 ? "CPU" : "CUDA",
                 self->cuda_device < 0 ? 0 : self->cuda_device, type, id);
    return -1;
}

static PyObject *tensor_dlpack(kvpy_tensor *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOO:__dlpack__", kwlist, &stream, &max_version,
                                     &dl_device, &copy))
        return NULL;
    if (check_exportable(self) || check_dl_device(self, dl_device)) return NULL;
    if (copy == Py_True) {
        PyErr_SetString(PyExc_BufferError, "kvpipe.Tensor exports without copying (copy=True "
                                           "is not supported)");
        return NULL;
    }
    if (max_version == Py_None) return legacy_capsule(self);
    unsigned major = 0, minor = 0;
    if (!PyArg_ParseTuple(max_version, "II", &major, &minor)) return NULL;
    if (major < KVPY_DLPACK_MAJOR) return legacy_capsule(self);
    return versioned_capsule(
        self, major > KVPY_DLPACK_MAJOR || minor > KVPY_DLPACK_MINOR ? KVPY_DLPACK_MINOR : minor);
}

static PyObject *tensor_dlpack_device(kvpy_tensor *self, PyObject *noargs)
{
    (void)noargs;
    if (self->cuda_device >= 0) return Py_BuildValue("(ii)", (int)kDLCUDA, self->cuda_device);
    return Py_BuildValue("(ii)", (int)kDLCPU, 0);
}

/* ---- buffer protocol ------------------------------------------------------------------ */

static int tensor_getbuffer(kvpy_tensor *self, Py_buffer *view, int flags)
{
    if (check_exportable(self)) {
        view->obj = NULL;
        return -1;
    }
    if (self->cuda_device >= 0) {
        PyErr_Format(PyExc_BufferError,
                     "kvpipe.Tensor lives on cuda:%d, which the CPU cannot read; take it with "
                     "torch.from_dlpack(t) (or __cuda_array_interface__)",
                     self->cuda_device);
        view->obj = NULL;
        return -1;
    }
    size_t itemsize = 0;
    const char *format = kvpy_dtype_format(self->dtype, &itemsize);
    view->buf = self->nbytes ? self->data : (void *)empty_data;
    view->obj = (PyObject *)self;
    Py_INCREF((PyObject *)self);
    self->exports++;
    view->len = (Py_ssize_t)self->nbytes;
    view->readonly = 0;
    view->itemsize = (Py_ssize_t)itemsize;
    view->format = (flags & PyBUF_FORMAT) ? (char *)format : NULL;
    view->ndim = self->ndim;
    view->shape = (flags & PyBUF_ND) == PyBUF_ND ? self->py_shape : NULL;
    view->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? self->py_strides : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    if (self->ndim == 0) view->shape = view->strides = NULL;
    if (!(flags & PyBUF_ND)) view->ndim = 1; /* a flat byte view was asked for */
    return 0;
}

/* PyBuffer_Release() calls this before it drops the view's reference. */
static void tensor_releasebuffer(kvpy_tensor *self, Py_buffer *view)
{
    (void)view;
    self->exports--;
}

/* ---- attributes --------------------------------------------------------------------------- */

static PyObject *tensor_get_shape(kvpy_tensor *self, void *closure)
{
    (void)closure;
    PyObject *t = PyTuple_New(self->ndim);
    for (int i = 0; t && i < self->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(self->shape[i]);
        if (!d || PyTuple_SetItem(t, i, d) < 0) { /* SetItem takes d, even when it fails */
            Py_CLEAR(t);
            break;
        }
    }
    return t;
}

static PyObject *tensor_get_dtype(kvpy_tensor *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(kvpy_dtype_name(self->dtype));
}

static PyObject *tensor_get_nbytes(kvpy_tensor *self, void *closure)
{
    (void)closure;
    return PyLong_FromSize_t(self->nbytes);
}

static PyObject *tensor_get_ndim(kvpy_tensor *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->ndim);
}

static PyObject *tensor_get_device(kvpy_tensor *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0) return PyUnicode_FromString("cpu");
    return PyUnicode_FromFormat("cuda:%d", self->cuda_device);
}

/* numpy's typestr of a dtype (little-endian), NULL where numpy has none. */
static const char *typestr(DLDataType dt)
{
    static const struct {
        uint8_t code, bits;
        const char *s;
    } t[] = {{kDLBool, 8, "|b1"},   {kDLInt, 8, "|i1"},    {kDLInt, 16, "<i2"},
             {kDLInt, 32, "<i4"},   {kDLInt, 64, "<i8"},   {kDLUInt, 8, "|u1"},
             {kDLUInt, 16, "<u2"},  {kDLUInt, 32, "<u4"},  {kDLUInt, 64, "<u8"},
             {kDLFloat, 16, "<f2"}, {kDLFloat, 32, "<f4"}, {kDLFloat, 64, "<f8"}};
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++)
        if (t[i].code == dt.code && t[i].bits == dt.bits) return t[i].s;
    return NULL;
}

/* __cuda_array_interface__ (version 3) of a tensor on a CUDA device; an
 * AttributeError for one in CPU memory, so hasattr() tells them apart. */
static PyObject *tensor_get_cai(kvpy_tensor *self, void *closure)
{
    (void)closure;
    if (self->cuda_device < 0)
        return PyErr_Format(PyExc_AttributeError,
                            "kvpipe.Tensor in CPU memory has no __cuda_array_interface__");
    if (check_exportable(self)) return NULL;
    const char *ts = typestr(self->dtype);
    if (!ts)
        return PyErr_Format(PyExc_AttributeError,
                            "__cuda_array_interface__ has no typestr for %s; use DLPack",
                            kvpy_dtype_name(self->dtype));
    PyObject *shape = tensor_get_shape(self, NULL);
    if (!shape) return NULL;
    /* The bytes were copied and waited for: no stream to synchronise with. */
    return Py_BuildValue("{s:N,s:s,s:(KO),s:O,s:i,s:O}", "shape", shape, "typestr", ts, "data",
                         (unsigned long long)(uintptr_t)(self->nbytes ? self->data : NULL),
                         Py_False, "strides", Py_None, "version", 3, "stream", Py_None);
}

static PyObject *tensor_data_ptr(kvpy_tensor *self, PyObject *noargs)
{
    (void)noargs;
    if (self->state == TENSOR_TAKEN) return raise_taken();
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)self->data);
}

static PyObject *tensor_repr(kvpy_tensor *self)
{
    PyObject *shape = tensor_get_shape(self, NULL);
    if (!shape) return NULL;
    PyObject *r = PyUnicode_FromFormat("kvpipe.Tensor(dtype=%s, shape=%R)",
                                       kvpy_dtype_name(self->dtype), shape);
    Py_DECREF(shape);
    return r;
}

static PyGetSetDef tensor_getset[] = {
    {"shape", (getter)tensor_get_shape, NULL, "tuple of dimensions", NULL},
    {"dtype", (getter)tensor_get_dtype, NULL, "dtype name as torch spells it", NULL},
    {"nbytes", (getter)tensor_get_nbytes, NULL, "size of the data in bytes", NULL},
    {"ndim", (getter)tensor_get_ndim, NULL, "number of dimensions", NULL},
    {"device", (getter)tensor_get_device, NULL, "'cpu' or 'cuda:N'", NULL},
    {"__cuda_array_interface__", (getter)tensor_get_cai, NULL,
     "version 3, for a tensor on a CUDA device", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef tensor_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))tensor_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> PyCapsule"},
    {"__dlpack_device__", (PyCFunction)tensor_dlpack_device, METH_NOARGS,
     "__dlpack_device__() -> (1, 0) for CPU memory, (2, N) on cuda:N"},
    {"data_ptr", (PyCFunction)tensor_data_ptr, METH_NOARGS,
     "data_ptr() -> int: address of the first element"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot tensor_slots[] = {
    {Py_tp_doc, "A tensor from Pipe.recv_tensor() or Pipe.alloc_tensor(), in CPU memory or "
                "(recv_tensor with a device) on a CUDA device. Take it without a copy with "
                "torch.from_dlpack(t); in CPU memory also numpy.from_dlpack(t) or memoryview(t) / "
                "numpy.asarray(t)."},
    {Py_tp_dealloc, tensor_dealloc},
    {Py_tp_repr, tensor_repr},
    {Py_bf_getbuffer, tensor_getbuffer},
    {Py_bf_releasebuffer, tensor_releasebuffer},
    {Py_tp_methods, tensor_methods},
    {Py_tp_getset, tensor_getset},
    {0, NULL},
};

/* Made by the module only: kvpipe.Tensor() raises TypeError. */
static PyType_Spec tensor_spec = {"kvpipe.Tensor", sizeof(kvpy_tensor), 0,
                                  Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
                                      Py_TPFLAGS_DISALLOW_INSTANTIATION,
                                  tensor_slots};

int kvpy_tensor_init_type(PyObject *module)
{
    return kvpy_add_type(module, &tensor_spec, "Tensor", &tensor_type);
}
