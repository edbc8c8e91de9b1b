/* Metric snapshots (include/kvpipe/metrics.h) as Python values, for
 * TransferEngine.stats() and Pipe.stats(). */
#include "kvpy.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kvpipe/metrics.h"

/* An int for a whole non-negative value (counters, byte gauges), else a float. */
static PyObject *number(double v)
{
    if (v >= 0 && v < 18446744073709551616.0 && v == floor(v))
        return PyLong_FromUnsignedLongLong((unsigned long long)v);
    return PyFloat_FromDouble(v);
}

static PyObject *histogram(const kvp_metric *x)
{
    PyObject *buckets = PyList_New((Py_ssize_t)x->n_buckets + 1);
    if (!buckets) return NULL;
    for (size_t i = 0; i <= x->n_buckets; i++) {
        double le = i < x->n_buckets ? x->bucket_bounds[i] : INFINITY;
        unsigned long long n = i < x->n_buckets ? x->bucket_counts[i] : x->count;
        PyObject *pair = Py_BuildValue("(dK)", le, n);
        if (!pair || PyList_SetItem(buckets, (Py_ssize_t)i, pair) < 0) { /* it takes pair */
            Py_DECREF(buckets);
            return NULL;
        }
    }
    return Py_BuildValue("{sKsdsN}", "count", (unsigned long long)x->count, "sum", x->sum,
                         "buckets", buckets);
}

/* d[key], a dict created if missing (borrowed), or NULL with an exception. */
static PyObject *subdict(PyObject *d, const char *key)
{
    PyObject *sub = PyDict_GetItemString(d, key);
    if (sub) return sub;
    sub = PyDict_New();
    if (!sub || PyDict_SetItemString(d, key, sub) < 0) {
        Py_XDECREF(sub);
        return NULL;
    }
    Py_DECREF(sub);
    return sub;
}

int kvpy_metrics_into(const kvp_metrics *m, const char *prefix, PyObject *into)
{
    size_t plen = strlen(prefix);
    const kvp_metric *x;
    for (size_t i = 0; (x = kvp_metrics_at(m, i)); i++) {
        if (strncmp(x->name, prefix, plen) != 0) continue;
        PyObject *v = x->type == KVP_METRIC_HISTOGRAM ? histogram(x) : number(x->value);
        if (!v) return -1;
        /* Labels nest in their order: stats()["bytes_total"]["read"]["tcp"]. */
        PyObject *d = into;
        const char *key = x->name + plen;
        for (size_t l = 0; l < x->n_labels && d; l++) {
            d = subdict(d, key);
            key = x->labels[l].value;
        }
        int rc = d ? PyDict_SetItemString(d, key, v) : -1;
        Py_DECREF(v);
        if (rc < 0) return -1;
    }
    return 0;
}

PyObject *kvpy_metrics_text(const kvp_metrics *m)
{
    char *text;
    size_t len;
    kvp_status st = kvp_metrics_format_prometheus(m, &text, &len);
    if (st) return kvpy_raise(st, "metrics");
    PyObject *s = PyUnicode_DecodeUTF8(text, (Py_ssize_t)len, "strict");
    free(text);
    return s;
}
