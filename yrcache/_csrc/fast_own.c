/* A cluster member's own ASYNC puts in one C call (cluster/member.py's Node.own).
 *
 * Clock is cluster/replication.py's hybrid logical clock: every write carries a
 * version (hlc, writer), hlc = microseconds since the epoch << 8 plus a counter,
 * never going back.  Its methods run under the GIL and never release it, so they
 * need no lock of their own.  KeyLock is the lock of a group of keys on a member
 * (threading.Lock's API), which OwnPuts takes without calling into Python.
 *
 * OwnPuts.put(key, value, tier, priority, ttl, write_mode) is what ClusterStore.put,
 * Router.put_local_async, Node.apply_with and Forwarder.add do in Python for an ASYNC
 * put with no options of a value HotPath.put_value takes (bytes, a bytearray, a
 * C-contiguous ndarray of a learned layout): take the key's lock, read the clock,
 * store the value (unless the member holds a newer version), record the version,
 * let go of the lock, queue the key for the forwarder.  Each step touches the same
 * Python objects the Python code does (the versions dict, the tombstones, the
 * single-copy set, the 64 key locks, the forwarder's queue), so both paths run side
 * by side.  It returns
 *   True   done (stored and queued; or the member held a newer version: nothing to do),
 *   a version (hlc, writer): stored, but the queue is full or the forwarder asleep:
 *          the caller's Forwarder.add queues it (waiting for room) and wakes it,
 *   None   an ndarray of a layout not learned yet, False: anything else for the
 *          general path (not active, an option, a key or value put_value would not
 *          take, the key's lock held by another thread, no room).  Nothing is stored then.
 * On a cold path (code idle for milliseconds, as between an application's puts) each
 * Python step costs microseconds; here the whole step costs about what a local put does.
 * OwnPuts.serve, a member's single PUT and GET frames from other processes, is fast_serve.c. */
#include "fast.h"
#include <sys/random.h>
#include <time.h>

static unsigned long long now_hlc(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ((unsigned long long)ts.tv_sec * 1000000ULL + (unsigned long long)ts.tv_nsec / 1000) << 8;
}

/* The first of n (>= 1) consecutive hlcs after everything handed out or observed. */
unsigned long long clock_take(Clock *c, unsigned long long n) {
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

static int KeyLock_init(KeyLock *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, ":KeyLock", kwlist)) return -1;
    if (!self->lock && !(self->lock = PyThread_allocate_lock())) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void KeyLock_dealloc(KeyLock *self) {
    if (self->lock) PyThread_free_lock(self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int keylock_ready(KeyLock *self) {
    if (self->lock) return 0;
    PyErr_SetString(PyExc_RuntimeError, "KeyLock was not initialised");
    return -1;
}

/* Taken: 1 (waiting, with the GIL released, unless `blocking` is 0); not taken: 0. */
int keylock_take(KeyLock *self, int blocking) {
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) return 1;
    if (!blocking) return 0;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    Py_END_ALLOW_THREADS
    return 1;
}

static PyObject *KeyLock_acquire(KeyLock *self, PyObject *const *args, Py_ssize_t nargs) {
    int blocking = 1;
    if (nargs > 1 || (nargs == 1 && (blocking = PyObject_IsTrue(args[0])) < 0)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "acquire(blocking=True)");
        return NULL;
    }
    if (keylock_ready(self) < 0) return NULL;
    return PyBool_FromLong(keylock_take(self, blocking));
}

static PyObject *KeyLock_enter(KeyLock *self, PyObject *unused) {
    if (keylock_ready(self) < 0) return NULL;
    keylock_take(self, 1);
    Py_RETURN_TRUE;
}

static PyObject *KeyLock_release(KeyLock *self, PyObject *const *args, Py_ssize_t nargs) {
    if (keylock_ready(self) < 0) return NULL;
    if (PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {      /* it was not held */
        PyThread_release_lock(self->lock);
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *KeyLock_locked(KeyLock *self, PyObject *unused) {
    if (keylock_ready(self) < 0) return NULL;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) Py_RETURN_TRUE;
    PyThread_release_lock(self->lock);
    Py_RETURN_FALSE;
}

static PyMethodDef KeyLock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))KeyLock_acquire, METH_FASTCALL,
     "acquire(blocking=True) -> bool: take the lock (waiting for it unless blocking is False)."},
    {"release", (PyCFunction)(void (*)(void))KeyLock_release, METH_FASTCALL,
     "release(): give the lock back (RuntimeError if it was not held)."},
    {"locked", (PyCFunction)KeyLock_locked, METH_NOARGS, "locked() -> bool: is it held now?"},
    {"__enter__", (PyCFunction)KeyLock_enter, METH_NOARGS, "take the lock, waiting for it"},
    {"__exit__", (PyCFunction)(void (*)(void))KeyLock_release, METH_FASTCALL, "give the lock back"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject KeyLockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "yrcache._fast.KeyLock",
    .tp_doc = "KeyLock(): a lock (acquire, release, locked, with) that OwnPuts takes without calling into "
              "Python; not reentrant, any thread may release it, as threading.Lock.",
    .tp_basicsize = sizeof(KeyLock),
    .tp_dealloc = (destructor)KeyLock_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)KeyLock_init,
    .tp_methods = KeyLock_methods,
};

static PyObject *s_asleep;

static void OwnPuts_dealloc(OwnPuts *self) {
    Py_XDECREF(self->hot);
    Py_XDECREF(self->clock);
    Py_XDECREF(self->versions);
    Py_XDECREF(self->tombs);
    Py_XDECREF(self->single);
    Py_XDECREF(self->locks);
    Py_XDECREF(self->queue);
    Py_XDECREF(self->modes);
    Py_XDECREF(self->forwarder);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int OwnPuts_init(OwnPuts *self, PyObject *args, PyObject *kwds) {
    PyObject *hot, *clock, *versions, *tombs, *single, *locks, *forwarder, *queue, *modes;
    Py_ssize_t queue_max, batch;
    int prefaulted;
    static char *kwlist[] = {"hot", "clock", "versions", "tombs", "single", "locks", "forwarder", "queue",
                             "modes", "queue_max", "batch", "prefaulted", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!O!OOO!nnp:OwnPuts", kwlist, &HotPathType, &hot,
                                     &ClockType, &clock, &PyDict_Type, &versions, &PyDict_Type, &tombs,
                                     &PySet_Type, &single, &PyList_Type, &locks, &forwarder, &queue, &PyTuple_Type,
                                     &modes, &queue_max, &batch, &prefaulted))
        return -1;
    int ok = PyList_GET_SIZE(locks) == 64 && PyDict_Check(queue) && queue_max >= 1 && batch >= 1;
    for (Py_ssize_t i = 0; ok && i < 64; i++)
        ok = Py_IS_TYPE(PyList_GET_ITEM(locks, i), &KeyLockType) && ((KeyLock *)PyList_GET_ITEM(locks, i))->lock;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "OwnPuts: 64 KeyLocks, an OrderedDict queue, queue_max and batch >= 1");
        return -1;
    }
#define SET(field, v) do { PyObject *old_ = (PyObject *)self->field; self->field = (void *)Py_NewRef(v); Py_XDECREF(old_); } while (0)
    SET(hot, hot); SET(clock, clock); SET(versions, versions); SET(tombs, tombs); SET(single, single);
    SET(locks, locks); SET(forwarder, forwarder); SET(queue, queue); SET(modes, modes);
#undef SET
    self->queue_max = queue_max;
    self->batch = batch;
    self->prefaulted = prefaulted;
    self->active = 0;
    return 0;
}

/* The hlc and writer of a version tuple; -1 with an error set. */
int version_parts(PyObject *v, unsigned long long *hlc, unsigned long long *writer) {
    if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 2) {
        PyErr_SetString(PyExc_TypeError, "a version is a (hlc, writer) tuple");
        return -1;
    }
    *hlc = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(v, 0));
    if (*hlc == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *writer = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(v, 1));
    return *writer == (unsigned long long)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Is (hlc, writer) below the key's version here (a tombstone's when deleted)? 1 below,
 * 2 the same, 0 newer (or none here), -1 error. */
int not_newer(OwnPuts *self, PyObject *key, unsigned long long hlc, unsigned long long writer) {
    PyObject *cur = PyDict_GetItemWithError(self->versions, key);      /* borrowed */
    if (!cur) {
        if (PyErr_Occurred()) return -1;
        if (!PyDict_GET_SIZE(self->tombs)) return 0;
        PyObject *t = PyDict_GetItemWithError(self->tombs, key);
        if (!t) return PyErr_Occurred() ? -1 : 0;
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 1) {
            PyErr_SetString(PyExc_TypeError, "a tombstone is a (version, when) tuple");
            return -1;
        }
        cur = PyTuple_GET_ITEM(t, 0);
    }
    unsigned long long ch, cw;
    if (version_parts(cur, &ch, &cw) < 0) return -1;
    if (hlc == ch && writer == cw) return 2;
    return hlc < ch || (hlc == ch && writer < cw);
}

/* Node._applied: versions[key] = version; no tombstone and not a single-copy object. */
int applied(OwnPuts *self, PyObject *key, PyObject *version) {
    if (PyDict_SetItem(self->versions, key, version) < 0) return -1;
    if (PyDict_GET_SIZE(self->tombs)) {
        int has = PyDict_Contains(self->tombs, key);
        if (has < 0 || (has && PyDict_DelItem(self->tombs, key) < 0)) return -1;
    }
    return PySet_GET_SIZE(self->single) && PySet_Discard(self->single, key) < 0 ? -1 : 0;
}

/* Forwarder.add without waiting and without its lock: every step here runs under the
 * GIL and calls no Python code, so it is atomic for the forwarder's Python (which sets
 * _asleep before its last look at the queue, and re-queues with setdefault).  1 queued
 * (or a newer version was queued already); 0 not queued, or queued but the forwarder
 * must be woken: the caller's Forwarder.add does it (it may wait for room). */
int enqueue(OwnPuts *self, PyObject *key, PyObject *version, unsigned long long hlc,
                   unsigned long long writer) {
    Py_ssize_t n = PyObject_Length(self->queue);
    if (n < 0) return -1;
    if (n >= self->queue_max) return 0;
    PyObject *queued = PyDict_GetItemWithError(self->queue, key);      /* borrowed: (version, targets) */
    if (!queued && PyErr_Occurred()) return -1;
    if (queued) {
        unsigned long long qh, qw;
        if (!PyTuple_Check(queued) || PyTuple_GET_SIZE(queued) != 2 ||
            version_parts(PyTuple_GET_ITEM(queued, 0), &qh, &qw) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "a queue entry is (version, targets)");
            return -1;
        }
        if (qh > hlc || (qh == hlc && qw > writer)) return 1;          /* Forwarder.add keeps the newer */
        if (PyObject_DelItem(self->queue, key) < 0) return -1;        /* to the end, as move_to_end */
    }
    PyObject *entry = PyTuple_Pack(2, version, Py_None);
    if (!entry) return -1;
    int set = PyObject_SetItem(self->queue, key, entry);              /* OrderedDict's own, not PyDict_SetItem */
    Py_DECREF(entry);
    if (set < 0) return -1;
    if (n + !queued < self->batch) {
        PyObject *asleep = PyObject_GetAttr(self->forwarder, s_asleep);
        if (!asleep) return -1;
        int wake = PyObject_IsTrue(asleep);
        Py_DECREF(asleep);
        if (wake <= 0) return wake < 0 ? -1 : 1;      /* awake: it looks every few ms by itself */
    }
    return 0;                             /* wake it: Forwarder.add takes the lock to notify */
}

/* ClusterStore.put's options (tier, priority, ttl, write_mode): none, and an ASYNC put? */
static int plain_async(OwnPuts *self, PyObject *const *opts) {
    if (opts[0] != Py_None || opts[2] != Py_None || !PyLong_CheckExact(opts[1])) return 0;
    int overflow;
    if (PyLong_AsLongLongAndOverflow(opts[1], &overflow) != 0 || overflow) return 0;
    PyObject *mode = opts[3];
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(self->modes); i++)
        if (mode == PyTuple_GET_ITEM(self->modes, i)) return 1;
    return PyUnicode_CheckExact(mode) && !PyUnicode_CompareWithASCIIString(mode, "async");
}

static PyObject *OwnPuts_put(OwnPuts *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "put(key, value[, tier, priority, ttl, write_mode]) takes 2 or 6 arguments");
        return NULL;
    }
    PyObject *key = args[0], *value = args[1];
    HotPath *hot = self->hot;
    Py_ssize_t klen;
    const char *kb;
    if (!self->active || (nargs == 6 && !plain_async(self, args + 2)) || !(kb = key_of(hot, key, &klen)))
        Py_RETURN_FALSE;
    PyObject *meta;
    Py_buffer view;
    int found = value_view(hot, value, &view, &meta);
    if (found <= 0) return Py_NewRef(found == 0 ? Py_None : Py_False);
    PyObject *out = NULL, *version = NULL;
    Py_hash_t h = PyObject_Hash(key);        /* an exact str: Python's hash(key) */
    if (h == -1) goto done;
    KeyLock *lock = (KeyLock *)PyList_GET_ITEM(self->locks, (size_t)h & 63);
    if (!keylock_take(lock, 0)) {            /* another thread writes this key: the general path waits */
        out = Py_NewRef(Py_False);
        goto done;
    }
    unsigned long long hlc = clock_take(self->clock, 1), writer = self->clock->writer;
    int older = not_newer(self, key, hlc, writer);
    if (older) {                  /* this member holds a newer version: nothing to store (or an error) */
        if (older > 0) out = Py_NewRef(Py_True);
        goto unlock;
    }
    if (put_view(hot, kb, klen, meta, &view, self->prefaulted) != YR_OK) {
        out = Py_NewRef(Py_False);
        goto unlock;
    }
    PyObject *ph = PyLong_FromUnsignedLongLong(hlc), *pw = ph ? PyLong_FromUnsignedLongLong(writer) : NULL;
    version = pw ? PyTuple_Pack(2, ph, pw) : NULL;
    Py_XDECREF(ph);
    Py_XDECREF(pw);
    if (!version || applied(self, key, version) < 0) goto unlock;
    PyThread_release_lock(lock->lock);
    int queued = enqueue(self, key, version, hlc, writer);
    if (queued >= 0) out = Py_NewRef(queued ? Py_True : version);
    goto done;
unlock:
    PyThread_release_lock(lock->lock);
done:
    Py_XDECREF(version);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef OwnPuts_methods[] = {
    {"put", (PyCFunction)(void (*)(void))OwnPuts_put, METH_FASTCALL,
     "put(key, value[, tier, priority, ttl, write_mode]) -> True | (hlc, writer) | None | False: an "
     "ASYNC put of this member's own (see _csrc/fast_own.c; with the options of ClusterStore.put, each "
     "must be its default and write_mode ASYNC): True done, a version: stored, Forwarder.add it (it "
     "may wait for room, or wake the forwarder), None: an ndarray layout to learn first, False: the "
     "general path (nothing stored)."},
    {"serve", (PyCFunction)(void (*)(void))OwnPuts_serve, METH_FASTCALL,
     "serve(buf, start, end) -> (consumed, reply) | (consumed, reply, key, version) | None: a whole, "
     "plain PUT or GET frame at buf[start:end] answered here (see _csrc/fast_own.c); with key and "
     "version, Forwarder.add them; None: the general path (nothing consumed)."},
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
    .tp_doc = "OwnPuts(hot, clock, versions, tombs, single, locks, forwarder, queue, modes, queue_max, batch, "
              "prefaulted): a cluster member's own ASYNC puts in one C call (see _csrc/fast_own.c).",
    .tp_basicsize = sizeof(OwnPuts),
    .tp_dealloc = (destructor)OwnPuts_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)OwnPuts_init,
    .tp_methods = OwnPuts_methods,
    .tp_members = OwnPuts_members,
};

/* Ready the types and add them to the module; -1 on error. */
int own_ready(PyObject *m) {
    if (!(s_asleep = PyUnicode_InternFromString("_asleep"))) return -1;
    if (PyType_Ready(&ClockType) < 0 || PyType_Ready(&KeyLockType) < 0 || PyType_Ready(&OwnPutsType) < 0) return -1;
    if (PyModule_AddObjectRef(m, "Clock", (PyObject *)&ClockType) < 0 ||
        PyModule_AddObjectRef(m, "KeyLock", (PyObject *)&KeyLockType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "OwnPuts", (PyObject *)&OwnPutsType);
}
