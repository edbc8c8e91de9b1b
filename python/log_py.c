/* kvpipe.set_log_handler(), set_log_level(), get_log_level(): kvpipe's log
 * lines into a Python callable (vLLM's logger, say).
 *
 * kvpipe logs from any of its threads, sometimes with its own locks held,
 * while a Python thread may hold the GIL and wait for one of those locks
 * (pipe.stats() does). So the C handler never touches Python: it copies the
 * line into a bounded queue and returns. One delivery thread of this module,
 * which holds no kvpipe lock, takes the GIL and calls the Python handler, in
 * order. Nothing waits for the GIL while holding a kvpipe lock, so nothing
 * can deadlock on it.
 *
 * Finalization: an atexit function (run while the interpreter is still
 * whole) unhooks the handler, delivers what is queued and stops the thread;
 * lines logged after that go to stderr. The delivery thread also checks that
 * the interpreter is not finalizing before it takes the GIL. fork: the child
 * starts with an empty queue and a delivery thread of its own.
 */
#include "kvpy.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpipe/log.h"

/* Whether the interpreter is finalizing. The stable ABI has no such call:
 * 3.13 has Py_IsFinalizing(), earlier versions _Py_IsFinalizing(); the one
 * the running interpreter exports is looked up once (module init, with the
 * GIL). Neither found: never (the atexit hook has stopped the thread by
 * then anyway). */
typedef int (*finalizing_fn)(void);
static finalizing_fn finalizing;

static void find_finalizing(void)
{
    void *f = dlsym(RTLD_DEFAULT, "Py_IsFinalizing");
    if (!f) f = dlsym(RTLD_DEFAULT, "_Py_IsFinalizing");
    finalizing = (finalizing_fn)f;
}

#define KVPY_FINALIZING() (finalizing && finalizing())

/* Lines waiting for the Python handler; more are dropped and counted. */
#define QUEUE_CAP 1024
/* Lines handed to Python per hold of the GIL. */
#define BATCH 64
/* Longest set_log_handler(None) and exit wait for queued lines to go out. */
#define DRAIN_TIMEOUT_S 5

typedef struct entry {
    kvp_log_level level;
    char subsystem[32];
    char message[1040];
} entry;

static struct {
    pthread_mutex_t lock; /* guards the fields below */
    pthread_cond_t cond;  /* the queue, busy or stop changed */
    entry *ring;
    size_t head, count;
    unsigned long long dropped;
    int busy; /* the delivery thread is handing a batch to Python */
    int stop;
    int running;
    pthread_t thread;
} q = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

/* The Python handler; touched only with the GIL held. */
static PyObject *handler_obj;
/* Set by the atexit function: nothing starts the thread again. */
static int exiting;

/* ------------------------------------------------------- C handler --- */

/* Runs on any kvpipe thread, maybe with kvpipe locks held: no Python here. */
static void enqueue(void *user, const kvp_log_record *r)
{
    (void)user;
    pthread_mutex_lock(&q.lock);
    if (q.count == QUEUE_CAP) {
        q.dropped++;
    } else {
        entry *e = &q.ring[(q.head + q.count++) % QUEUE_CAP];
        e->level = r->level;
        snprintf(e->subsystem, sizeof e->subsystem, "%s", r->subsystem);
        snprintf(e->message, sizeof e->message, "%s", r->message);
        pthread_cond_signal(&q.cond);
    }
    pthread_mutex_unlock(&q.lock);
}

/* ------------------------------------------------- delivery thread --- */

static int python_level(kvp_log_level l)
{
    /* logging.ERROR, WARNING, INFO, DEBUG */
    static const int levels[] = {40, 30, 20, 10};
    return (unsigned)l <= KVP_LOG_DEBUG ? levels[l] : 40;
}

/* With the GIL held. A handler that raises is reported as unraisable (see
 * sys.unraisablehook) and stays in place. */
static void call_handler(int level, const char *subsystem, const char *message)
{
    PyObject *h = handler_obj;
    if (!h) return;
    Py_INCREF(h); /* the handler may replace itself */
    PyObject *text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
    PyObject *res = text ? PyObject_CallFunction(h, "isO", level, subsystem, text) : NULL;
    if (!res) PyErr_WriteUnraisable(h);
    Py_XDECREF(res);
    Py_XDECREF(text);
    Py_DECREF(h);
}

static void *deliver_main(void *arg)
{
    (void)arg;
    static entry batch[BATCH];
    for (;;) {
        pthread_mutex_lock(&q.lock);
        while (q.count == 0 && q.dropped == 0 && !q.stop)
            pthread_cond_wait(&q.cond, &q.lock);
        if (q.count == 0 && q.dropped == 0) { /* stop, and nothing left */
            pthread_mutex_unlock(&q.lock);
            return NULL;
        }
        size_t n = 0;
        for (; n < BATCH && q.count > 0; n++, q.count--) {
            batch[n] = q.ring[q.head];
            q.head = (q.head + 1) % QUEUE_CAP;
        }
        unsigned long long dropped = q.dropped;
        q.dropped = 0;
        q.busy = 1;
        pthread_mutex_unlock(&q.lock);

        /* Taking the GIL while the interpreter finalizes would end this
         * thread inside Python; it holds nothing of kvpipe, but better not. */
        int gone = KVPY_FINALIZING();
        if (!gone) {
            PyGILState_STATE g = PyGILState_Ensure();
            for (size_t i = 0; i < n; i++)
                call_handler(python_level(batch[i].level), batch[i].subsystem, batch[i].message);
            if (dropped) {
                char text[160];
                snprintf(text, sizeof text,
                         "%llu log lines were dropped: the Python log handler fell behind",
                         dropped);
                call_handler(python_level(KVP_LOG_WARN), "log", text);
            }
            PyGILState_Release(g);
        }
        pthread_mutex_lock(&q.lock);
        q.busy = 0;
        pthread_cond_broadcast(&q.cond);
        pthread_mutex_unlock(&q.lock);
        if (gone) return NULL;
    }
}

/* With the GIL held. */
static int start_delivery(void)
{
    if (q.running) return 0;
    if (!q.ring && !(q.ring = calloc(QUEUE_CAP, sizeof *q.ring))) {
        PyErr_NoMemory();
        return -1;
    }
    q.stop = 0;
    int err = pthread_create(&q.thread, NULL, deliver_main, NULL);
    if (err) {
        PyErr_Format(PyExc_RuntimeError, "kvpipe: cannot start the log thread: %s", strerror(err));
        return -1;
    }
    q.running = 1;
    return 0;
}

/* Wait (GIL released) until what is queued has been handed to Python, at
 * most DRAIN_TIMEOUT_S; not from the delivery thread itself. */
static void drain(void)
{
    if (!q.running || pthread_equal(pthread_self(), q.thread)) return;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += DRAIN_TIMEOUT_S;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q.lock);
    while ((q.count > 0 || q.busy) && pthread_cond_timedwait(&q.cond, &q.lock, &until) == 0) {
    }
    pthread_mutex_unlock(&q.lock);
    Py_END_ALLOW_THREADS
}

/* Unhook from kvpipe and deliver what is queued; stderr gets what follows. */
static void unhook(void)
{
    kvp_log_set_handler(NULL, NULL);
    drain();
    Py_CLEAR(handler_obj);
}

/* ---------------------------------------------------------- Python --- */

static PyObject *mod_set_log_handler(PyObject *self, PyObject *handler)
{
    (void)self;
    if (handler != Py_None && !PyCallable_Check(handler)) {
        PyErr_Format(PyExc_TypeError,
                     "set_log_handler() takes a callable (level, subsystem, message) or None, "
                     "not %.100s",
                     kvpy_type_name(handler));
        return NULL;
    }
    if (handler == Py_None) {
        unhook();
        Py_RETURN_NONE;
    }
    if (exiting) {
        PyErr_SetString(PyExc_RuntimeError, "set_log_handler(): the interpreter is exiting");
        return NULL;
    }
    if (start_delivery() < 0) return NULL;
    PyObject *old = handler_obj;
    Py_INCREF(handler);
    handler_obj = handler;
    Py_XDECREF(old);
    /* Not from inside a kvpipe handler (none of ours calls Python), so this
     * cannot be refused. */
    kvp_status st = kvp_log_set_handler(enqueue, NULL);
    if (st) return kvpy_raise(st, "set_log_handler");
    Py_RETURN_NONE;
}

static int level_from_object(PyObject *obj, kvp_log_level *out)
{
    if (PyUnicode_Check(obj)) {
        const char *name = PyUnicode_AsUTF8AndSize(obj, NULL);
        if (!name) return -1;
        if (kvp_log_level_parse(name, out) == KVP_OK) return 0;
        PyErr_Format(PyExc_ValueError, "%s", kvp_last_error());
        return -1;
    }
    if (PyLong_Check(obj)) {
        long v = PyLong_AsLong(obj);
        if (v == -1 && PyErr_Occurred()) return -1;
        /* Python's logging levels: at or below DEBUG (10) lets everything by. */
        *out = v <= 10   ? KVP_LOG_DEBUG
               : v <= 20 ? KVP_LOG_INFO
               : v <= 30 ? KVP_LOG_WARN
                         : KVP_LOG_ERROR;
        return 0;
    }
    PyErr_Format(PyExc_TypeError, "a log level is a name or a logging level int, not %.100s",
                 kvpy_type_name(obj));
    return -1;
}

static PyObject *mod_set_log_level(PyObject *self, PyObject *level)
{
    (void)self;
    kvp_log_level l;
    if (level_from_object(level, &l) < 0) return NULL;
    kvp_status st = kvp_log_set_level(l);
    if (st) return kvpy_raise(st, "set_log_level");
    Py_RETURN_NONE;
}

static PyObject *mod_get_log_level(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return PyLong_FromLong(python_level(kvp_log_get_level()));
}

/* atexit: runs at the start of finalization, with the interpreter whole. */
static PyObject *log_at_exit(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    exiting = 1;
    unhook();
    if (q.running && !pthread_equal(pthread_self(), q.thread)) {
        pthread_mutex_lock(&q.lock);
        q.stop = 1;
        pthread_cond_broadcast(&q.cond);
        pthread_mutex_unlock(&q.lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(q.thread, NULL);
        Py_END_ALLOW_THREADS
        q.running = 0;
    }
    Py_RETURN_NONE;
}

/* In a forked child (pthread_atfork): no delivery thread, and the queue of
 * the parent (which may have been mid-update) is not ours to deliver. */
static void child_after_fork(void)
{
    pthread_mutex_init(&q.lock, NULL);
    pthread_cond_init(&q.cond, NULL);
    q.head = q.count = 0;
    q.dropped = 0;
    q.busy = q.stop = q.running = 0;
}

/* os.register_at_fork(after_in_child=...): a handler set in the parent works
 * in the child too. */
static PyObject *log_after_fork_in_child(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (handler_obj && !exiting && start_delivery() < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef hook_defs[] = {
    {"_log_at_exit", log_at_exit, METH_NOARGS, NULL},
    {"_log_after_fork_in_child", log_after_fork_in_child, METH_NOARGS, NULL},
};

/* module.register(name=hook) for atexit.register / os.register_at_fork. */
static int register_hook(const char *module, const char *fn, const char *kw, PyMethodDef *def)
{
    PyObject *hook = PyCFunction_New(def, NULL), *mod = PyImport_ImportModule(module);
    PyObject *reg = mod ? PyObject_GetAttrString(mod, fn) : NULL, *res = NULL;
    if (hook && reg) {
        PyObject *args = PyTuple_New(0), *kwargs = kw ? Py_BuildValue("{sO}", kw, hook) : NULL;
        if (args && (!kw || kwargs))
            res = kw ? PyObject_Call(reg, args, kwargs)
                     : PyObject_CallFunctionObjArgs(reg, hook, NULL);
        Py_XDECREF(args);
        Py_XDECREF(kwargs);
    }
    Py_XDECREF(res);
    Py_XDECREF(reg);
    Py_XDECREF(mod);
    Py_XDECREF(hook);
    return res ? 0 : -1;
}

static PyMethodDef log_methods[] = {
    {"set_log_handler", mod_set_log_handler, METH_O,
     "set_log_handler(handler)\n\nSend kvpipe's log lines to handler(level, subsystem, message) "
     "instead of stderr: level is a logging level (logging.ERROR, WARNING, INFO, DEBUG), "
     "subsystem the part of kvpipe that logs ('pipe', 'engine', 'tcp', ...), message the text. "
     "Lines above the threshold (set_log_level) only.\n\n"
     "kvpipe logs from its own threads; a queue (1024 lines; more are dropped and counted) and a "
     "thread of this module hand the lines to handler in order, with the GIL, soon after they "
     "are logged, never from a thread that holds a kvpipe lock. handler runs on that thread; an "
     "exception it raises goes to sys.unraisablehook.\n\n"
     "None: back to stderr, after the lines queued so far went to the old handler (at most 5 s). "
     "At interpreter exit the handler is removed the same way; lines logged later go to stderr."},
    {"set_log_level", mod_set_log_level, METH_O,
     "set_log_level(level)\n\nkvpipe's log threshold: a name in any case ('debug', 'INFO', "
     "'warning', 'error'; 'trace' is debug) or a logging level int (logging.DEBUG ...). "
     "Overrides KVPIPE_LOG and MC_LOG_LEVEL. ValueError for an unknown name."},
    {"get_log_level", mod_get_log_level, METH_NOARGS,
     "get_log_level() -> int\n\nkvpipe's log threshold as a logging level (10, 20, 30, 40)."},
    {NULL, NULL, 0, NULL},
};

int kvpy_log_init(PyObject *module)
{
    find_finalizing();
    if (PyModule_AddFunctions(module, log_methods) < 0) return -1;
    if (register_hook("atexit", "register", NULL, &hook_defs[0]) < 0 ||
        register_hook("os", "register_at_fork", "after_in_child", &hook_defs[1]) < 0)
        return -1;
    if (pthread_atfork(NULL, NULL, child_after_fork) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "kvpipe: pthread_atfork failed");
        return -1;
    }
    return 0;
}
