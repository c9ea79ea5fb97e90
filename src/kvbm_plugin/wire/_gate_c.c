/* The connection gate's thread: reads the connection monitors of capped sockets without the
 * GIL, and holds new connections off a socket (a drop-all filter on its listening socket) the
 * moment more than its max_unread connections arrived since its owner last read it empty.
 *
 * Why compiled. A connection that libzmq accepted holds about 60 KiB (its pipes, its engine's
 * buffers) until the socket's owner takes a turn, so the hold must follow the accepts, not the
 * interpreter: a Python thread that reads the monitor needs the GIL, and on a machine short of
 * CPU the thread holding the GIL is itself preempted, so the Python watch once read the 129th
 * accept of a churn after 1,081 had been taken in (74 MiB). This thread needs no GIL; it wakes
 * on each event like libzmq's own I/O thread. Kept for the memory bound of docs/operations.md
 * ("Security and faults"); wire/conn_gate.py's PyGate is the same logic in Python, used where
 * this is not built, and the tests run both.
 *
 * Who calls what: wire/conn_gate.py starts the thread once per process (start(), with the
 * addresses of the zmq_* functions of the libzmq pyzmq loaded and the Python watch's pipe),
 * makes one Gate per capped socket (PeerCap's thread) and closes it before the monitor socket
 * closes (close() returns once this thread no longer touches it). The watch thread takes the
 * events (take()) to keep its per-connection books; the owner's thread calls caught_up();
 * set_hold() is called from either. This thread alone reads the monitor sockets. After each
 * batch of events it writes a byte to the owner's wake-up pipe and to the watch's pipe.
 * Public CPython API only; Linux (socket filters). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* libzmq's ABI (zmq.h of 4.x), called through the pointers start() was given. */
typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} zpollitem_t;
typedef int (*zmq_poll_fn)(zpollitem_t *, int, long);
typedef int (*zmq_recv_fn)(void *, void *, size_t, int);
typedef int (*zmq_getsockopt_fn)(void *, int, void *, size_t *);
typedef int (*zmq_errno_fn)(void);
#define Z_DONTWAIT 1
#define Z_POLLIN 1
#define Z_RCVMORE 13
#define Z_EVENTS 15
#define Z_ETERM 156384765 /* ZMQ_HAUSNUMERO + 53 */
#define EV_LISTENING 0x0008
#define EV_ACCEPTED 0x0020
#define EV_CLOSED 0x0080

#define RING 16384      /* events kept for the watch thread per gate (8 bytes each) */
#define MAX_LISTEN 16   /* listening sockets per gate (one per bound TCP endpoint) */
#define PER_TURN 1024   /* events read from one monitor before the others get a turn */

typedef struct {
    uint16_t event;
    int32_t value;
} ev_t;

typedef struct {
    void *monitor;
    int signal_fd;             /* the owner's wake-up (write end; -1: none) */
    long long max_unread;      /* -1: never hold by itself */
    pthread_mutex_t mu;        /* every field below */
    ev_t *ring;
    size_t head, count;
    unsigned long long dropped;  /* events the watch thread did not take in time */
    unsigned long long accept_events, accepts_when_empty, holds, held_at;
    int holding, dead;
    int listening[MAX_LISTEN];
    int nlistening;
} gate_t;

static zmq_poll_fn z_poll;
static zmq_recv_fn z_recv;
static zmq_getsockopt_fn z_getsockopt;
static zmq_errno_fn z_errno;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER; /* g_gates, g_passes, g_running */
static pthread_cond_t g_pass_done = PTHREAD_COND_INITIALIZER;
static gate_t **g_gates;
static size_t g_n, g_cap;
static unsigned long long g_passes;
static int g_running, g_wake_r = -1, g_wake_w = -1, g_notify_w = -1;

static struct sock_filter drop_all_code[1] = {{BPF_RET | BPF_K, 0, 0, 0}};
static struct sock_fprog drop_all = {1, drop_all_code};

static void poke(int fd) {
    if (fd >= 0) {
        ssize_t r = write(fd, "", 1); /* full: a wake-up is pending already */
        (void)r;
    }
}

static int is_tcp_listener(int fd) {
    struct sockaddr_storage addr;
    socklen_t len = sizeof addr;
    int on = 0;
    socklen_t olen = sizeof on;
    if (getsockname(fd, (struct sockaddr *)&addr, &len) != 0 ||
        (addr.ss_family != AF_INET && addr.ss_family != AF_INET6))
        return 0;
    return getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &on, &olen) == 0 && on;
}

/* Attach or detach the drop-all filter on every listening fd (g->mu held); a fd that is no
 * longer a TCP listener (closed meanwhile) is forgotten. */
static void filter_all(gate_t *g, int drop) {
    int kept = 0;
    for (int i = 0; i < g->nlistening; i++) {
        int fd = g->listening[i];
        int ok = is_tcp_listener(fd);
        if (ok && drop)
            ok = setsockopt(fd, SOL_SOCKET, SO_ATTACH_FILTER, &drop_all, sizeof drop_all) == 0;
        else if (ok) /* an int, as Linux reads one before the option (ENOENT: none) */
            (void)setsockopt(fd, SOL_SOCKET, SO_DETACH_FILTER, &(int){0}, sizeof(int));
        if (ok)
            g->listening[kept++] = fd;
    }
    g->nlistening = kept;
}

static int set_hold(gate_t *g, int hold) { /* g->mu held; 1 when it changed */
    if (hold == g->holding)
        return 0;
    g->holding = hold;
    if (hold)
        g->holds++;
    filter_all(g, hold);
    return 1;
}

static void handle(gate_t *g, uint16_t event, int32_t value) { /* g->mu held */
    if (g->count < RING) {
        g->ring[(g->head + g->count) % RING] = (ev_t){event, value};
        g->count++;
    } else {
        g->dropped++;
    }
    if (event == EV_LISTENING) {
        if (g->nlistening < MAX_LISTEN && is_tcp_listener(value)) {
            g->listening[g->nlistening++] = value;
            if (g->holding &&
                setsockopt(value, SOL_SOCKET, SO_ATTACH_FILTER, &drop_all, sizeof drop_all) != 0)
                g->nlistening--;
        }
    } else if (event == EV_CLOSED) {
        for (int i = 0; i < g->nlistening; i++)
            if (g->listening[i] == value) {
                g->listening[i] = g->listening[--g->nlistening];
                break;
            }
    } else if (event == EV_ACCEPTED) {
        g->accept_events++;
        unsigned long long unread = g->accept_events - g->accepts_when_empty;
        if (g->max_unread >= 0 && !g->holding && unread > (unsigned long long)g->max_unread) {
            set_hold(g, 1);
            g->held_at = unread;
        }
    }
}

/* Read what g's monitor holds (up to PER_TURN events); the number read. */
static int read_gate(gate_t *g) {
    int got = 0;
    for (int k = 0; k < PER_TURN; k++) {
        unsigned char head[8], rest[8];
        int r = z_recv(g->monitor, head, sizeof head, Z_DONTWAIT);
        if (r < 0) {
            if (z_errno() == Z_ETERM) {
                pthread_mutex_lock(&g->mu);
                g->dead = 1;
                pthread_mutex_unlock(&g->mu);
            }
            break;
        }
        int more = 1;
        size_t more_len = sizeof more;
        while (z_getsockopt(g->monitor, Z_RCVMORE, &more, &more_len) == 0 && more) {
            more_len = sizeof more;
            if (z_recv(g->monitor, rest, sizeof rest, 0) < 0) /* the endpoint frame */
                break;
        }
        if (r < 6)
            continue;
        uint16_t event;
        int32_t value;
        memcpy(&event, head, 2); /* host order: libzmq memcpy's them (socket_base.cpp) */
        memcpy(&value, head + 2, 4);
        pthread_mutex_lock(&g->mu);
        handle(g, event, value);
        pthread_mutex_unlock(&g->mu);
        got++;
    }
    return got;
}

static void *run(void *arg) {
    (void)arg;
    zpollitem_t *items = NULL;
    gate_t **snap = NULL;
    size_t room = 0;
    for (;;) {
        pthread_mutex_lock(&g_mu);
        if (room < g_n + 1) {
            room = 2 * (g_n + 1);
            free(items);
            free(snap);
            items = malloc(room * sizeof *items);
            snap = malloc(room * sizeof *snap);
        }
        size_t n = 0;
        if (items && snap)
            for (size_t i = 0; i < g_n; i++) {
                pthread_mutex_lock(&g_gates[i]->mu);
                int dead = g_gates[i]->dead;
                pthread_mutex_unlock(&g_gates[i]->mu);
                if (dead)
                    continue;
                snap[n] = g_gates[i];
                items[n++] = (zpollitem_t){g_gates[i]->monitor, 0, Z_POLLIN, 0};
            }
        pthread_mutex_unlock(&g_mu);
        if (!items || !snap) { /* out of memory: try again later rather than spin */
            room = 0;
            usleep(10000);
            continue;
        }
        items[n] = (zpollitem_t){NULL, g_wake_r, Z_POLLIN, 0};
        int rc = z_poll(items, (int)n + 1, -1);
        int err = rc < 0 ? z_errno() : 0;
        if (rc < 0 && err != EINTR) {
            /* A context is being terminated (ETERM), or a monitor was closed without its gate
             * (ENOTSOCK: a bug of the caller's): leave those monitors out from now on. */
            int found = 0;
            for (size_t i = 0; i < n; i++) {
                int events;
                size_t len = sizeof events;
                if (z_getsockopt(snap[i]->monitor, Z_EVENTS, &events, &len) != 0) {
                    pthread_mutex_lock(&snap[i]->mu);
                    snap[i]->dead = 1;
                    pthread_mutex_unlock(&snap[i]->mu);
                    found = 1;
                }
            }
            if (!found)
                usleep(1000); /* never expected: not a busy loop if it keeps failing */
        } else if (rc > 0) {
            if (items[n].revents) {
                char sink[256];
                while (read(g_wake_r, sink, sizeof sink) > 0) {
                }
            }
            int any = 0;
            for (size_t i = 0; i < n; i++)
                if (items[i].revents & Z_POLLIN && read_gate(snap[i]) > 0) {
                    poke(snap[i]->signal_fd);
                    any = 1;
                }
            if (any)
                poke(g_notify_w);
        }
        pthread_mutex_lock(&g_mu);
        g_passes++;
        pthread_cond_broadcast(&g_pass_done);
        pthread_mutex_unlock(&g_mu);
    }
    return NULL;
}

/* fork(): the thread and the gates' locks are taken first, so that no lock is copied held by
 * a thread the child does not have; the child starts anew (no thread, no gates, a new wake-up
 * pipe: the parent's thread reads the old one). */
static void before_fork(void) {
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        pthread_mutex_lock(&g_gates[i]->mu);
}

static void after_fork_in_parent(void) {
    for (size_t i = 0; i < g_n; i++)
        pthread_mutex_unlock(&g_gates[i]->mu);
    pthread_mutex_unlock(&g_mu);
}

static void after_fork_in_child(void) {
    for (size_t i = 0; i < g_n; i++)
        pthread_mutex_unlock(&g_gates[i]->mu);
    g_n = 0;
    g_running = 0;
    pthread_cond_init(&g_pass_done, NULL); /* a parent thread's wait on it is not here */
    if (g_wake_r >= 0) {
        close(g_wake_r);
        close(g_wake_w);
        g_wake_r = g_wake_w = -1;
    }
    pthread_mutex_unlock(&g_mu);
}

PyDoc_STRVAR(start_doc,
"start(zmq_poll, zmq_recv, zmq_getsockopt, zmq_errno, notify_fd, /) -> bool\n\n"
"Start the process's gate thread (once; True if this call started it): the addresses of the\n"
"functions of the libzmq pyzmq loaded, and the write end of the watch thread's pipe.");

static PyObject *gate_start(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long p, r, o, e;
    int notify;
    if (!PyArg_ParseTuple(args, "KKKKi", &p, &r, &o, &e, &notify))
        return NULL;
    pthread_mutex_lock(&g_mu);
    if (g_running) {
        pthread_mutex_unlock(&g_mu);
        Py_RETURN_FALSE;
    }
    z_poll = (zmq_poll_fn)(uintptr_t)p;
    z_recv = (zmq_recv_fn)(uintptr_t)r;
    z_getsockopt = (zmq_getsockopt_fn)(uintptr_t)o;
    z_errno = (zmq_errno_fn)(uintptr_t)e;
    int fds[2];
    if (g_wake_r < 0) {
        if (pipe(fds) != 0) {
            pthread_mutex_unlock(&g_mu);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        g_wake_r = fds[0];
        g_wake_w = fds[1];
        for (int i = 0; i < 2; i++)
            (void)fcntl(fds[i], F_SETFL, O_NONBLOCK), (void)fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
    g_notify_w = notify;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    int err = pthread_create(&thread, &attr, run, NULL);
    pthread_attr_destroy(&attr);
    if (err == 0)
        g_running = 1;
    pthread_mutex_unlock(&g_mu);
    if (err != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ the Gate type */

typedef struct {
    PyObject_HEAD
    gate_t *g;
    PyObject *monitor; /* pyzmq's socket: kept alive (never closed by the GC) while g is read */
    int registered;
} GateObject;

static void unregister(GateObject *self) {
    if (!self->registered)
        return;
    self->registered = 0;
    gate_t *g = self->g;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++)
        if (g_gates[i] == g) {
            g_gates[i] = g_gates[--g_n];
            break;
        }
    if (g_running) { /* wait for the pass in progress: it may hold g */
        unsigned long long began = g_passes;
        poke(g_wake_w);
        while (g_passes == began)
            pthread_cond_wait(&g_pass_done, &g_mu);
    }
    pthread_mutex_unlock(&g_mu);
    Py_END_ALLOW_THREADS
}

static int Gate_init(GateObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"monitor", "handle", "max_unread", "signal_fd", NULL};
    PyObject *socket;
    unsigned long long monitor;
    long long max_unread;
    int signal_fd;
    if (self->g) {
        PyErr_SetString(PyExc_RuntimeError, "Gate: already made");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKLi", kwlist, &socket, &monitor,
                                     &max_unread, &signal_fd))
        return -1;
    gate_t *g = calloc(1, sizeof *g);
    if (!g || !(g->ring = malloc(RING * sizeof(ev_t)))) {
        free(g);
        PyErr_NoMemory();
        return -1;
    }
    g->monitor = (void *)(uintptr_t)monitor;
    g->max_unread = max_unread;
    g->signal_fd = signal_fd;
    pthread_mutex_init(&g->mu, NULL);
    pthread_mutex_lock(&g_mu);
    int ok = g_running;
    if (ok && g_n == g_cap) {
        size_t cap = g_cap ? 2 * g_cap : 8;
        gate_t **grown = realloc(g_gates, cap * sizeof *grown);
        if (grown) {
            g_gates = grown;
            g_cap = cap;
        } else {
            ok = -1;
        }
    }
    if (ok == 1)
        g_gates[g_n++] = g;
    pthread_mutex_unlock(&g_mu);
    if (ok != 1) {
        free(g->ring);
        free(g);
        if (ok < 0)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_RuntimeError, "Gate: the gate thread is not started");
        return -1;
    }
    self->g = g;
    Py_INCREF(socket);
    self->monitor = socket;
    self->registered = 1;
    poke(g_wake_w);
    return 0;
}

static void Gate_dealloc(GateObject *self) {
    if (self->g) {
        unregister(self);
        free(self->g->ring);
        free(self->g);
        self->g = NULL;
    }
    Py_CLEAR(self->monitor); /* only now may the monitor close */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

#define GATE_OR_FAIL(self)                                                  \
    if (!(self)->g) {                                                       \
        PyErr_SetString(PyExc_RuntimeError, "Gate: not initialized");      \
        return NULL;                                                        \
    }

static PyObject *Gate_take(GateObject *self, PyObject *noargs) {
    (void)noargs;
    GATE_OR_FAIL(self);
    gate_t *g = self->g;
    ev_t local[512];
    PyObject *out = PyList_New(0);
    if (!out)
        return NULL;
    unsigned long long held_at;
    for (;;) {
        size_t n = 0;
        pthread_mutex_lock(&g->mu);
        while (n < 512 && g->count) {
            local[n++] = g->ring[g->head];
            g->head = (g->head + 1) % RING;
            g->count--;
        }
        held_at = g->held_at;
        if (!n)
            g->held_at = 0;
        pthread_mutex_unlock(&g->mu);
        if (!n)
            break;
        for (size_t i = 0; i < n; i++) {
            PyObject *pair = Py_BuildValue("(Hi)", local[i].event, local[i].value);
            if (!pair || PyList_Append(out, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(pair);
        }
    }
    return Py_BuildValue("(NK)", out, held_at);
}

static PyObject *Gate_caught_up(GateObject *self, PyObject *noargs) {
    (void)noargs;
    GATE_OR_FAIL(self);
    pthread_mutex_lock(&self->g->mu);
    self->g->accepts_when_empty = self->g->accept_events;
    set_hold(self->g, 0);
    pthread_mutex_unlock(&self->g->mu);
    Py_RETURN_NONE;
}

static PyObject *Gate_set_hold(GateObject *self, PyObject *arg) {
    GATE_OR_FAIL(self);
    int hold = PyObject_IsTrue(arg);
    if (hold < 0)
        return NULL;
    pthread_mutex_lock(&self->g->mu);
    int changed = set_hold(self->g, hold);
    pthread_mutex_unlock(&self->g->mu);
    return PyBool_FromLong(changed);
}

static PyObject *Gate_close(GateObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->g)
        unregister(self);
    Py_RETURN_NONE;
}

static PyObject *Gate_state(GateObject *self, PyObject *noargs) {
    (void)noargs;
    GATE_OR_FAIL(self);
    gate_t *g = self->g;
    pthread_mutex_lock(&g->mu);
    unsigned long long accepts = g->accept_events, holds = g->holds, dropped = g->dropped;
    int holding = g->holding, n = g->nlistening, fds[MAX_LISTEN];
    memcpy(fds, g->listening, sizeof fds);
    pthread_mutex_unlock(&g->mu);
    PyObject *listening = PyTuple_New(n);
    if (!listening)
        return NULL;
    for (int i = 0; i < n; i++)
        PyTuple_SET_ITEM(listening, i, PyLong_FromLong(fds[i]));
    return Py_BuildValue("{sKsOsKsKsN}", "accept_events", accepts, "holding",
                         holding ? Py_True : Py_False, "holds", holds, "dropped", dropped,
                         "listening", listening);
}

static PyMethodDef Gate_methods[] = {
    {"take", (PyCFunction)Gate_take, METH_NOARGS,
     "take() -> (events, held_at): the (event, fd) pairs read since the last take, and the\n"
     "unread count at which this thread held new connections off since (0: it did not)."},
    {"caught_up", (PyCFunction)Gate_caught_up, METH_NOARGS,
     "The owner read its socket empty: count from here and lift the hold."},
    {"set_hold", (PyCFunction)Gate_set_hold, METH_O,
     "set_hold(bool) -> bool: hold new connections off (or let them in); True if it changed."},
    {"close", (PyCFunction)Gate_close, METH_NOARGS,
     "Stop reading the monitor; returns once the thread no longer touches it."},
    {"state", (PyCFunction)Gate_state, METH_NOARGS,
     "state() -> dict: accept_events, holding, holds, dropped, listening."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvbm_plugin.wire._gate_c.Gate",
    .tp_basicsize = sizeof(GateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Gate(monitor, handle, max_unread, signal_fd): one capped socket's gate: the\n"
              "monitor socket (kept alive), its libzmq handle (module doc).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gate_init,
    .tp_dealloc = (destructor)Gate_dealloc,
    .tp_methods = Gate_methods,
};

static PyMethodDef module_methods[] = {
    {"start", gate_start, METH_VARARGS, start_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvbm_plugin.wire._gate_c",
    "The connection gate's GIL-free thread (see the C source's header).", -1, module_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__gate_c(void) {
    if (PyType_Ready(&GateType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&GateType);
    if (PyModule_AddObject(m, "Gate", (PyObject *)&GateType) < 0) {
        Py_DECREF(&GateType);
        Py_DECREF(m);
        return NULL;
    }
    static int at_fork_set;
    if (!at_fork_set) {
        pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
        at_fork_set = 1;
    }
    return m;
}
