/* kvpipe.TransferNotify: Mooncake's TransferNotify, a (name, msg) pair of
 * strings that a transfer sends its target once it completed, and that
 * TransferEngine.get_notifies() returns. */
#include "kvpy.h"

#include <string.h>

typedef struct kvpy_notify {
    PyObject_HEAD
    PyObject *name; /* str */
    PyObject *msg;  /* str */
} kvpy_notify;

static PyTypeObject *kvpy_notify_type; /* a heap type (kvpy_notify_init_type) */

static PyObject *notify_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    kvpy_notify *self = (kvpy_notify *)kvpy_alloc_instance(type);
    if (!self) return NULL;
    self->name = PyUnicode_FromString("");
    self->msg = PyUnicode_FromString("");
    if (!self->name || !self->msg) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* TransferNotify() or TransferNotify(name, msg), as Mooncake's two
 * constructors. */
static int notify_init(kvpy_notify *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"name", "msg", NULL};
    PyObject *name = NULL, *msg = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|UU:TransferNotify", kwlist, &name, &msg))
        return -1;
    if ((name == NULL) != (msg == NULL)) {
        PyErr_SetString(PyExc_TypeError,
                        "TransferNotify() takes no arguments or both name and msg");
        return -1;
    }
    if (name) {
        PyObject *old_name = self->name, *old_msg = self->msg;
        Py_INCREF(name);
        self->name = name;
        Py_INCREF(msg);
        self->msg = msg;
        Py_XDECREF(old_name);
        Py_XDECREF(old_msg);
    }
    return 0;
}

static void notify_dealloc(kvpy_notify *self)
{
    Py_XDECREF(self->name);
    Py_XDECREF(self->msg);
    kvpy_free_instance((PyObject *)self);
}

static PyObject *notify_get(kvpy_notify *self, void *which)
{
    PyObject *v = which ? self->msg : self->name;
    Py_INCREF(v);
    return v;
}

static int notify_set(kvpy_notify *self, PyObject *value, void *which)
{
    if (!value || !PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "TransferNotify.%s must be a str", which ? "msg" : "name");
        return -1;
    }
    PyObject **slot = which ? &self->msg : &self->name, *old = *slot;
    Py_INCREF(value);
    *slot = value;
    Py_XDECREF(old);
    return 0;
}

static PyObject *notify_repr(kvpy_notify *self)
{
    return PyUnicode_FromFormat("TransferNotify(name=%R, msg=%R)", self->name, self->msg);
}

static PyObject *notify_richcompare(PyObject *a, PyObject *b, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !PyObject_TypeCheck(b, kvpy_notify_type))
        Py_RETURN_NOTIMPLEMENTED;
    kvpy_notify *x = (kvpy_notify *)a, *y = (kvpy_notify *)b;
    int eq = PyUnicode_Compare(x->name, y->name) == 0 && PyUnicode_Compare(x->msg, y->msg) == 0;
    if (PyErr_Occurred()) return NULL;
    return PyBool_FromLong(op == Py_EQ ? eq : !eq);
}

static PyGetSetDef notify_getset[] = {
    {"name", (getter)notify_get, (setter)notify_set, "The notification's name (str).", NULL},
    {"msg", (getter)notify_get, (setter)notify_set, "The notification's message (str).", (void *)1},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot notify_slots[] = {
    {Py_tp_doc, "TransferNotify(name='', msg='')\n\nA notification: passed as notify= to a "
                "synchronous transfer, it is sent to the target once the transfer completed; "
                "TransferEngine.get_notifies() returns those received."},
    {Py_tp_new, notify_new},
    {Py_tp_init, notify_init},
    {Py_tp_dealloc, notify_dealloc},
    {Py_tp_repr, notify_repr},
    {Py_tp_richcompare, notify_richcompare},
    {Py_tp_getset, notify_getset},
    {Py_tp_hash, PyObject_HashNotImplemented},
    {0, NULL},
};

static PyType_Spec notify_spec = {
    "kvpipe.TransferNotify", sizeof(kvpy_notify), 0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_IMMUTABLETYPE, notify_slots};

PyObject *kvpy_notify_from(const char *name, const char *msg)
{
    kvpy_notify *self = (kvpy_notify *)kvpy_alloc_instance(kvpy_notify_type);
    if (!self) return NULL;
    self->name = PyUnicode_DecodeUTF8(name, (Py_ssize_t)strlen(name), "surrogateescape");
    self->msg = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "surrogateescape");
    if (!self->name || !self->msg) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* A str attribute of obj as UTF-8, NULL with an exception otherwise. */
static const char *str_attr(PyObject *obj, const char *attr, PyObject **keep)
{
    PyObject *v = PyObject_GetAttrString(obj, attr);
    if (!v) {
        if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "notify must be a TransferNotify (or have str attributes name and msg), "
                         "not %.100s",
                         kvpy_type_name(obj));
        }
        return NULL;
    }
    if (!PyUnicode_Check(v)) {
        PyErr_Format(PyExc_TypeError, "notify.%s must be a str, not %.100s", attr,
                     kvpy_type_name(v));
        Py_DECREF(v);
        return NULL;
    }
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(v, &len);
    if (s && strlen(s) != (size_t)len) {
        PyErr_Format(PyExc_ValueError, "notify.%s holds a NUL character", attr);
        s = NULL;
    }
    if (!s) {
        Py_DECREF(v);
        return NULL;
    }
    *keep = v;
    return s;
}

int kvpy_notify_parse(PyObject *obj, kvpy_notify_args *out)
{
    *out = (kvpy_notify_args){0};
    if (!obj || obj == Py_None) return 0;
    /* A TransferNotify, or anything with str attributes name and msg. */
    out->name = str_attr(obj, "name", &out->keep_name);
    if (!out->name) return -1;
    out->msg = str_attr(obj, "msg", &out->keep_msg);
    if (!out->msg) {
        Py_CLEAR(out->keep_name);
        return -1;
    }
    return 0;
}

void kvpy_notify_args_release(kvpy_notify_args *a)
{
    Py_CLEAR(a->keep_name);
    Py_CLEAR(a->keep_msg);
}

int kvpy_notify_init_type(PyObject *module)
{
    return kvpy_add_type(module, &notify_spec, "TransferNotify", &kvpy_notify_type);
}
