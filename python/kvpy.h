/* Internal declarations shared by the files of the kvpipe Python module.
 *
 * The module is one extension, `kvpipe`, made of: kvpipe_module.c (module,
 * exceptions, helpers), engine_py.c (TransferEngine), tensor_py.c (the tensor
 * object: DLPack + buffer protocol), pipe_py.c (Pipe), log_py.c (the log
 * handler and level) and metrics_py.c (metric snapshots as Python values).
 *
 * Everything here runs with the GIL held unless a comment says otherwise.
 *
 * The module is built against CPython's stable ABI (the limited API of 3.11:
 * the buffer protocol is in it from 3.11 on), so one kvpipe.abi3.so loads in
 * every CPython >= 3.11 (docs/python.md). No struct of the interpreter is
 * touched but PyObject's head and Py_buffer; the types are heap types made
 * with PyType_FromSpec. python/tests/abi3.py (ctest python_abi3_symbols)
 * fails on any imported symbol outside the stable ABI.
 */
#ifndef KVPIPE_PYTHON_KVPY_H
#define KVPIPE_PYTHON_KVPY_H

#define Py_LIMITED_API 0x030B0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "dlpack.h"
#include "kvpipe/status.h"

/* kvpipe.Error (a RuntimeError subclass); instances carry .status (int). */
extern PyObject *kvpy_error_type;

/* Raise kvpipe.Error for status; the message is "what: kvp_last_error()" (or
 * kvp_strerror(status) when the library left no detail). Always returns NULL. */
PyObject *kvpy_raise(kvp_status status, const char *what);

/* Raise kvpipe.Error with status and a message of the binding's own. */
PyObject *kvpy_raise_text(kvp_status status, const char *msg);

/* Remember the library's detail message for kvpipe.last_error() after a call
 * that reports failure by returning an int, as Mooncake's API does. Returns
 * -(int)status, the negative value those methods return. */
int kvpy_fail(kvp_status status, const char *what);

/* Same, with a message written by the binding itself. */
int kvpy_fail_msg(kvp_status status, const char *fmt, ...);

/* metrics_py.c: the samples of m whose names start with prefix, into dict
 * into under their names less the prefix, nested by label values; a
 * histogram as {"count", "sum", "buckets": [(le, cumulative count)...]}.
 * 0, or -1 with an exception. */
struct kvp_metrics;
int kvpy_metrics_into(const struct kvp_metrics *m, const char *prefix, PyObject *into);
/* m as Prometheus text (str), or NULL with an exception. */
PyObject *kvpy_metrics_text(const struct kvp_metrics *m);

/* An eventfd for one wait (non-blocking, close-on-exec), or -1 with a
 * Python exception. */
int kvpy_eventfd(void);
/* kvp_batch_opts.on_complete that adds 1 to the eventfd in user_data
 * ((void *)(intptr_t)fd): runs on an engine thread, without the GIL. */
struct kvp_batch;
void kvpy_eventfd_done(struct kvp_batch *batch, void *user_data);
/* Wait until fd is readable, at most timeout_ms (negative: no limit), with
 * the GIL released and without slices: a signal to this thread (Ctrl-C
 * reaches the main thread) ends poll(2) with EINTR, and the handlers run
 * then; one delivered elsewhere (or _thread.interrupt_main) is seen within a
 * second. Returns 0 (readable), 1 (timeout_ms passed), or -1 with a Python
 * exception (e.g. KeyboardInterrupt). */
int kvpy_wait_fd(int fd, int timeout_ms);
/* CLOCK_MONOTONIC in ms. */
uint64_t kvpy_now_ms(void);

/* The asyncio glue (python/kvpipe_aio.py, compiled into the module): its
 * namespace, set up by the module init; NULL before. */
extern PyObject *kvpy_aio;
/* Call the glue's function name with args (a tuple, stolen; NULL on a
 * failure to build it). New reference, or NULL with an exception. */
PyObject *kvpy_aio_call(const char *name, PyObject *args);

/* The name of obj's type for a message, as tp_name spells it ("int",
 * "numpy.ndarray"): the limited API has no tp_name. Valid until the next call
 * (the GIL orders the calls); "?" where it cannot be had. Call it with no
 * exception set (it leaves none). */
const char *kvpy_type_name(PyObject *obj);

/* Free an instance of one of the module's heap types and drop the reference
 * the instance held to its type; the end of every tp_dealloc here. */
void kvpy_free_instance(PyObject *self);

/* A new instance of type (a heap type of this module or a subclass), zeroed,
 * through the type's tp_alloc. */
PyObject *kvpy_alloc_instance(PyTypeObject *type);

/* The heap type of spec, added to module as name; with keep, also a
 * reference of the caller's in *keep. 0, or -1 with an exception set. */
int kvpy_add_type(PyObject *module, PyType_Spec *spec, const char *name, PyTypeObject **keep);

/* PyArg "O&" converters: a non-negative int to uint64_t / size_t. */
int kvpy_addr_conv(PyObject *obj, void *out);
int kvpy_size_conv(PyObject *obj, void *out);

/* ---- kvpipe.Tensor (tensor_py.c) ---- */

/* Releases what backs a tensor's memory; runs with the GIL held. */
typedef void (*kvpy_release_fn)(void *ctx);

/* A new kvpipe.Tensor viewing [data, data + nbytes) as a C-contiguous array of
 * dtype with ndim dims of shape (copied). The tensor owns ctx: release(ctx)
 * runs once the tensor and every export of it (buffer views, DLPack capsules
 * and the arrays made from them) are gone; it also runs if this call fails.
 * take_tag non-NULL lets kvpy_tensor_take_begin() with the same tag take ctx
 * away (Pipe.alloc_tensor: the kvp_pipe); NULL: nobody can.
 * dtype must be one kvpy_dtype_format() knows. Returns NULL with an exception. */
PyObject *kvpy_tensor_new(void *data, DLDataType dtype, int ndim, const int64_t *shape,
                          kvpy_release_fn release, void *ctx, const void *take_tag);
/* Mark a tensor from kvpy_tensor_new() as living on CUDA device `device`: it
 * exports through DLPack (kDLCUDA) and __cuda_array_interface__, never as a
 * buffer. */
void kvpy_tensor_set_cuda(PyObject *tensor, int device);

/* Start taking the memory of obj away from it, for Pipe.send_tensor_take():
 * obj must be a kvpipe.Tensor made with this take_tag, not taken and with no
 * live export (else TypeError / ValueError / BufferError, saying which, and
 * NULL). Returns its ctx; until kvpy_tensor_take_end() the tensor refuses new
 * exports and other takes, so the GIL may be released meanwhile. The caller
 * holds a reference to obj until then. */
void *kvpy_tensor_take_begin(PyObject *obj, const void *take_tag);

/* End a take: taken non-zero when ctx now belongs to the taker — the tensor
 * never releases it, and every export and data_ptr() raises ValueError from
 * now on; 0 leaves the tensor as it was before kvpy_tensor_take_begin(). */
void kvpy_tensor_take_end(PyObject *obj, int taken);

/* The buffer-protocol format of a dtype and its item size, or NULL when the
 * dtype has none. bfloat16 is exported as 'H' and float8 as 'B': the raw bits,
 * since the struct module has no codes for them; DLPack carries the real type. */
const char *kvpy_dtype_format(DLDataType dtype, size_t *itemsize);

/* The dtype's name as torch spells it ("float32", "bfloat16", "float8_e4m3fn"). */
const char *kvpy_dtype_name(DLDataType dtype);

/* The dtype of such a name; -1 (no exception) when there is none. */
int kvpy_dtype_from_name(const char *name, DLDataType *out);

/* Type objects, set up by the module init. */
/* notify_py.c: kvpipe.TransferNotify. */
typedef struct kvpy_notify_args {
    const char *name, *msg; /* UTF-8, valid while keep_* are held; NULL: no notify */
    PyObject *keep_name, *keep_msg;
} kvpy_notify_args;
/* notify= of a transfer: None (out->name NULL), or an object with str
 * attributes name and msg (a TransferNotify). -1 with an exception. */
int kvpy_notify_parse(PyObject *obj, kvpy_notify_args *out);
void kvpy_notify_args_release(kvpy_notify_args *a);
/* A new TransferNotify. */
PyObject *kvpy_notify_from(const char *name, const char *msg);
int kvpy_notify_init_type(PyObject *module);

/* engine_py.c: the awaited batches of an engine (kvpy_aio_op) are cancelled,
 * waited for and their futures resolved when it closes. */
typedef struct kvpy_aio_op kvpy_aio_op;
int kvpy_engine_init_type(PyObject *module);
int kvpy_tensor_init_type(PyObject *module);
int kvpy_pipe_init_type(PyObject *module);
/* kvpipe.set_log_handler(), set_log_level(), get_log_level() (log_py.c). */
int kvpy_log_init(PyObject *module);

#endif
