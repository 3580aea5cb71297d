/* A client's small requests to several members at once, and its wait for their
 * replies (yrcache._fast.round_trip, await_replies, round_stats; the frame format is
 * cluster/wire.py).  Both poll for the replies before they sleep: see round_trip. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <time.h>

#include "fast.h"

/* One small request on several connections at once (a write-through put to a key's
 * owners): `frame` is sent whole on every socket, then each reply's 72-byte header
 * is read, all with the GIL released (in Python the same round took ~20 us more of
 * the client's CPU per 1 KiB put to 2 owners: the Reader, a Frame per reply, the
 * pooled connections' bookkeeping).  Per socket the list holds the reply's status
 * (an int) when the header is a well-formed reply to `op` with no key, meta or
 * payload after it; the header's bytes when it is anything else (the caller parses
 * it and what follows: an error's message, or a protocol error); or (sent, errno)
 * when the socket failed: sent False if the frame did not go out whole, errno 0 if
 * the peer closed it.  A signal whose handler raises stops the round with that
 * error; the sockets are then in an unknown state (the caller closes them).
 *
 * Polling: a reply that finds its reader asleep must wake it, and on a virtual
 * machine that wake-up (an interrupt sent to another CPU) costs the member more
 * than its work on a small put and adds to the round's latency (docs/benchmarks.md).
 * So the replies are first polled for (non-blocking receives) for up to twice the
 * process's recent reply latency to `op` (an average over rounds), at most `poll_ns`; a
 * process whose replies take longer than `poll_ns` does not poll at all, and
 * poll_ns 0 never does. */
#define ROUND_MAX 16                /* sockets of one round_trip (a key's owners) */
#define AWAIT_MAX 1024              /* sockets of one await_replies (members) */
#define REPLY_HDR 72

static int round_signal(void) {            /* called without the GIL: -1 if a handler raised */
    PyGILState_STATE g = PyGILState_Ensure();
    int r = PyErr_CheckSignals();
    PyGILState_Release(g);
    return r;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

/* Per process and request op (wire.py's ops: a put's replies come sooner than an
 * mget's of 100 keys), updated without a lock (a lost update among racing threads is
 * harmless): recent rounds' reply latency (an average), and the rounds whose replies
 * all came while polling / that slept for one (round_stats). */
#define OPS 16
typedef struct {
    uint64_t reply_ns, polled, slept;
} Learned;
static Learned learned[OPS];

typedef struct {                           /* one round's wait for its replies */
    Learned *of;
    uint64_t recent, t0, until;
    int polling, slept;
} Wait;

static void wait_start(Wait *w, long long poll_ns, long op) {   /* right after the requests went out */
    w->of = &learned[op];
    w->recent = w->of->reply_ns;
    w->t0 = poll_ns ? now_ns() : 0;
    w->until = w->t0 + (2 * w->recent < (uint64_t)poll_ns ? 2 * w->recent : (uint64_t)poll_ns);
    w->polling = poll_ns > 0 && w->recent <= (uint64_t)poll_ns;
    w->slept = 0;
}

static void wait_done(Wait *w) {           /* every reply came: learn how long they took */
    if (!w->t0) return;
    uint64_t took = now_ns() - w->t0, recent = w->recent;
    w->of->reply_ns = took > recent ? recent + (took - recent) / 8 : recent - (recent - took) / 8;
    if (w->slept) w->of->slept++;
    else w->of->polled++;
}

static PyObject *round_trip(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    long op;
    long long poll_ns;
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) > ROUND_MAX ||
        (op = PyLong_AsLong(args[2])) < 0 || op >= OPS || (poll_ns = PyLong_AsLongLong(args[3])) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "round_trip(fds: tuple of <= 16 ints, frame, op < 16, poll_ns >= 0)");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    int fd[ROUND_MAX], err[ROUND_MAX], sent[ROUND_MAX];
    unsigned char hdr[ROUND_MAX][REPLY_HDR];
    for (Py_ssize_t i = 0; i < n; i++) {
        fd[i] = PyObject_AsFileDescriptor(PyTuple_GET_ITEM(args[0], i));
        if (fd[i] < 0) return NULL;
        err[i] = -1;
        sent[i] = 0;
    }
    Py_buffer fr;
    if (PyObject_GetBuffer(args[1], &fr, PyBUF_SIMPLE) < 0) return NULL;
    int stopped = 0, failed = 0;
    Wait w;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n && !stopped; i++) {
        Py_ssize_t off = 0;
        while (off < fr.len) {
            ssize_t k = send(fd[i], (const char *)fr.buf + off, (size_t)(fr.len - off), MSG_NOSIGNAL);
            if (k >= 0) {
                off += k;
            } else if (errno != EINTR) {
                err[i] = errno;
                break;
            } else if (round_signal() < 0) {
                stopped = 1;
                break;
            }
        }
        sent[i] = off == fr.len;
    }
    wait_start(&w, poll_ns, op);
    for (Py_ssize_t i = 0; i < n && !stopped; i++) {
        if (!sent[i]) {
            failed = 1;
            continue;
        }
        size_t got = 0;
        while (got < REPLY_HDR) {
            ssize_t k = recv(fd[i], hdr[i] + got, REPLY_HDR - got, w.polling ? MSG_DONTWAIT : 0);
            if (k < 0 && w.polling && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                w.polling = now_ns() < w.until;
                continue;
            }
            w.slept |= !w.polling;
            if (k > 0) {
                got += (size_t)k;
            } else if (k == 0 || errno != EINTR) {
                err[i] = k == 0 ? 0 : errno;
                failed = 1;
                break;
            } else if (round_signal() < 0) {
                stopped = 1;
                break;
            }
        }
    }
    if (!stopped && !failed) wait_done(&w);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&fr);
    if (stopped) return NULL;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *item;
        const unsigned char *h = hdr[i];
        uint32_t klen, mlen;
        uint64_t plen;
        uint16_t status;
        if (err[i] >= 0) {
            item = Py_BuildValue("(Oi)", sent[i] ? Py_True : Py_False, err[i]);
        } else {
            memcpy(&status, h + 6, 2);
            memcpy(&klen, h + 8, 4);
            memcpy(&mlen, h + 12, 4);
            memcpy(&plen, h + 16, 8);
            if (h[0] == 'Y' && h[1] == 'R' && h[2] == 1 && h[3] == op && !klen && !mlen && !plen)
                item = PyLong_FromLong(status);
            else
                item = PyBytes_FromStringAndSize((const char *)h, REPLY_HDR);
        }
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    return out;
}

/* await_replies(fds, poll_ns, timeouts_ms, op): after requests (op) went out on the sockets
 * (by other means), wait until each has something to read, or is closed or failed:
 * polled for as round_trip polls, then slept for in poll(2), each socket within its
 * timeout from the call (-1: no limit).  Nothing is consumed.  None when every socket
 * is ready, else a tuple of the indexes of those still silent at their limit (the
 * caller treats them as timed out; it must not wait for them again).  poll_ns 0:
 * None at once. */
static PyObject *await_replies(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    long long poll_ns;
    long op;
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) > AWAIT_MAX ||
        (poll_ns = PyLong_AsLongLong(args[1])) < 0 || !PyTuple_CheckExact(args[2]) ||
        PyTuple_GET_SIZE(args[2]) != PyTuple_GET_SIZE(args[0]) || (op = PyLong_AsLong(args[3])) < 0 ||
        op >= OPS) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "await_replies(fds: tuple of <= 1024 ints, poll_ns >= 0, "
                            "timeouts_ms: a tuple of an int >= -1 per socket, op < 16)");
        return NULL;
    }
    if (!poll_ns) Py_RETURN_NONE;
    Py_ssize_t n = PyTuple_GET_SIZE(args[0]);
    int fd[AWAIT_MAX], silent[AWAIT_MAX], nsilent = 0, stopped = 0;
    long long timeout_ms[AWAIT_MAX];
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((fd[i] = PyObject_AsFileDescriptor(PyTuple_GET_ITEM(args[0], i))) < 0) return NULL;
        timeout_ms[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[2], i));
        if (timeout_ms[i] < -1 || timeout_ms[i] > INT_MAX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "await_replies: a timeout is -1 (none) or 0 to INT_MAX ms");
            return NULL;
        }
        silent[i] = 0;
    }
    Wait w;
    Py_BEGIN_ALLOW_THREADS
    wait_start(&w, poll_ns, op);
    uint64_t start = now_ns();
    for (Py_ssize_t i = 0; i < n && !stopped; i++) {
        char b;
        int ready = 0;
        while (w.polling && !ready) {
            ssize_t k = recv(fd[i], &b, 1, MSG_PEEK | MSG_DONTWAIT);
            if (k >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
                ready = 1;                 /* data, the end, or an error for the caller's receive */
            else
                w.polling = now_ns() < w.until;
        }
        uint64_t deadline = timeout_ms[i] < 0 ? 0 : start + (uint64_t)timeout_ms[i] * 1000000u;
        while (!ready) {
            int left = -1;
            if (timeout_ms[i] >= 0) {
                uint64_t now = now_ns();
                left = now >= deadline ? 0 : (int)((deadline - now + 999999u) / 1000000u);
            }
            struct pollfd pfd = {fd[i], POLLIN, 0};
            w.slept = 1;
            int r = poll(&pfd, 1, left);
            if (r > 0 || (r < 0 && errno != EINTR)) {
                ready = 1;
            } else if (r == 0) {
                silent[i] = 1;
                nsilent++;
                break;
            } else if (round_signal() < 0) {
                stopped = 1;
                break;
            }
        }
    }
    if (!stopped && !nsilent) wait_done(&w);
    Py_END_ALLOW_THREADS
    if (stopped) return NULL;
    if (!nsilent) Py_RETURN_NONE;
    PyObject *out = PyTuple_New(nsilent);
    for (Py_ssize_t i = 0, j = 0; out && i < n; i++) {
        if (!silent[i]) continue;
        PyObject *x = PyLong_FromSsize_t(i);
        if (!x) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, j++, x);
    }
    return out;
}

static PyObject *round_stats(PyObject *mod, PyObject *arg) {
    long op = PyLong_AsLong(arg);
    if (op < 0 || op >= OPS) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "round_stats(op): an op of cluster/wire.py (< 16)");
        return NULL;
    }
    Learned *l = &learned[op];
    return Py_BuildValue("(KKK)", (unsigned long long)l->reply_ns, (unsigned long long)l->polled,
                         (unsigned long long)l->slept);
}

static PyMethodDef round_functions[] = {
    {"round_trip", (PyCFunction)(void (*)(void))round_trip, METH_FASTCALL,
     "round_trip(fds: tuple, frame, op, poll_ns) -> list: frame sent on every socket, then each "
     "reply's 72-byte header read (polled for first, up to poll_ns), the GIL released; per socket the "
     "reply's status (a plain reply to op), the header's bytes (anything else), or (sent: bool, errno) "
     "if the socket failed (0: closed)."},
    {"await_replies", (PyCFunction)(void (*)(void))await_replies, METH_FASTCALL,
     "await_replies(fds: tuple, poll_ns, timeouts_ms: tuple, op) -> tuple | None: after requests "
     "(op) went out, wait until every socket has something to read (or is closed or failed), polled for first "
     "as round_trip polls, then slept for in poll(2), each within its timeout (-1: none); nothing "
     "consumed; None, or the indexes of the sockets still silent; poll_ns 0: None at once."},
    {"round_stats", (PyCFunction)round_stats, METH_O,
     "round_stats(op) -> (reply_ns, polled, slept): this process's recent reply latency to op "
     "requests (an average, ns) and how many rounds (of those that learn it: poll_ns > 0) got every "
     "reply while polling / slept for one."},
    {NULL, NULL, 0, NULL},
};

int round_ready(PyObject *module) {
    return PyModule_AddFunctions(module, round_functions);
}
