/* The tier index's row loops, compiled; each has its Python reference in tiers/index.py, the
 * fallback where this is not built (DYN_KVBM_NATIVE=0) or the call does not fit:
 * - write_rows: TierIndex._write_run, the rows of a run of new blocks written into the index's
 *   array columns and their keys mapped in the key table (a run whose tokens the int32 column
 *   cannot hold, or a tier with disk signatures, is written by the reference);
 * - take_run: the loop of TierIndex.take_resident, the match's run of resident blocks found,
 *   pinned and touched;
 * - commit_run: the loop of TierIndex.commit_named, a run every rank wrote committed up to its
 *   first block already in the eviction order (the order is a Python object: the reference
 *   goes on from there; the blocks that join it are handed back to be added).
 *
 * Kept for the targets "<= 5 us per offloaded and per onboarded block on the executor thread"
 * (docs/performance.md, "What each compiled loop is for", where each loop's two forms were
 * measured in one process). tests/tiers/test_keytable_rows.py runs both forms on the same
 * history and compares the indexes they leave and what they return.
 *
 * Called by TierIndex on the leader's executor thread; no locks (the GIL is held throughout;
 * nothing here runs Python code but attribute reads of the index's own views in commit_run).
 * Every column is read and written through the buffer protocol for the length of the call
 * only: the owner grows them with extend. Public CPython API only. */

#include "_keytable_c.h"

/* Row flags: tiers/_entry.py's (the test checks both agree). */
#define F_USED 1
#define F_EH_NEG 8
#define F_PEH_NEG 16

/* One array column as a C array for the length of one call. */
typedef struct {
    Py_buffer view;
    int open;
} Column;

static int column_open(PyObject *obj, char code, Py_ssize_t itemsize, Column *c,
                       const char *name, const char *fn) {
    if (PyObject_GetBuffer(obj, &c->view, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    c->open = 1;
    if (c->view.itemsize != itemsize || c->view.format == NULL || c->view.format[0] != code
            || c->view.format[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "KeyTable.%s: column %s must be an array('%c')", fn,
                     name, code);
        return -1;
    }
    return 0;
}

/* A Python int as int64 or uint64 bits: the event hash columns hold the two's complement of
 * a negative one (its flag set). -1 with an error for anything else. */
static int hash_bits(PyObject *obj, uint64_t *bits, int *negative) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "KeyTable.write_rows: event hash must be an int, not "
                     "%.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (!overflow) {
        *bits = (uint64_t)v;
        *negative = v < 0;
        return 0;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(obj); /* past int64: a u64, or raises */
    if (u == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *bits = (uint64_t)u;
    *negative = 0;
    return 0;
}

#define N_COLS 11
enum { C_EH, C_PEH, C_FLAGS, C_PARENT, C_CHILD, C_NEXT, C_PREV, C_TICK, C_PINS, C_SCOPE,
       C_TOK };
static const char COL_CODE[N_COLS] = {'Q', 'Q', 'B', 'i', 'i', 'i', 'i', 'Q', 'I', 'I', 'i'};
static const Py_ssize_t COL_SIZE[N_COLS] = {8, 8, 1, 4, 4, 4, 4, 8, 4, 4, 4};
static const char *const COL_NAME[N_COLS] = {"eh", "peh", "flags", "parent", "child", "next",
                                            "prev", "tick", "pins", "scope", "tok"};

/* The index's row columns (TierIndex._columns(), in COL_* order) and its key column
 * (col[N_COLS]) as C arrays for one call of ``fn``, each checked for its type, every row
 * column but the tokens for the key column's length: the key column's rows, or -1 with an
 * exception set. columns_close releases what was opened either way. */
static Py_ssize_t columns_open(KeyTable *self, PyObject *cols, Column *col, const char *fn) {
    if (!PyTuple_CheckExact(cols) || PyTuple_GET_SIZE(cols) != N_COLS) {
        PyErr_Format(PyExc_TypeError, "KeyTable.%s: columns must be a tuple of 11 arrays", fn);
        return -1;
    }
    for (int c = 0; c < N_COLS; c++)
        if (column_open(PyTuple_GET_ITEM(cols, c), COL_CODE[c], COL_SIZE[c], &col[c],
                        COL_NAME[c], fn) < 0)
            return -1;
    if (column_open(self->keys, 'Q', 8, &col[N_COLS], "key", fn) < 0)
        return -1;
    Py_ssize_t rows = col[N_COLS].view.len / 8;
    for (int c = 0; c < C_TOK; c++) {
        if (col[c].view.len / COL_SIZE[c] != rows) {
            PyErr_Format(PyExc_ValueError, "KeyTable.%s: column %s has %zd rows, the key "
                         "column %zd", fn, COL_NAME[c], col[c].view.len / COL_SIZE[c], rows);
            return -1;
        }
    }
    return rows;
}

static void columns_close(Column *col) {
    for (int c = 0; c < N_COLS + 1; c++)
        if (col[c].open)
            PyBuffer_Release(&col[c].view);
}

const char write_rows_doc[] =
"write_rows(slots, keys, event_hashes, parent, peh, peh_flags, tokens, width, columns, /)\n"
"--\n\n"
"Write the rows of a run of new blocks into ``slots`` (claimed) and map their keys, as\n"
"TierIndex._write_run does: block k's key ``keys[k]``, event hash ``event_hashes[k]``\n"
"(signed or unsigned), tokens ``tokens[k * width:(k + 1) * width]`` (a list or tuple of\n"
"ints), its parent block k - 1 (the first's ``parent``, -1: a root, with parent event hash\n"
"bits ``peh`` and ``peh_flags``). ``columns``: (eh, peh, flags, parent, child, next, prev,\n"
"tick, pins, scope, tok). Returns how many were written: all, or up to a key already\n"
"mapped; None, with nothing written, when a token is not an int32 (the token column cannot\n"
"hold the run: the caller writes it the other way).";

PyObject *kt_write_rows(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_Format(PyExc_TypeError, "write_rows() takes 9 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *slots = args[0], *cols = args[8];
    if (!PyList_CheckExact(slots)) {
        PyErr_SetString(PyExc_TypeError, "KeyTable.write_rows: slots must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots);
    long parent = PyLong_AsLong(args[3]);
    if (parent == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long peh = PyLong_AsUnsignedLongLong(args[4]);
    if (peh == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    long peh_flags = PyLong_AsLong(args[5]);
    if (peh_flags == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[7]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    if (width <= 0) {
        PyErr_SetString(PyExc_ValueError, "KeyTable.write_rows: width must be positive");
        return NULL;
    }

    struct { int32_t slot; int negative; uint64_t key, eh; } *parsed = NULL;
    int32_t *tokens = NULL;  /* the run's tokens, read into int32 */
    Column col[N_COLS + 1] = {0};  /* the 11 columns, the key column */
    Column *key_col = &col[N_COLS];
    PyObject *result = NULL, *run = NULL;
    /* (lists or tuples, as the caller's sequences are; a new reference each) */
    PyObject *keys = PySequence_Fast(args[1], "KeyTable.write_rows: keys must be a sequence");
    PyObject *hashes = keys == NULL ? NULL
        : PySequence_Fast(args[2], "KeyTable.write_rows: event_hashes must be a sequence");
    if (hashes == NULL)
        goto done;
    run = PySequence_Fast(args[6], "KeyTable.write_rows: tokens must be a sequence");
    if (run == NULL)
        goto done;
    if (PySequence_Fast_GET_SIZE(keys) < n || PySequence_Fast_GET_SIZE(hashes) < n) {
        PyErr_SetString(PyExc_ValueError, "KeyTable.write_rows: fewer keys or event hashes "
                        "than slots");
        goto done;
    }
    Py_ssize_t rows = columns_open(self, cols, col, "write_rows");
    if (rows < 0)
        goto done;
    if (col[C_TOK].view.len / 4 < rows * width || PySequence_Fast_GET_SIZE(run) < n * width) {
        PyErr_SetString(PyExc_ValueError, "KeyTable.write_rows: the token column or the run's "
                        "tokens are short");
        goto done;
    }
    if (parent >= rows || parent < -1) {
        PyErr_Format(PyExc_IndexError, "KeyTable.write_rows: parent slot %ld is not a row",
                     parent);
        goto done;
    }
    uint64_t *key_of = key_col->view.buf, *eh_of = col[C_EH].view.buf,
             *peh_of = col[C_PEH].view.buf, *tick_of = col[C_TICK].view.buf;
    uint8_t *flags_of = col[C_FLAGS].view.buf;
    int32_t *parent_of = col[C_PARENT].view.buf, *child_of = col[C_CHILD].view.buf,
            *next_of = col[C_NEXT].view.buf, *prev_of = col[C_PREV].view.buf,
            *tok = col[C_TOK].view.buf;
    uint32_t *pins_of = col[C_PINS].view.buf, *scope_of = col[C_SCOPE].view.buf;
    Keys k = {.keys = key_of, .n = rows};
    /* Every argument read first: nothing is written unless all of them are good. */
    parsed = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*parsed));
    tokens = PyMem_Malloc((size_t)(n ? n * width : 1) * sizeof(*tokens));
    if (parsed == NULL || tokens == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *const *items = PySequence_Fast_ITEMS(run);
    for (Py_ssize_t j = 0; j < n * width; j++) {
        /* An int32, as array('i') takes it (bool included); anything else: not here. */
        int overflow = 0;
        long v = PyLong_Check(items[j]) ? PyLong_AsLongAndOverflow(items[j], &overflow) : 0;
        if (v == -1 && PyErr_Occurred())
            goto done;
        if (!PyLong_Check(items[j]) || overflow || v < INT32_MIN || v > INT32_MAX) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        tokens[j] = (int32_t)v;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        long slot = PyLong_AsLong(PyList_GET_ITEM(slots, j));
        if (slot == -1 && PyErr_Occurred())
            goto done;
        if (slot < 0 || slot >= rows || slot == parent) {
            PyErr_Format(PyExc_IndexError, "KeyTable.write_rows: slot %ld is not a free row",
                         slot);
            goto done;
        }
        unsigned long long key = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys, j));
        if (key == (unsigned long long)-1 && PyErr_Occurred())
            goto done;
        if (hash_bits(PySequence_Fast_GET_ITEM(hashes, j), &parsed[j].eh, &parsed[j].negative) < 0)
            goto done;
        parsed[j].slot = (int32_t)slot;
        parsed[j].key = key;
    }
    Py_ssize_t i;
#if defined(__GNUC__) || defined(__clang__)
    /* Each key's bucket (checked, then taken) warmed together: see warm_lookups. */
    for (i = 0; i < n; i++)
        __builtin_prefetch(&self->table[home(self, parsed[i].key)], 1, 1);
#endif
    for (i = 0; i < n; i++) {
        int32_t slot = parsed[i].slot;
        uint64_t key = parsed[i].key, eh = parsed[i].eh;
        int negative = parsed[i].negative, err = 0;
        if (table_find(self, &k, key, &err) >= 0 || err) {
            if (err)
                goto done;
            break;  /* (a 64-bit key collision: the caller raises) */
        }
        key_of[slot] = key;
        eh_of[slot] = eh;
        peh_of[slot] = (uint64_t)peh;
        tick_of[slot] = 0;
        pins_of[slot] = 0;
        scope_of[slot] = 0;
        child_of[slot] = -1;
        parent_of[slot] = (int32_t)parent;
        prev_of[slot] = -1;
        next_of[slot] = -1;
        if (parent >= 0) {
            if (i) {  /* the block before, written just now: pending and childless */
                child_of[parent] = slot;
            } else {
                int32_t first = child_of[parent];
                next_of[slot] = first;
                if (first >= 0)
                    prev_of[first] = slot;
                child_of[parent] = slot;
            }
        }
        memcpy(tok + (Py_ssize_t)slot * width, tokens + i * width, (size_t)width * 4);
        flags_of[slot] = (uint8_t)(F_USED | (negative ? F_EH_NEG : 0) | peh_flags);
        if (table_insert(self, key, slot) < 0)
            goto done;
        parent = slot;  /* the next block's parent: this one */
        peh = eh;
        peh_flags = negative ? F_PEH_NEG : 0;
    }
    result = PyLong_FromSsize_t(i);
done:
    Py_XDECREF(keys);
    Py_XDECREF(hashes);
    Py_XDECREF(run);
    PyMem_Free(parsed);
    PyMem_Free(tokens);
    columns_close(col);
    return result;
}

#define F_RESIDENT 2
#define F_QUEUED 4

const char take_run_doc[] =
"take_run(keys, start, stop, columns, clock, /) -> (slots, queued_ticks)\n"
"--\n\n"
"The compiled loop of TierIndex.take_resident (its reference where this is not built): the\n"
"slots of ``keys[start:stop]`` mapped here and resident (``flags``), up to the first that is\n"
"not; each is pinned and given the next tick after ``clock``, in order. ``queued_ticks``: the\n"
"old ticks of those that were in the eviction order (their flag cleared here), for the\n"
"caller to take out of it. ``columns``: TierIndex._columns(), as write_rows takes them. A key\n"
"that is not a u64 is in no table.";

#define TAKE_CHUNK 64  /* keys whose lookups take_run warms together */

PyObject *kt_take_run(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "take_run() takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]), stop = PyLong_AsSsize_t(args[2]);
    if ((start == -1 || stop == -1) && PyErr_Occurred())
        return NULL;
    unsigned long long clock = PyLong_AsUnsignedLongLong(args[4]);
    if (clock == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    PyObject *keys = PySequence_Fast(args[0], "KeyTable.take_run: keys must be a sequence");
    if (keys == NULL)
        return NULL;
    PyObject *slots = NULL, *queued = NULL, *result = NULL;
    Column col[N_COLS + 1] = {0};
    Py_ssize_t rows = columns_open(self, args[3], col, "take_run");
    if (rows < 0)
        goto done;
    Keys k = {.keys = col[N_COLS].view.buf, .n = rows};
    uint8_t *flags_of = col[C_FLAGS].view.buf;
    uint64_t *tick_of = col[C_TICK].view.buf;
    uint32_t *pins_of = col[C_PINS].view.buf;
    slots = PyList_New(0);
    queued = PyList_New(0);
    if (slots == NULL || queued == NULL)
        goto done;
    if (stop > PySequence_Fast_GET_SIZE(keys))
        stop = PySequence_Fast_GET_SIZE(keys);
    /* In chunks of TAKE_CHUNK keys: each chunk's keys read first (up to the first that is not
     * a u64 int: the loop stops there, or raises there, as a key-by-key loop would), its
     * lookups warmed together (warm_lookups), then walked. */
    uint64_t chunk[TAKE_CHUNK];
    for (Py_ssize_t base = start < 0 ? 0 : start; base < stop; base += TAKE_CHUNK) {
        Py_ssize_t n = stop - base < TAKE_CHUNK ? stop - base : TAKE_CHUNK, read = 0;
        int bad = 0;  /* 1: keys[base + read] is not an int; 2: an int past u64 */
        for (; read < n; read++) {
            PyObject *obj = PySequence_Fast_GET_ITEM(keys, base + read);
            if (!PyLong_Check(obj)) {
                bad = 1;
                break;
            }
            unsigned long long key = PyLong_AsUnsignedLongLong(obj);
            if (key == (unsigned long long)-1 && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                    goto done;
                PyErr_Clear();  /* not a u64: in no table */
                bad = 2;
                break;
            }
            chunk[read] = (uint64_t)key;
        }
        warm_lookups(self, &k, flags_of, chunk, read);
        for (Py_ssize_t j = 0; j < read; j++) {
            int err = 0;
            int32_t slot = table_find(self, &k, chunk[j], &err);
            if (err)
                goto done;
            if (slot < 0 || !(flags_of[slot] & F_RESIDENT))
                goto walked;
            if (flags_of[slot] & F_QUEUED) {
                PyObject *old = PyLong_FromUnsignedLongLong(tick_of[slot]);
                if (old == NULL || PyList_Append(queued, old) < 0) {
                    Py_XDECREF(old);
                    goto done;
                }
                Py_DECREF(old);
                flags_of[slot] &= (uint8_t)~F_QUEUED;
            }
            PyObject *s = PyLong_FromLong(slot);
            if (s == NULL || PyList_Append(slots, s) < 0) {
                Py_XDECREF(s);
                goto done;
            }
            Py_DECREF(s);
            tick_of[slot] = ++clock;
            pins_of[slot] += 1;
        }
        if (bad == 1) {
            PyErr_Format(PyExc_TypeError, "KeyTable: key must be an int, not %.100s",
                         Py_TYPE(PySequence_Fast_GET_ITEM(keys, base + read))->tp_name);
            goto done;
        }
        if (bad == 2)
            break;
    }
walked:
    result = PyTuple_Pack(2, slots, queued);
done:
    Py_DECREF(keys);
    Py_XDECREF(slots);
    Py_XDECREF(queued);
    columns_close(col);
    return result;
}

#define F_PEH_NONE 32

/* A row's 64-bit hash bits as the int they stand for: negative where ``negative``. */
static PyObject *hash_int(uint64_t bits, int negative) {
    return negative ? PyLong_FromLongLong((long long)bits)
                    : PyLong_FromUnsignedLongLong((unsigned long long)bits);
}

const char commit_run_doc[] =
"commit_run(entries, index, tokens, width, columns, scopes, clock, /)\n"
"    -> (stores, clock, newly_resident, queue)\n"
"--\n\n"
"The compiled part of TierIndex.commit_named (its reference where this is not built): each\n"
"of ``entries`` in order, while it is ``index``'s live view of a named block whose parent is\n"
"resident and that is not in the eviction order, marked resident and given the next tick\n"
"after ``clock``. ``stores``: the (event hash, parent event hash, token ids, scope) of each\n"
"committed, its token ids ``tokens[k * width:(k + 1) * width]`` (a list); ``queue``: the\n"
"(tick, slot) of each that joins the eviction order (no child, no pin; flagged here), for\n"
"the caller to add in order. ``columns``: TierIndex._columns(), as write_rows takes them;\n"
"``scopes``: the index's scope list. The caller goes on from the first entry not committed\n"
"here.";

PyObject *kt_commit_run(KeyTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "commit_run() takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *entries = args[0], *index = args[1], *tokens = args[2], *cols = args[4],
             *scopes = args[5];
    if (!PyList_CheckExact(entries) || !PyList_CheckExact(tokens) || !PyList_CheckExact(scopes)) {
        PyErr_SetString(PyExc_TypeError, "KeyTable.commit_run: entries, tokens and scopes must "
                        "be lists");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[3]);
    if (width == -1 && PyErr_Occurred())
        return NULL;
    unsigned long long clock = PyLong_AsUnsignedLongLong(args[6]);
    if (clock == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    static PyObject *s_snap = NULL, *s_index = NULL, *s_slot = NULL;
    if (s_snap == NULL && ((s_snap = PyUnicode_InternFromString("_snap")) == NULL
                           || (s_index = PyUnicode_InternFromString("_index")) == NULL
                           || (s_slot = PyUnicode_InternFromString("slot")) == NULL))
        return NULL;
    Column col[N_COLS + 1] = {0};
    long added = 0;
    PyObject *out = NULL, *queue = NULL, *result = NULL;
    Py_ssize_t rows = columns_open(self, cols, col, "commit_run");
    if (rows < 0)
        goto done;
    Keys k = {.keys = col[N_COLS].view.buf, .n = rows};
    uint8_t *flags_of = col[C_FLAGS].view.buf;
    const uint64_t *eh_of = col[C_EH].view.buf, *peh_of = col[C_PEH].view.buf;
    const int32_t *parent_of = col[C_PARENT].view.buf, *child_of = col[C_CHILD].view.buf;
    uint64_t *tick_of = col[C_TICK].view.buf;
    const uint32_t *pins_of = col[C_PINS].view.buf, *scope_of = col[C_SCOPE].view.buf;
    out = PyList_New(0);
    queue = PyList_New(0);
    if (out == NULL || queue == NULL)
        goto done;
    Py_ssize_t n = PyList_GET_SIZE(entries);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *entry = PyList_GET_ITEM(entries, j);
        /* entry._snap is None and entry._index is index: a live view of this tier */
        PyObject *snap = PyObject_GetAttr(entry, s_snap);
        if (snap == NULL)
            goto done;
        Py_DECREF(snap);
        if (snap != Py_None)
            break;
        PyObject *owner = PyObject_GetAttr(entry, s_index);
        if (owner == NULL)
            goto done;
        Py_DECREF(owner);
        if (owner != index)
            break;
        PyObject *slot_obj = PyObject_GetAttr(entry, s_slot);
        if (slot_obj == NULL)
            goto done;
        long slot = PyLong_AsLong(slot_obj);
        Py_DECREF(slot_obj);
        if (slot == -1 && PyErr_Occurred())
            goto done;
        if (slot < 0 || slot >= k.n) {
            PyErr_Format(PyExc_IndexError, "KeyTable.commit_run: slot %ld is not a row", slot);
            goto done;
        }
        uint8_t flags = flags_of[slot];
        int eh_neg = (flags & F_EH_NEG) != 0;
        if (!eh_neg && eh_of[slot] == k.keys[slot])
            break;  /* unnamed (reserved under its content key) */
        int32_t parent = parent_of[slot];
        int peh_none = (flags & F_PEH_NONE) != 0, peh_neg = (flags & F_PEH_NEG) != 0;
        if (parent >= 0) {
            if (parent >= k.n) {
                PyErr_Format(PyExc_IndexError, "KeyTable.commit_run: parent slot %d is not a "
                             "row", (int)parent);
                goto done;
            }
            if (!(flags_of[parent] & F_RESIDENT))
                break;
            if (peh_none || (!peh_neg && peh_of[slot] == k.keys[parent]))
                break;  /* its parent's name is not known in its row */
        }
        /* The eviction order is the caller's (a Python object): an entry in it already is
         * left to the caller; one that joins it (the run's leaf, unpinned) is handed back
         * in ``queue`` with its new tick, for the caller to add in this order. */
        if (flags & F_QUEUED)
            break;
        if ((Py_ssize_t)((j + 1) * width) > PyList_GET_SIZE(tokens))
            break;  /* (fewer tokens than entries: the caller reads the rows) */
        PyObject *scope = PyList_GetItem(scopes, (Py_ssize_t)scope_of[slot]);
        if (scope == NULL)
            goto done;
        Py_INCREF(scope);  /* (held across the allocations below, which may collect) */
        PyObject *eh = hash_int(eh_of[slot], eh_neg);
        PyObject *peh = peh_none ? Py_NewRef(Py_None) : hash_int(peh_of[slot], peh_neg);
        PyObject *toks = PyList_GetSlice(tokens, j * width, (j + 1) * width);
        PyObject *store = (eh && peh && toks) ? PyTuple_Pack(4, eh, peh, toks, scope) : NULL;
        Py_DECREF(scope);
        Py_XDECREF(eh);
        Py_XDECREF(peh);
        Py_XDECREF(toks);
        if (store == NULL || PyList_Append(out, store) < 0) {
            Py_XDECREF(store);
            goto done;
        }
        Py_DECREF(store);
        if (!(flags & F_RESIDENT)) {
            flags |= F_RESIDENT;
            added += 1;
        }
        tick_of[slot] = ++clock;
        if (pins_of[slot] == 0 && child_of[slot] < 0) {
            PyObject *item = Py_BuildValue("(Kl)", clock, slot);
            if (item == NULL || PyList_Append(queue, item) < 0) {
                Py_XDECREF(item);
                flags_of[slot] = flags;
                goto done;
            }
            Py_DECREF(item);
            flags |= F_QUEUED;
        }
        flags_of[slot] = flags;
    }
    result = Py_BuildValue("OKlO", out, clock, added, queue);
done:
    Py_XDECREF(out);
    Py_XDECREF(queue);
    columns_close(col);
    return result;
}
