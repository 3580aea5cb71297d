/* A cluster member's own ASYNC puts in one C call (cluster/member.py's Node.own).
 *
 * Clock is cluster/replication.py's hybrid logical clock: every write carries a
 * version (hlc, writer), hlc = microseconds since the epoch << 8 plus a counter,
 * never going back.  Its methods run under the GIL and never release it, so they
 * need no lock of their own.
 *
 * OwnPuts.put(key, value) is what Router.put_local_async, Node.apply_with and
 * Forwarder.add do in Python for a value HotPath.put_value takes (bytes, a
 * bytearray, a C-contiguous ndarray of a learned layout), with no options: take
 * the key's lock, read the clock, store the value (unless the member holds a newer
 * version), record the version, then queue the key for the forwarder.  Each step
 * touches the same Python objects the Python code does (the versions dict, the
 * tombstones, the single-copy set, the 64 key locks, the forwarder's queue under
 * its condition variable), so both paths can run side by side.  It returns
 *   True   done (stored and queued; or the member held a newer version: nothing to do),
 *   a version (hlc, writer): stored, but the queue is full or its lock busy: the
 *          caller queues it (Forwarder.add, which may wait),
 *   None   an ndarray of a layout not learned yet, False: anything else for the
 *          general path (not active, a key or value put_value would not take, the
 *          key's lock held by another thread, no room).  Nothing is stored then.
 * On a cold path (code idle for milliseconds) each Python step costs microseconds; here the
 * whole step costs about what the local put itself does. */
#include "fast.h"
#include <sys/random.h>
#include <time.h>

typedef struct {
    PyObject_HEAD
    unsigned long long last;     /* the latest hlc handed out or observed */
    unsigned long long writer;   /* this process's random 63-bit writer id */
} Clock;

static unsigned long long now_hlc(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000) << 8;
}

/* The first of n (>= 1) consecutive hlcs after everything handed out or observed. */
static unsigned long long clock_take(Clock *c, unsigned long long n) {
    unsigned long long now = now_hlc(), first = c->last + 1 > now ? c->last + 1 : now;
    c->last = first + n - 1;
    return first;
}

static int Clock_init(Clock *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":Clock", kwlist)) return -1;
    unsigned long long w = 0;
    if (getrandom(&w, sizeof w, 0) != (ssize_t)sizeof w) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->writer = w >> 1;
    self->last = 0;
    return 0;
}

static PyObject *Clock_next(Clock *self, PyObject *unused) {
    unsigned long long hlc = clock_take(self, 1);
    return Py_BuildValue("(KK)", hlc, self->writer);
}

static PyObject *Clock_next_many(Clock *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(clock_take(self, n > 1 ? (unsigned long long)n : 1));
}

static PyObject *Clock_observe(Clock *self, PyObject *arg) {
    unsigned long long hlc = PyLong_AsUnsignedLongLong(arg);
    if (hlc == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (hlc > self->last) self->last = hlc;
    Py_RETURN_NONE;
}

static PyMethodDef Clock_methods[] = {
    {"next", (PyCFunction)Clock_next, METH_NOARGS,
     "next() -> (hlc, writer): a version after every one handed out or observed here."},
    {"next_many", (PyCFunction)Clock_next_many, METH_O,
     "next_many(n) -> hlc: the first of n consecutive hlcs (hlc, hlc + 1, ...; the writer is "
     "self.writer): one clock read for a batch, each write still its own version."},
    {"observe", (PyCFunction)Clock_observe, METH_O,
     "observe(hlc): later versions come after hlc (a version applied from another writer)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Clock_members[] = {
    {"writer", T_ULONGLONG, offsetof(Clock, writer), READONLY, "this process's writer id (random, 63 bits)"},
    {"last", T_ULONGLONG, offsetof(Clock, last), 0,
     "the latest hlc handed out or observed (tests set it back to hand out an older version)"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "yrcache._fast.Clock",
    .tp_doc = "Clock(): a hybrid logical clock: versions (hlc, writer), hlc = microseconds << 8 | a "
              "counter, never going back.  A write issued after another process's write completed (a "
              "round trip later) gets a later version.",
    .tp_basicsize = sizeof(Clock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Clock_init,
    .tp_methods = Clock_methods,
    .tp_members = Clock_members,
};

typedef struct {
    PyObject_HEAD
    HotPath *hot;                /* the member's arena */
    Clock *clock;
    PyObject *versions;          /* dict: key -> (hlc, writer) */
    PyObject *tombs;             /* dict: key -> ((hlc, writer), when) */
    PyObject *single;            /* set: keys of WriteMode.NONE objects */
    PyObject *locks;             /* list of 64 threading.Lock: the key's is locks[hash(key) & 63] */
    PyObject *queue;             /* the forwarder's OrderedDict: key -> (version, targets) */
    PyObject *cv;                /* the forwarder's threading.Condition (guards queue) */
    PyObject *forwarder;         /* for its _asleep flag */
    Py_ssize_t queue_max, batch;
    int prefaulted;
    int active;                  /* this member is in the ring (Router.update keeps it) */
} OwnPuts;

static PyObject *s_acquire, *s_release, *s_notify_all, *s_asleep;

static void OwnPuts_dealloc(OwnPuts *self) {
    Py_XDECREF(self->hot);
    Py_XDECREF(self->clock);
    Py_XDECREF(self->versions);
    Py_XDECREF(self->tombs);
    Py_XDECREF(self->single);
    Py_XDECREF(self->locks);
    Py_XDECREF(self->queue);
    Py_XDECREF(self->cv);
    Py_XDECREF(self->forwarder);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int OwnPuts_init(OwnPuts *self, PyObject *args, PyObject *kwds) {
    PyObject *hot, *clock, *versions, *tombs, *single, *locks, *forwarder, *queue, *cv;
    Py_ssize_t queue_max, batch;
    int prefaulted;
    static char *kwlist[] = {"hot", "clock", "versions", "tombs", "single", "locks", "forwarder", "queue", "cv",
                             "queue_max", "batch", "prefaulted", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!O!OOOnnp:OwnPuts", kwlist, &HotPathType, &hot,
                                     &ClockType, &clock, &PyDict_Type, &versions, &PyDict_Type, &tombs,
                                     &PySet_Type, &single, &PyList_Type, &locks, &forwarder, &queue, &cv,
                                     &queue_max, &batch, &prefaulted))
        return -1;
    if (PyList_GET_SIZE(locks) != 64 || !PyDict_Check(queue) || queue_max < 1 || batch < 1) {
        PyErr_SetString(PyExc_ValueError, "OwnPuts: 64 locks, an OrderedDict queue, queue_max and batch >= 1");
        return -1;
    }
#define SET(field, v) do { PyObject *old_ = (PyObject *)self->field; self->field = (void *)Py_NewRef(v); Py_XDECREF(old_); } while (0)
    SET(hot, hot); SET(clock, clock); SET(versions, versions); SET(tombs, tombs); SET(single, single);
    SET(locks, locks); SET(forwarder, forwarder); SET(queue, queue); SET(cv, cv);
#undef SET
    self->queue_max = queue_max;
    self->batch = batch;
    self->prefaulted = prefaulted;
    self->active = 0;
    return 0;
}

/* lock.acquire(False): 1 taken, 0 busy, -1 error. */
static int try_acquire(PyObject *lock) {
    PyObject *got = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    if (!got) return -1;
    int r = got == Py_True;
    Py_DECREF(got);
    return r;
}

/* lock.release(), keeping an exception already set (the one being reported). */
static int release(PyObject *lock) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_XDECREF(r);
    if (type) {
        PyErr_Clear();
        PyErr_Restore(type, value, tb);
        return -1;
    }
    return r ? 0 : -1;
}

/* The key's version here (a tombstone's when deleted), borrowed; NULL when none (check
 * PyErr_Occurred). */
static PyObject *current(OwnPuts *self, PyObject *key) {
    PyObject *cur = PyDict_GetItemWithError(self->versions, key);
    if (cur || PyErr_Occurred() || !PyDict_GET_SIZE(self->tombs)) return cur;
    PyObject *t = PyDict_GetItemWithError(self->tombs, key);
    if (!t) return NULL;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1) {
        PyErr_SetString(PyExc_TypeError, "a tombstone is a (version, when) tuple");
        return NULL;
    }
    return PyTuple_GET_ITEM(t, 0);
}

/* Node._applied: versions[key] = version; no tombstone and not a single-copy object. */
static int applied(OwnPuts *self, PyObject *key, PyObject *version) {
    if (PyDict_SetItem(self->versions, key, version) < 0) return -1;
    if (PyDict_GET_SIZE(self->tombs)) {
        int has = PyDict_Contains(self->tombs, key);
        if (has < 0 || (has && PyDict_DelItem(self->tombs, key) < 0)) return -1;
    }
    return PySet_GET_SIZE(self->single) && PySet_Discard(self->single, key) < 0 ? -1 : 0;
}

/* Forwarder.add without waiting: 1 queued, 0 not (its lock busy or the queue full: the
 * caller queues it), -1 error. */
static int enqueue(OwnPuts *self, PyObject *key, PyObject *version) {
    int got = try_acquire(self->cv);
    if (got <= 0) return got;
    int r = -1;
    Py_ssize_t n = PyObject_Length(self->queue);
    if (n < 0) goto done;
    if (n >= self->queue_max) {
        r = 0;
        goto done;
    }
    int has = PyDict_Contains(self->queue, key);
    if (has < 0 || (has && PyObject_DelItem(self->queue, key) < 0)) goto done;   /* to the end, as move_to_end */
    PyObject *entry = PyTuple_Pack(2, version, Py_None);
    if (!entry) goto done;
    int set = PyObject_SetItem(self->queue, key, entry);     /* OrderedDict's own, not PyDict_SetItem */
    Py_DECREF(entry);
    if (set < 0) goto done;
    n += !has;
    int wake = n >= self->batch;
    if (!wake) {
        PyObject *asleep = PyObject_GetAttr(self->forwarder, s_asleep);
        if (!asleep) goto done;
        wake = PyObject_IsTrue(asleep);
        Py_DECREF(asleep);
        if (wake < 0) goto done;
    }
    if (wake) {
        PyObject *ok = PyObject_CallMethodNoArgs(self->cv, s_notify_all);
        if (!ok) goto done;
        Py_DECREF(ok);
    }
    r = 1;
done:
    return release(self->cv) < 0 ? -1 : r;
}

static PyObject *OwnPuts_put(OwnPuts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(key, value) takes 2 arguments");
        return NULL;
    }
    PyObject *key = args[0], *value = args[1];
    HotPath *hot = self->hot;
    Py_ssize_t klen;
    const char *kb;
    if (!self->active || !(kb = key_of(hot, key, &klen))) Py_RETURN_FALSE;
    PyObject *meta;
    Py_buffer view;
    int found = value_view(hot, value, &view, &meta);
    if (found <= 0) return Py_NewRef(found == 0 ? Py_None : Py_False);
    PyObject *out = NULL, *version = NULL;
    Py_hash_t h = PyObject_Hash(key);        /* an exact str: Python's hash(key) */
    PyObject *lock = PyList_GET_ITEM(self->locks, (size_t)h & 63);
    int got = h == -1 ? -1 : try_acquire(lock);
    if (got <= 0) {
        if (got == 0) out = Py_NewRef(Py_False);     /* another thread writes this key: the general path waits */
        goto done;
    }
    PyObject *cur = current(self, key);
    if (!cur && PyErr_Occurred()) goto unlock;
    version = Py_BuildValue("(KK)", clock_take(self->clock, 1), self->clock->writer);
    if (!version) goto unlock;
    int older = cur ? PyObject_RichCompareBool(version, cur, Py_LE) : 0;
    if (older) {                  /* this member holds a newer version: nothing to store (or an error) */
        if (older > 0) out = Py_NewRef(Py_True);
        goto unlock;
    }
    int populate = !self->prefaulted && view.len >= POPULATE_MIN;
    Py_INCREF(meta);     /* learn() may replace the entry while the GIL is released */
    yr_retired retired;
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = hot->put(hot->base, hot->slot, kb, (uint32_t)klen, PyBytes_AS_STRING(meta),
                 (uint32_t)PyBytes_GET_SIZE(meta), view.buf, (uint64_t)view.len, 0, 0.0, populate, &retired);
    Py_END_ALLOW_THREADS
    Py_DECREF(meta);
    if (r != YR_OK) {
        out = Py_NewRef(Py_False);
        goto unlock;
    }
    if (applied(self, key, version) < 0) goto unlock;
    if (release(lock) < 0) goto done;
    lock = NULL;
    int queued = enqueue(self, key, version);
    if (queued >= 0) out = Py_NewRef(queued ? Py_True : version);
    goto done;
unlock:
    if (release(lock) < 0) Py_CLEAR(out);
done:
    Py_XDECREF(version);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef OwnPuts_methods[] = {
    {"put", (PyCFunction)(void (*)(void))OwnPuts_put, METH_FASTCALL,
     "put(key, value) -> True | (hlc, writer) | None | False: an ASYNC put of this member's own "
     "(see _csrc/fast_own.c): True done, a version: stored but not queued (queue it), None: an "
     "ndarray layout to learn first, False: the general path (nothing stored)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef OwnPuts_members[] = {
    {"active", T_BOOL, offsetof(OwnPuts, active), 0,
     "this member is in the ring now (False: every put returns False)"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject OwnPutsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "yrcache._fast.OwnPuts",
    .tp_doc = "OwnPuts(hot, clock, versions, tombs, single, locks, forwarder, queue, cv, queue_max, batch, "
              "prefaulted): a cluster member's own ASYNC puts in one C call (see _csrc/fast_own.c).",
    .tp_basicsize = sizeof(OwnPuts),
    .tp_dealloc = (destructor)OwnPuts_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)OwnPuts_init,
    .tp_methods = OwnPuts_methods,
    .tp_members = OwnPuts_members,
};

/* Ready both types and add them to the module; -1 on error. */
int own_ready(PyObject *m) {
    if (!(s_acquire = PyUnicode_InternFromString("acquire")) || !(s_release = PyUnicode_InternFromString("release")) ||
        !(s_notify_all = PyUnicode_InternFromString("notify_all")) ||
        !(s_asleep = PyUnicode_InternFromString("_asleep")))
        return -1;
    if (PyType_Ready(&ClockType) < 0 || PyType_Ready(&OwnPutsType) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Clock", (PyObject *)&ClockType) < 0) return -1;
    return PyModule_AddObjectRef(m, "OwnPuts", (PyObject *)&OwnPutsType);
}
