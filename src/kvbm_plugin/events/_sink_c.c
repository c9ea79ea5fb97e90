/* Compiled fast path of event_sink.py (module kvbm_plugin.events._sink_c): the loops that fill
 * a rank's compiled batch (RankBatch, _rank_batch.c, which writes the events it is given as
 * their wire bytes; see there).
 *
 * ingest_dicts() takes the buffered event dicts that need no decision beyond the common case
 * (a store of one block or of a prompt's chain, removals); at the first event it does not
 * take, it stops and returns that event's index: the Python loop handles that event (window
 * changes, created, updated, partial blocks, other ranks, cascades, malformed input) and calls
 * back for the rest. A chain whose last block is partial is taken, and the call stops after it
 * and hands that block's hash back for the caller to suppress before it goes on; removals of
 * suppressed (partial) blocks are taken here too. An event is either taken whole or left
 * untouched. RankBatch.v2_store / v2_remove are the V2 hooks' fast path; any other call goes
 * to the Python hook (``fallback_store`` / ``fallback_remove``).
 *
 * Called with the sink's lock held (ingest) or on the executor thread (V2 hooks). Holds the
 * GIL throughout. The dict walk reads only exact lists, str and int, and exact dicts whose
 * keys are all exact str (a token's dict: up to its token_id), each walked once for every
 * value read of it (str_dict_pick), never looked up: a key of another type could run its own
 * __eq__ during a lookup and free what is held borrowed; such an event goes to the Python
 * loop. A store is checked whole (token ids u32; a block's own adapter, salt or multimodal
 * keys send it to the Python loop) before the batch changes.
 */

#include "_rank_batch.h"

/* How many token dicts ahead take_stored's token walk asks for (each is one pointer chase
 * away: docs/performance.md, stop 56; 3 and 6 gained the same, 12 less). */
#define TOKEN_AHEAD 6

static PyObject *K_data, *K_window_size, *K_attention_dp_rank, *K_blocks, *K_tokens, *K_token_id,
    *K_block_hash, *K_parent_hash, *K_cache_salt_id, *A_key, *A_tokens, *A_prev, *A_ordinal;
static PyObject *S_stored, *S_removed;

/* What is read of an event, its data and its one block: each dict walked once
 * (str_dict_pick), the values found by these indices. */
enum { EV_DATA, EV_WINDOW, EV_RANK, EV_N };
enum { D_TYPE, D_BLOCKS, D_PARENT, D_LORA, D_HASHES, D_N };
enum { B_TOKENS, B_HASH, B_LORA, B_SALT, B_SALT_ID, B_MM, B_N };
static PyObject *EV_KEYS[EV_N], *D_KEYS[D_N], *B_KEYS[B_N];
static Py_hash_t EV_HASHES[EV_N], D_HASHES_[D_N], B_HASHES[B_N];

/* getattr(o, name) that tells an absent attribute (0, *out NULL) from an error (-1). */
static int optional_attr(PyObject *o, PyObject *name, PyObject **out) {
#if PY_VERSION_HEX >= 0x030D0000
    return PyObject_GetOptionalAttr(o, name, out);
#else
    *out = PyObject_GetAttr(o, name);
    if (*out != NULL) return 1;
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
    PyErr_Clear();
    return 0;
#endif
}

/* ---- the buffered dicts --------------------------------------------------------------- */

/* The wire hash (signed int64) of an exact int given as int64 or u64, into *out. */
static int wire_value(PyObject *h, int64_t *out) {
    int overflow = 0;
    long long v;
    unsigned long long u;
    if (!PyLong_CheckExact(h)) return LEAVE;
    v = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return FAIL;
        *out = v;
        return TAKE;
    }
    if (overflow < 0) return LEAVE; /* below int64: Python raises a clear error */
    u = PyLong_AsUnsignedLongLong(h);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return FAIL;
        PyErr_Clear(); /* >= 2**64: Python raises a clear error */
        return LEAVE;
    }
    *out = (int64_t)u;
    return TAKE;
}

/* Record published ``child`` under ``parent`` in ``kids`` (exact dict: parent -> its one
 * child's hash, or the set of them when there are more), as rank.add_child does. */
static int add_child(PyObject *kids, PyObject *parent, PyObject *child) {
    PyObject *cur = PyDict_GetItemWithError(kids, parent), *both;
    int r;
    if (cur == NULL) return PyErr_Occurred() ? -1 : PyDict_SetItem(kids, parent, child);
    if (PySet_CheckExact(cur)) return PySet_Add(cur, child);
    both = PySet_New(NULL);
    if (both == NULL) return -1;
    r = (PySet_Add(both, cur) < 0 || PySet_Add(both, child) < 0)
        ? -1 : PyDict_SetItem(kids, parent, both);
    Py_DECREF(both);
    return r;
}

/* Forget ``child`` (a leaf) under ``parent`` in ``kids``, as Rank.unpublish does: a set left
 * with one child goes back to the one-child form. */
static int drop_child(PyObject *kids, PyObject *parent, PyObject *child) {
    PyObject *cur = PyDict_GetItemWithError(kids, parent), *it, *one;
    int r;
    if (cur == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, parent);
        return -1;
    }
    if (!PySet_CheckExact(cur)) return PyDict_DelItem(kids, parent);
    if (PySet_Discard(cur, child) < 0) return -1;
    if (PySet_GET_SIZE(cur) != 1) return 0;
    it = PyObject_GetIter(cur);
    if (it == NULL) return -1;
    one = PyIter_Next(it);
    Py_DECREF(it);
    if (one == NULL) return -1;
    r = PyDict_SetItem(kids, parent, one);
    Py_DECREF(one);
    return r;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* One "stored" event (``data`` exact dict): a chain of one or more blocks (a prompt's stores
 * come as one event), every one full and plain (no per-block adapter, salt or multimodal
 * keys), taken whole: each block appended as KvEventSink._store appends the chain (onto the
 * open event or ``last`` where it continues it). After at least one full block, the last may
 * be partial (a prompt's tail, with partial reuse): never published, its wire hash goes to
 * ``*tail`` (``*has_tail`` set) for the caller to suppress, as KvEventSink._dict_stored does.
 * ``closed``: keep the rank's prefix-closed state; a chain under an unpublished parent, a
 * published hash or a hash twice in the event is left to the Python loop (which drops it,
 * counted), as is any other partial block. ``n_blocks``: the full blocks taken. */
static int take_stored(PyObject *const *df, RankBatch *rb, long *n_stores, long *n_blocks,
                       int closed, int64_t *tail, int *has_tail) {
    PyObject *blocks = df[D_BLOCKS], *parent = df[D_PARENT], *lora_id = df[D_LORA];
    PyObject *block, *tokens, *raw, *v, *p_obj = NULL, *bf[B_N], **h_objs = NULL;
    Py_ssize_t j, k, n, bs = rb->block_size;
    int64_t pv = 0, *hv = NULL, *sorted = NULL;
    uint32_t *toks = NULL;
    int r, has_parent, has_lora;
    unsigned long long lora = 0;

    if (blocks == NULL || !PyList_CheckExact(blocks) || (n = PyList_GET_SIZE(blocks)) < 1)
        return LEAVE;
    /* An adapter's store (task id 0 included; an event-level u64 task id, as the LoRA names
     * write it) goes out with its lora_name; any other lora_id is the Python loop's. */
    has_lora = lora_id != NULL && lora_id != Py_None;
    if (has_lora) {
        if (!PyLong_CheckExact(lora_id)) return LEAVE;
        lora = PyLong_AsUnsignedLongLong(lora_id);
        if (lora == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear(); /* negative or too large: the Python loop reports it */
            return LEAVE;
        }
    }
    has_parent = parent != NULL && parent != Py_None;
    if (has_parent && (r = wire_value(parent, &pv)) != TAKE) return r;
    *has_tail = 0;
    if (n > 1) { /* a partial last block: its tokens are not read, its hash is */
        PyObject *last = PyList_GET_ITEM(blocks, n - 1), *lf[B_N];
        if (!PyDict_CheckExact(last) || str_dict_pick(last, B_KEYS, B_HASHES, B_N, lf) < 0)
            return LEAVE;
        if (lf[B_TOKENS] == NULL || lf[B_HASH] == NULL || !PyList_CheckExact(lf[B_TOKENS]))
            return LEAVE;
        if (PyList_GET_SIZE(lf[B_TOKENS]) < bs) {
            if ((r = wire_value(lf[B_HASH], tail)) != TAKE) return r;
            *has_tail = 1;
            n -= 1;
        }
    }
    hv = PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (hv == NULL) { PyErr_NoMemory(); r = FAIL; goto done; }
    r = LEAVE;
    for (k = 0; k < n; k++) {
        /* The list is re-read each time: nothing here runs Python code, but a block's dict
         * is a borrowed item of it. */
        if (k >= PyList_GET_SIZE(blocks)) goto done;
        block = PyList_GET_ITEM(blocks, k);
        if (!PyDict_CheckExact(block) || str_dict_pick(block, B_KEYS, B_HASHES, B_N, bf) < 0)
            goto done;
        tokens = bf[B_TOKENS];
        raw = bf[B_HASH];
        if (tokens == NULL || raw == NULL) goto done;
        if (!PyList_CheckExact(tokens) || PyList_GET_SIZE(tokens) != bs) goto done;
        if (toks == NULL) { /* (bs is a list's length by now: the buffer is not absurd) */
            if ((size_t)bs > ((size_t)PY_SSIZE_T_MAX / sizeof(uint32_t)) / (size_t)n) goto done;
            toks = PyMem_Malloc((size_t)n * (size_t)bs * sizeof(uint32_t));
            if (toks == NULL) { PyErr_NoMemory(); r = FAIL; goto done; }
        }
        /* Per-block LoRA, multimodal keys or cache salt, as a string or as its id (newer
         * serializers): the Python loop turns them into lora_id / lora_name / extra_keys. A
         * block's own lora_id, None included, overrides the event's: None under an event's
         * adapter is a different store, also the Python loop's. */
        if ((bf[B_LORA] != NULL && (bf[B_LORA] != Py_None || has_lora))
            || (bf[B_SALT] != NULL && bf[B_SALT] != Py_None)
            || (bf[B_SALT_ID] != NULL && bf[B_SALT_ID] != Py_None))
            goto done;
        v = bf[B_MM];
        if (v != NULL && v != Py_None && !(PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0))
            goto done;
        if ((r = wire_value(raw, &hv[k])) != TAKE) goto done;
        r = LEAVE;
        for (j = 0; j < bs; j++) {
            PyObject *tok = PyList_GET_ITEM(tokens, j), *tid;
            if (j + TOKEN_AHEAD < bs) PREFETCH(PyList_GET_ITEM(tokens, j + TOKEN_AHEAD));
            if (!PyDict_CheckExact(tok) || str_keyed_item(tok, K_token_id, &tid) != 1
                || !u32_value(tid, &toks[k * bs + j]))
                goto done;
        }
    }
    if (closed) {
        int known;
        h_objs = PyMem_Calloc((size_t)n, sizeof(PyObject *));
        sorted = PyMem_Malloc((size_t)n * sizeof(int64_t));
        if (h_objs == NULL || sorted == NULL) { PyErr_NoMemory(); r = FAIL; goto done; }
        if (n > 1) { /* a hash twice in the event: the Python loop drops the second, counted */
            memcpy(sorted, hv, (size_t)n * sizeof(int64_t));
            qsort(sorted, (size_t)n, sizeof(int64_t), cmp_i64);
            for (k = 1; k < n; k++)
                if (sorted[k] == sorted[k - 1]) { r = LEAVE; goto done; }
        }
        p_obj = has_parent ? PyLong_FromLongLong(pv) : Py_NewRef(Py_None);
        if (p_obj == NULL) { r = FAIL; goto done; }
        known = has_parent ? PyDict_Contains(rb->published, p_obj) : 1;
        if (known < 0) { r = FAIL; goto done; }
        if (!known) { r = LEAVE; goto done; }
        for (k = 0; k < n; k++) {
            int again;
            h_objs[k] = PyLong_FromLongLong(hv[k]);
            if (h_objs[k] == NULL) { r = FAIL; goto done; }
            again = PyDict_Contains(rb->published, h_objs[k]);
            if (again < 0) { r = FAIL; goto done; }
            if (again) { r = LEAVE; goto done; }
        }
    }
    if (rb_grow((void **)&rb->scratch, &rb->cap_scratch, bs, sizeof(uint32_t)) < 0) {
        r = FAIL;
        goto done;
    }
    /* Everything read; from here on the event is taken. */
    for (k = 0; k < n; k++) {
        int has_p = k ? 1 : has_parent;
        int64_t p = k ? hv[k - 1] : pv;
        if (closed) {
            PyObject *po = k ? h_objs[k - 1] : p_obj;
            if (PyDict_SetItem(rb->published, h_objs[k], po) < 0
                || (has_p && add_child(rb->kids, po, h_objs[k]) < 0)) {
                r = FAIL;
                goto done;
            }
        }
        memcpy(rb->scratch, toks + k * bs, (size_t)bs * sizeof(uint32_t));
        r = rb_append_store(rb, hv[k], has_p, p, has_lora, (uint64_t)lora);
        if (r < 0) { r = FAIL; goto done; }
        *n_stores += r;
    }
    *n_blocks += n;
    r = TAKE;
done:
    if (h_objs != NULL)
        for (k = 0; k < n; k++) Py_XDECREF(h_objs[k]);
    PyMem_Free(h_objs);
    PyMem_Free(sorted);
    PyMem_Free(hv);
    PyMem_Free(toks);
    Py_XDECREF(p_obj);
    return r;
}

/* Forget wire hash ``v`` when it is suppressed (an unpublished partial or filtered block):
 * 1 it was, 0 not, -1 error. */
static int take_suppressed(RankBatch *rb, int64_t v) {
    PyObject *h = PyLong_FromLongLong(v);
    int r;
    if (h == NULL) return -1;
    r = PyDict_Contains(rb->suppressed, h);
    if (r == 1 && PyDict_DelItem(rb->suppressed, h) < 0) r = -1;
    Py_DECREF(h);
    return r;
}

/* The prefix-closed state's part of removing wire hash ``v``, in KvEventSink._remove's
 * order: a suppressed hash is forgotten (``n_partial``), an unpublished one dropped
 * (``n_unknown``), a published leaf unpublished; a block with published children (a cascade)
 * is the Python loop's. TAKE with *n_out 1 when the removal is published. */
static int closed_removal(RankBatch *rb, int64_t v, int any_suppressed, long *n_partial,
                          long *n_unknown, Py_ssize_t *n_out) {
    PyObject *h = PyLong_FromLongLong(v), *parent;
    int r;
    *n_out = 0;
    if (h == NULL) return FAIL;
    if (any_suppressed) {
        r = PyDict_Contains(rb->suppressed, h);
        if (r == 1) {
            r = PyDict_DelItem(rb->suppressed, h) < 0 ? FAIL : TAKE;
            if (r == TAKE) *n_partial += 1;
            goto done;
        }
        if (r < 0) { r = FAIL; goto done; }
    }
    r = PyDict_Contains(rb->kids, h);
    if (r != 0) { r = r < 0 ? FAIL : LEAVE; goto done; }
    parent = PyDict_GetItemWithError(rb->published, h);
    if (parent == NULL) {
        if (PyErr_Occurred()) { r = FAIL; goto done; }
        *n_unknown += 1; /* never published, or gone in a cascade */
        r = TAKE;
        goto done;
    }
    Py_INCREF(parent);
    r = (PyDict_DelItem(rb->published, h) < 0
         || (parent != Py_None && drop_child(rb->kids, parent, h) < 0)) ? FAIL : TAKE;
    Py_DECREF(parent);
    if (r == TAKE) *n_out = 1;
done:
    Py_DECREF(h);
    return r;
}

/* One "removed" event of valid hashes. A suppressed hash is forgotten and counted in
 * ``n_partial`` (its block was never published), as KvEventSink._remove does. With
 * ``closed``: one hash only (several go to the Python loop); see closed_removal. */
static int take_removed(PyObject *const *df, RankBatch *rb, long *n_removes, long *n_removed,
                        long *n_partial, long *n_unknown, int closed) {
    PyObject *raw = df[D_HASHES];
    Py_ssize_t n, j, kept;
    int64_t one, *values = &one;
    int r, any_suppressed;

    if (raw == NULL || !PyList_CheckExact(raw)) return LEAVE;
    n = PyList_GET_SIZE(raw);
    if (n == 0) return LEAVE;
    if (closed && n != 1) return LEAVE;
    if (n > 1) {
        values = PyMem_Malloc((size_t)n * sizeof(int64_t));
        if (values == NULL) { PyErr_NoMemory(); return FAIL; }
    }
    for (j = 0; j < n; j++)
        if ((r = wire_value(PyList_GET_ITEM(raw, j), &values[j])) != TAKE) goto done;
    any_suppressed = PyDict_GET_SIZE(rb->suppressed) != 0;
    if (closed) {
        r = closed_removal(rb, values[0], any_suppressed, n_partial, n_unknown, &n);
        if (r != TAKE || n == 0) goto done;
    } else if (any_suppressed) {
        /* Every hash was read: from here on the event is taken. One at a time, in order, as
         * the Python loop does (a hash listed twice is suppressed once). */
        for (j = kept = 0; j < n; j++) {
            r = take_suppressed(rb, values[j]);
            if (r < 0) { r = FAIL; goto done; }
            if (r == 1) *n_partial += 1;
            else values[kept++] = values[j];
        }
        n = kept;
    }
    r = TAKE;
    if (n == 0) goto done;
    r = rb_append_removed(rb, values, n);
    if (r < 0) { r = FAIL; goto done; }
    *n_removes += r;
    *n_removed += n;
    r = TAKE;
done:
    if (values != &one) PyMem_Free(values);
    return r;
}

PyDoc_STRVAR(ingest_dicts_doc,
"ingest_dicts(events, start, rank, window, closed)\n"
"    -> (stop, n_in, n_stores, n_stored, n_removes, n_removed, n_partial, n_unknown, tail)\n\n"
"Take events[start:] into ``rank`` (a RankBatch) until the first event the Python loop must\n"
"handle; ``stop`` is its index (len(events) when all were taken). ``window`` is the published\n"
"attention window (None = not known yet); ``closed``: keep the rank's prefix-closed published\n"
"state (``published``/``kids``, updated for the events taken). ``n_partial``: removed hashes\n"
"that were suppressed (never published), forgotten and not published; ``n_unknown``: with\n"
"``closed``, removed hashes not published (dropped). ``n_stored``: the blocks stored.\n"
"``tail``: the wire hash of the partial last block of the last event taken (never published:\n"
"the caller suppresses it before it goes on from ``stop``), else None.");

static PyObject *ingest_dicts(PyObject *module, PyObject *args) {
    PyObject *events, *window;
    RankBatch *rb;
    Py_ssize_t start, i, n;
    int closed;
    long n_in = 0, n_stores = 0, n_stored = 0, n_removes = 0, n_removed = 0, n_partial = 0;
    long n_unknown = 0;
    int64_t tail = 0;
    int has_tail = 0;

    if (!PyArg_ParseTuple(args, "O!nO!Op", &PyList_Type, &events, &start, &RankBatchType,
                          &rb, &window, &closed))
        return NULL;
    if (!PyDict_CheckExact(rb->suppressed) || !PyList_Check(rb->events)
        || (rb->last != Py_None && !PyDict_CheckExact(rb->last))
        || (closed && (!PyDict_CheckExact(rb->published) || !PyDict_CheckExact(rb->kids)))) {
        PyErr_SetString(PyExc_TypeError, "ingest_dicts: the rank's batch state was replaced");
        return NULL;
    }
    n = PyList_GET_SIZE(events);
    for (i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *data, *kind, *v, *ef[EV_N], *df[D_N];
        int r;
        if (!PyDict_CheckExact(ev) || str_dict_pick(ev, EV_KEYS, EV_HASHES, EV_N, ef) < 0) break;
        data = ef[EV_DATA];
        if (data == NULL || !PyDict_CheckExact(data)
            || str_dict_pick(data, D_KEYS, D_HASHES_, D_N, df) < 0)
            break;
        kind = df[D_TYPE];
        if (kind == NULL) break;
        v = ef[EV_WINDOW];
        if (v != NULL && v != Py_None) {
            if (window == Py_None || !PyLong_CheckExact(v) || !PyLong_CheckExact(window)) break;
            r = PyObject_RichCompareBool(v, window, Py_EQ);
            if (r < 0) return NULL;
            if (r == 0) break;
        }
        v = ef[EV_RANK];
        if (v != NULL && v != Py_None) break;
        if (str_is(kind, S_stored)) {
            r = take_stored(df, rb, &n_stores, &n_stored, closed, &tail, &has_tail);
            if (r != TAKE) {
                has_tail = 0;
            } else if (has_tail) { /* the caller suppresses it before the next event */
                i += 1;
                n_in += 1;
                break;
            }
        } else if (str_is(kind, S_removed)) {
            r = take_removed(df, rb, &n_removes, &n_removed, &n_partial, &n_unknown, closed);
        } else {
            break;
        }
        if (r == FAIL) return NULL;
        if (r == LEAVE) break;
        n_in += 1;
    }
    if (has_tail)
        return Py_BuildValue("nlllllllL", i, n_in, n_stores, n_stored, n_removes, n_removed,
                             n_partial, n_unknown, (long long)tail);
    return Py_BuildValue("nlllllllO", i, n_in, n_stores, n_stored, n_removes, n_removed,
                         n_partial, n_unknown, Py_None);
}

/* ---- the V2 hooks' fast path ---------------------------------------------------------- */

/* Wire hash of a radix key (exact bytes of >= 8 bytes): its first 8 bytes, big-endian, as
 * int64. 0 when ``key`` is anything else (the Python hook decides). */
static int key_hash(PyObject *key, int64_t *out) {
    const unsigned char *s;
    uint64_t v = 0;
    if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) < 8) return 0;
    s = (const unsigned char *)PyBytes_AS_STRING(key);
    for (int i = 0; i < 8; i++) v = (v << 8) | s[i];
    *out = (int64_t)v;
    return 1;
}

/* Read the V2 block's fields the store needs, in the order the Python hook reads them (it
 * reads the same ones again when the call goes to it). 1: taken, 0: the Python hook's. */
static int v2_take_store(RankBatch *rb, PyObject *block) {
    PyObject *key = NULL, *tokens = NULL, *prev = NULL, *ordinal = NULL, *pkey = NULL;
    PyObject *h = NULL, *known;
    int64_t hv, pv = 0;
    Py_ssize_t j, bs = rb->block_size;
    int r = 0, new_store, has_parent = 0;

    key = PyObject_GetAttr(block, A_key);
    if (key == NULL || !key_hash(key, &hv)) goto done;
    known = PyDict_GetItemWithError(rb->live_keys, key);
    if (known != NULL) { r = 1; goto done; } /* already published (another layer group) */
    if (PyErr_Occurred()) goto done;
    tokens = PyObject_GetAttr(block, A_tokens);
    if (tokens == NULL || !PyList_CheckExact(tokens) || PyList_GET_SIZE(tokens) != bs) goto done;
    prev = PyObject_GetAttr(block, A_prev);
    if (prev == NULL) goto done;
    if (optional_attr(prev, A_ordinal, &ordinal) < 0) goto done;
    if (ordinal != NULL && !PyLong_CheckExact(ordinal)) goto done;
    if (ordinal == NULL || PyLong_AsLong(ordinal) == -1) {
        if (PyErr_Occurred()) goto done;
    } else {
        /* The parent's wire hash: the one published for its key, else its key's. */
        PyObject *published;
        pkey = PyObject_GetAttr(prev, A_key);
        if (pkey == NULL) goto done;
        published = PyDict_GetItemWithError(rb->live_keys, pkey);
        if (published != NULL) {
            if (!PyLong_CheckExact(published)) goto done;
            pv = PyLong_AsLongLong(published);
            if (pv == -1 && PyErr_Occurred()) goto done;
        } else if (PyErr_Occurred() || !key_hash(pkey, &pv)) {
            goto done;
        }
        has_parent = 1;
    }
    /* The list is re-read here: nothing since its length check ran Python code on it, but
     * the attribute reads in between may have. */
    if (PyList_GET_SIZE(tokens) != bs) goto done;
    if (rb_grow((void **)&rb->scratch, &rb->cap_scratch, bs, sizeof(uint32_t)) < 0) {
        r = -1;
        goto done;
    }
    for (j = 0; j < bs; j++)
        if (!u32_value(PyList_GET_ITEM(tokens, j), &rb->scratch[j])) goto done;
    h = PyLong_FromLongLong(hv);
    if (h == NULL) goto done;
    /* Everything read; from here on the block is taken. */
    if (PyDict_GET_SIZE(rb->suppressed) != 0) {
        PyObject *gone = PyObject_CallMethod(rb->suppressed, "pop", "OO", h, Py_None);
        if (gone == NULL) { r = -1; goto done; }
        Py_DECREF(gone);
    }
    if (PyDict_SetItem(rb->live_keys, key, h) < 0 || PyDict_SetItem(rb->live, h, key) < 0) {
        r = -1;
        goto done;
    }
    new_store = rb_append_store(rb, hv, has_parent, pv, 0, 0);
    if (new_store < 0) { r = -1; goto done; }
    rb->v2_blocks_stored += 1;
    rb->v2_stores += new_store;
    r = 1;
done:
    if (r == 0 && PyErr_Occurred()) {
        /* A read that raised an error goes to the Python hook, which reads again and counts
         * it. MemoryError, and what is not an Exception (KeyboardInterrupt or SystemExit that a
         * signal handler raised while an attribute's Python code ran), propagate. */
        if (PyErr_ExceptionMatches(PyExc_MemoryError)
            || !PyErr_ExceptionMatches(PyExc_Exception))
            r = -1;
        else
            PyErr_Clear();
    }
    Py_XDECREF(key);
    Py_XDECREF(tokens);
    Py_XDECREF(prev);
    Py_XDECREF(ordinal);
    Py_XDECREF(pkey);
    Py_XDECREF(h);
    return r;
}

static PyObject *fallback(PyObject *hook, PyObject *arg) {
    if (hook == NULL || hook == Py_None) {
        PyErr_SetString(PyExc_RuntimeError, "RankBatch: no Python hook to hand the call to");
        return NULL;
    }
    return PyObject_CallOneArg(hook, arg);
}

PyObject *RankBatch_v2_store(RankBatch *rb, PyObject *block) {
    int r = rb->fast_hooks ? v2_take_store(rb, block) : 0;
    if (r < 0) return NULL;
    if (r == 0) return fallback(rb->fallback_store, block);
    Py_RETURN_NONE;
}

PyObject *RankBatch_v2_remove(RankBatch *rb, PyObject *key) {
    PyObject *h;
    int64_t hv;
    int r;
    if (!rb->fast_hooks || !PyBytes_CheckExact(key)) return fallback(rb->fallback_remove, key);
    h = PyDict_GetItemWithError(rb->live_keys, key);
    if (h == NULL) {
        if (PyErr_Occurred()) return NULL;
        return fallback(rb->fallback_remove, key); /* never published: counted there */
    }
    if (!PyLong_CheckExact(h)) return fallback(rb->fallback_remove, key);
    Py_INCREF(h);
    if (PyDict_DelItem(rb->live_keys, key) < 0) { Py_DECREF(h); return NULL; }
    if (PyDict_GetItemWithError(rb->live, h) != NULL) {
        if (PyDict_DelItem(rb->live, h) < 0) { Py_DECREF(h); return NULL; }
    } else if (PyErr_Occurred()) {
        Py_DECREF(h);
        return NULL;
    }
    hv = PyLong_AsLongLong(h);
    Py_DECREF(h);
    if (hv == -1 && PyErr_Occurred()) return NULL;
    r = rb_append_removed(rb, &hv, 1);
    if (r < 0) return NULL;
    rb->v2_blocks_removed += 1;
    rb->v2_removes += r;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"ingest_dicts", ingest_dicts, METH_VARARGS, ingest_dicts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbm_plugin.events._sink_c",
    "Compiled batch and ingest loop of KvEventSink (optional; event_sink.py holds the "
    "reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__sink_c(void) {
    PyObject *module;
    if (intern_wire_keys() < 0) return NULL;
    INTERN(K_data, "data");
    INTERN(K_window_size, "window_size");
    INTERN(K_attention_dp_rank, "attention_dp_rank");
    INTERN(K_blocks, "blocks");
    INTERN(K_tokens, "tokens");
    INTERN(K_token_id, "token_id");
    INTERN(K_block_hash, "block_hash");
    INTERN(K_parent_hash, "parent_hash");
    INTERN(K_cache_salt_id, "cache_salt_id");
    INTERN(A_key, "key");
    INTERN(A_tokens, "tokens");
    INTERN(A_prev, "prev");
    INTERN(A_ordinal, "ordinal");
    INTERN(S_stored, "stored");
    INTERN(S_removed, "removed");
    EV_KEYS[EV_DATA] = K_data;
    EV_KEYS[EV_WINDOW] = K_window_size;
    EV_KEYS[EV_RANK] = K_attention_dp_rank;
    D_KEYS[D_TYPE] = K_type;
    D_KEYS[D_BLOCKS] = K_blocks;
    D_KEYS[D_PARENT] = K_parent_hash;
    D_KEYS[D_LORA] = K_lora_id;
    D_KEYS[D_HASHES] = K_block_hashes;
    B_KEYS[B_TOKENS] = K_tokens;
    B_KEYS[B_HASH] = K_block_hash;
    B_KEYS[B_LORA] = K_lora_id;
    B_KEYS[B_SALT] = K_cache_salt;
    B_KEYS[B_SALT_ID] = K_cache_salt_id;
    B_KEYS[B_MM] = K_mm_keys;
    if (key_hashes(EV_KEYS, EV_HASHES, EV_N) < 0 || key_hashes(D_KEYS, D_HASHES_, D_N) < 0
        || key_hashes(B_KEYS, B_HASHES, B_N) < 0)
        return NULL;
    if (rank_batch_ready() < 0) return NULL;
    module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "RankBatch", (PyObject *)&RankBatchType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
