/* Compiled fast path of event_sink.py: KvEventSink.ingest for TensorRT-LLM's decode steady
 * state (module kvbm_plugin._event_sink_c).
 *
 * ingest_dicts() takes the buffered event dicts that need no decision beyond the common case
 * (a one-block full "stored", a "removed" of valid hashes, the published window, the sink's
 * own rank) and builds exactly the wire maps the Python loop in event_sink.py builds, in the
 * same order, coalescing the same way. At the first event it does not take, it stops and
 * returns that event's index: the Python loop handles that event (window changes, created,
 * updated, partial blocks, other ranks, suppressed removals, malformed input) and calls back
 * for the rest. An event is either taken whole or left untouched, so the Python loop sees it
 * exactly as it arrived. The Python loop is the reference; tests run both on the same input
 * and compare the output byte for byte.
 *
 * Called with the sink's lock held, on the thread that ingests (the executor thread or the
 * KV-event dispatch thread). Holds the GIL throughout and calls no Python code: every object
 * it reads is an exact list, str or int, or an exact dict whose keys are all exact str (a key
 * of another type could run its own __eq__ during a lookup and free what is held borrowed;
 * such an event goes to the Python loop). A store is checked whole (token ids u32, lora_id
 * None or u64) before the batch changes.
 */

#include "_native_common.h"

static PyObject *K_data, *K_window_size, *K_attention_dp_rank, *K_blocks, *K_tokens, *K_token_id,
    *K_block_hash, *K_parent_hash;
static PyObject *S_stored, *S_removed, *S_GPU;

/* Borrowed d[key] (NULL if absent) for an exact dict; LEAVE if absent and required. */
static int get_item(PyObject *d, PyObject *key, PyObject **out, int required) {
    PyObject *v = PyDict_GetItemWithError(d, key);
    if (v == NULL) {
        if (PyErr_Occurred()) return FAIL;
        if (required) return LEAVE;
    }
    *out = v;
    return TAKE;
}

/* d[key] (borrowed) for an exact dict, found by walking its entries: 1 found, 0 absent, -1 a
 * key that is not an exact str (the event goes to the Python loop). One pass both checks the
 * keys (see str_keys_only) and finds the value, for the small dicts read once per token. */
static int str_keyed_item(PyObject *d, PyObject *key, PyObject **out) {
    Py_ssize_t pos = 0, len = PyUnicode_GET_LENGTH(key), left = PyDict_GET_SIZE(d);
    PyObject *k, *v;
    int found = 0;
    if (unicode_keyed(d)) { /* only exact str keys: a lookup runs no Python code */
        v = PyDict_GetItemWithError(d, key);
        if (v == NULL) return PyErr_Occurred() ? -1 : 0;
        *out = v;
        return 1;
    }
    while (left-- > 0 && PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) return -1;
        if (!found && (k == key || (PyUnicode_GET_LENGTH(k) == len
                                    && PyUnicode_Compare(k, key) == 0))) {
            *out = v;
            found = 1;
        }
    }
    return found;
}

/* New reference to the wire hash (signed int64) of an exact int given as int64 or u64. */
static int wire_hash(PyObject *h, PyObject **out) {
    int overflow = 0;
    long long v;
    unsigned long long u;
    if (!PyLong_CheckExact(h)) return LEAVE;
    v = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return FAIL;
        Py_INCREF(h);
        *out = h;
        return TAKE;
    }
    if (overflow < 0) return LEAVE; /* below int64: Python raises a clear error */
    u = PyLong_AsUnsignedLongLong(h);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return FAIL;
        PyErr_Clear(); /* >= 2**64: Python raises a clear error */
        return LEAVE;
    }
    *out = PyLong_FromLongLong((long long)u);
    return *out == NULL ? FAIL : TAKE;
}

/* Whether ``last`` is a BlockStored map that a store with ``parent``/``lora_id`` extends. */
static int extends_stored(PyObject *last, PyObject *parent, PyObject *lora_id) {
    PyObject *type, *hashes, *tail, *last_lora;
    if (last == Py_None || parent == Py_None || !PyDict_CheckExact(last)) return 0;
    type = PyDict_GetItemWithError(last, K_type);
    if (type == NULL || !str_is(type, S_BlockStored)) return PyErr_Occurred() ? -1 : 0;
    hashes = PyDict_GetItemWithError(last, K_block_hashes);
    if (hashes == NULL || !PyList_CheckExact(hashes) || PyList_GET_SIZE(hashes) == 0)
        return PyErr_Occurred() ? -1 : 0;
    tail = PyList_GET_ITEM(hashes, PyList_GET_SIZE(hashes) - 1);
    if (!PyLong_CheckExact(tail)) return 0;
    if (PyObject_RichCompareBool(tail, parent, Py_EQ) != 1) return PyErr_Occurred() ? -1 : 0;
    last_lora = PyDict_GetItemWithError(last, K_lora_id);
    if (last_lora == NULL) return PyErr_Occurred() ? -1 : 0;
    if (last_lora == lora_id) return 1;
    if (!PyLong_CheckExact(last_lora) || !PyLong_CheckExact(lora_id)) return 0;
    return PyObject_RichCompareBool(last_lora, lora_id, Py_EQ);
}

static int is_removed_map(PyObject *last) {
    PyObject *type;
    if (last == Py_None || !PyDict_CheckExact(last)) return 0;
    type = PyDict_GetItemWithError(last, K_type);
    if (type == NULL) return PyErr_Occurred() ? -1 : 0;
    return str_is(type, S_BlockRemoved);
}

/* The maps and lists built here hold only str, int and None (and the map its two int lists):
 * they cannot be part of a reference cycle, so the cyclic collector is told not to track them.
 * A batch lives until the publisher thread has encoded it; tracked, each of its containers
 * would be traversed by every young-generation collection in the meantime and promoted
 * towards the old generation, work that lands on whichever thread allocates next (usually
 * the engine's). */
static PyObject *untracked(PyObject *op) {
    if (op != NULL) PyObject_GC_UnTrack(op);
    return op;
}

/* kids[parent] += delta (exact dict of exact ints), deleting the entry at 0. */
static int add_kid(PyObject *kids, PyObject *parent, long delta) {
    PyObject *v = PyDict_GetItemWithError(kids, parent), *nv;
    long n = 0;
    if (v == NULL && PyErr_Occurred()) return -1;
    if (v != NULL) {
        n = PyLong_AsLong(v);
        if (n == -1 && PyErr_Occurred()) return -1;
    }
    n += delta;
    if (n <= 0) return v == NULL ? 0 : PyDict_DelItem(kids, parent);
    nv = PyLong_FromLong(n);
    if (nv == NULL) return -1;
    n = PyDict_SetItem(kids, parent, nv);
    Py_DECREF(nv);
    return (int)n;
}

/* One "stored" event (``data`` exact dict). Updates *last (new reference swapped in).
 * ``published``/``kids``: the rank's prefix-closed state; a store under an unpublished parent
 * or of a published hash is left to the Python loop (which drops it, counted). */
static int take_stored(PyObject *data, PyObject *out, PyObject **last, PyObject *block_size,
                       Py_ssize_t bs, long *n_stores, PyObject *published, PyObject *kids) {
    PyObject *blocks, *block, *tokens, *raw, *h = NULL, *parent = NULL, *lora_id, *token_ids;
    PyObject *ev = NULL, *hashes;
    Py_ssize_t j;
    int r, ext;

    if ((r = get_item(data, K_blocks, &blocks, 1)) != TAKE) return r;
    if (!PyList_CheckExact(blocks) || PyList_GET_SIZE(blocks) != 1) return LEAVE;
    block = PyList_GET_ITEM(blocks, 0);
    if (!PyDict_CheckExact(block) || !str_keys_only(block)) return LEAVE;
    if ((r = get_item(block, K_tokens, &tokens, 1)) != TAKE) return r;
    if (!PyList_CheckExact(tokens) || PyList_GET_SIZE(tokens) != bs) return LEAVE;
    if ((r = get_item(block, K_block_hash, &raw, 1)) != TAKE) return r;
    {
        /* Per-block LoRA, multimodal keys or cache salt (newer serializers): the Python loop
         * turns them into lora_id / extra_keys. */
        PyObject *v;
        if ((r = get_item(block, K_lora_id, &v, 0)) != TAKE) return r;
        if (v != NULL && v != Py_None) return LEAVE;
        if ((r = get_item(block, K_cache_salt, &v, 0)) != TAKE) return r;
        if (v != NULL && v != Py_None) return LEAVE;
        if ((r = get_item(block, K_mm_keys, &v, 0)) != TAKE) return r;
        if (v != NULL && v != Py_None && !(PyList_CheckExact(v) && PyList_GET_SIZE(v) == 0))
            return LEAVE;
    }
    if ((r = get_item(data, K_lora_id, &lora_id, 0)) != TAKE) return r;
    /* ``data.get("lora_id") or None``, for the values TRT-LLM sends (None or an int). */
    if (lora_id != NULL && lora_id != Py_None) {
        if (!PyLong_CheckExact(lora_id) || !int_in_range(lora_id, ULLONG_MAX)) return LEAVE;
        r = PyObject_IsTrue(lora_id);
        if (r < 0) return FAIL;
        if (r == 0) lora_id = NULL;
    }
    if (lora_id == NULL) lora_id = Py_None;
    if ((r = get_item(data, K_parent_hash, &parent, 0)) != TAKE) return r;
    if (parent == NULL || parent == Py_None) {
        parent = Py_None;
        Py_INCREF(parent);
    } else if ((r = wire_hash(parent, &parent)) != TAKE) {
        return r;
    }
    if ((r = wire_hash(raw, &h)) != TAKE) goto done;
    if (published != Py_None) {
        int known = parent == Py_None ? 1 : PyDict_Contains(published, parent);
        int again = known == 1 ? PyDict_Contains(published, h) : 0;
        if (known < 0 || again < 0) { r = FAIL; goto done; }
        if (!known || again) { r = LEAVE; goto done; }
    }
    token_ids = untracked(PyList_New(bs));
    if (token_ids == NULL) { r = FAIL; goto done; }
    for (j = 0; j < bs; j++) {
        PyObject *tok = PyList_GET_ITEM(tokens, j), *tid;
        if (!PyDict_CheckExact(tok) || str_keyed_item(tok, K_token_id, &tid) != 1
            || !PyLong_CheckExact(tid) || !int_in_range(tid, 0xFFFFFFFFULL)) {
            Py_DECREF(token_ids);
            r = LEAVE;
            goto done;
        }
        Py_INCREF(tid);
        PyList_SET_ITEM(token_ids, j, tid);
    }
    /* Everything read; from here on the event is taken. */
    if (published != Py_None && (PyDict_SetItem(published, h, parent) < 0
                                 || (parent != Py_None && add_kid(kids, parent, 1) < 0))) {
        Py_DECREF(token_ids);
        r = FAIL;
        goto done;
    }
    ext = extends_stored(*last, parent, lora_id);
    if (ext < 0) { Py_DECREF(token_ids); r = FAIL; goto done; }
    if (ext) {
        PyObject *lh = PyDict_GetItemWithError(*last, K_block_hashes);
        PyObject *lt = PyDict_GetItemWithError(*last, K_token_ids);
        if (lh == NULL || lt == NULL || !PyList_CheckExact(lt)) {
            Py_DECREF(token_ids);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "BlockStored map lost its lists");
            r = FAIL;
            goto done;
        }
        r = (PyList_Append(lh, h) < 0 || list_extend(lt, token_ids) < 0) ? FAIL : TAKE;
        Py_DECREF(token_ids);
        goto done;
    }
    hashes = untracked(PyList_New(1));
    if (hashes == NULL) { Py_DECREF(token_ids); r = FAIL; goto done; }
    Py_INCREF(h);
    PyList_SET_ITEM(hashes, 0, h);
    ev = stored_map(hashes, parent, token_ids, block_size, lora_id, S_GPU, Py_None);
    if (ev == NULL || PyList_Append(out, ev) < 0) {
        Py_DECREF(hashes);
        Py_DECREF(token_ids);
        Py_XDECREF(ev);
        r = FAIL;
        goto done;
    }
    Py_DECREF(hashes);
    Py_DECREF(token_ids);
    PyObject_GC_UnTrack(ev); /* after the inserts: inserting a list would track it again */
    Py_SETREF(*last, ev);
    *n_stores += 1;
    r = TAKE;
done:
    Py_XDECREF(h);
    Py_XDECREF(parent);
    return r;
}

/* One "removed" event of one published leaf; ``suppressed`` non-empty means Python must check
 * each hash. Several hashes, an unpublished one, or one with published children (a cascade)
 * are left to the Python loop. */
static int take_removed(PyObject *data, PyObject *out, PyObject **last, PyObject *suppressed,
                        long *n_removes, long *n_removed, PyObject *published, PyObject *kids) {
    PyObject *raw, *hashes, *ev;
    Py_ssize_t n, j;
    int r, ext;

    if ((r = get_item(data, K_block_hashes, &raw, 1)) != TAKE) return r;
    if (!PyList_CheckExact(raw)) return LEAVE;
    n = PyList_GET_SIZE(raw);
    if (n == 0 || PyDict_GET_SIZE(suppressed) != 0) return LEAVE;
    if (published != Py_None && n != 1) return LEAVE;
    hashes = untracked(PyList_New(n));
    if (hashes == NULL) return FAIL;
    for (j = 0; j < n; j++) {
        PyObject *h;
        if ((r = wire_hash(PyList_GET_ITEM(raw, j), &h)) != TAKE) {
            Py_DECREF(hashes);
            return r;
        }
        PyList_SET_ITEM(hashes, j, h);
    }
    if (published != Py_None) {
        PyObject *h = PyList_GET_ITEM(hashes, 0), *parent;
        int leaf = PyDict_Contains(kids, h);
        parent = leaf == 0 ? PyDict_GetItemWithError(published, h) : NULL;
        if (leaf < 0 || (parent == NULL && PyErr_Occurred())) { Py_DECREF(hashes); return FAIL; }
        if (leaf || parent == NULL) { Py_DECREF(hashes); return LEAVE; }
        Py_INCREF(parent);
        if (PyDict_DelItem(published, h) < 0
            || (parent != Py_None && add_kid(kids, parent, -1) < 0)) {
            Py_DECREF(parent);
            Py_DECREF(hashes);
            return FAIL;
        }
        Py_DECREF(parent);
    }
    ext = is_removed_map(*last);
    if (ext < 0) { Py_DECREF(hashes); return FAIL; }
    if (ext) {
        PyObject *lh = PyDict_GetItemWithError(*last, K_block_hashes);
        if (lh == NULL || !PyList_CheckExact(lh)) {
            Py_DECREF(hashes);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_RuntimeError, "BlockRemoved map lost its list");
            return FAIL;
        }
        r = list_extend(lh, hashes) < 0 ? FAIL : TAKE;
        Py_DECREF(hashes);
        *n_removed += n;
        return r;
    }
    ev = removed_map(hashes, S_GPU);
    if (ev == NULL || PyList_Append(out, ev) < 0) {
        Py_DECREF(hashes);
        Py_XDECREF(ev);
        return FAIL;
    }
    Py_DECREF(hashes);
    PyObject_GC_UnTrack(ev);
    Py_SETREF(*last, ev);
    *n_removes += 1;
    *n_removed += n;
    return TAKE;
}

PyDoc_STRVAR(ingest_dicts_doc,
"ingest_dicts(events, start, out, last, block_size, window, suppressed, published, kids)\n"
"    -> (stop, last, n_in, n_stores, n_stored, n_removes, n_removed)\n\n"
"Convert events[start:] into wire maps appended to ``out`` (the rank's batch), coalescing\n"
"with ``last`` (the batch's last map or None), until the first event the Python loop must\n"
"handle; ``stop`` is its index (len(events) when all were taken). ``window`` is the published\n"
"attention window (None = not known yet), ``suppressed`` the rank's unpublished hashes,\n"
"``published``/``kids`` its prefix-closed published state (updated for the events taken),\n"
"or None for a sink that does not keep the stream prefix-closed.");

static PyObject *ingest_dicts(PyObject *module, PyObject *args) {
    PyObject *events, *out, *last, *block_size, *window, *suppressed, *published, *kids;
    PyObject *result;
    Py_ssize_t start, i, n, bs;
    long n_in = 0, n_stores = 0, n_stored = 0, n_removes = 0, n_removed = 0;

    if (!PyArg_ParseTuple(args, "O!nO!OO!OO!OO", &PyList_Type, &events, &start,
                          &PyList_Type, &out, &last, &PyLong_Type, &block_size, &window,
                          &PyDict_Type, &suppressed, &published, &kids))
        return NULL;
    if (published != Py_None && (!PyDict_CheckExact(published) || !PyDict_CheckExact(kids))) {
        PyErr_SetString(PyExc_TypeError, "ingest_dicts: published and kids must be dicts");
        return NULL;
    }
    bs = PyLong_AsSsize_t(block_size);
    if (bs == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear(); /* no token list is that long: every store goes to the Python loop */
    }
    Py_INCREF(last);
    n = PyList_GET_SIZE(events);
    for (i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *data, *kind, *v;
        int r;
        if (!PyDict_CheckExact(ev) || !str_keys_only(ev)) break;
        if ((r = get_item(ev, K_data, &data, 1)) != TAKE) goto stop;
        if (!PyDict_CheckExact(data) || !str_keys_only(data)) break;
        if ((r = get_item(data, K_type, &kind, 1)) != TAKE) goto stop;
        if ((r = get_item(ev, K_window_size, &v, 0)) != TAKE) goto stop;
        if (v != NULL && v != Py_None) {
            if (window == Py_None || !PyLong_CheckExact(v) || !PyLong_CheckExact(window)) break;
            r = PyObject_RichCompareBool(v, window, Py_EQ);
            if (r < 0) goto fail;
            if (r == 0) break;
        }
        if ((r = get_item(ev, K_attention_dp_rank, &v, 0)) != TAKE) goto stop;
        if (v != NULL && v != Py_None) break;
        if (str_is(kind, S_stored)) {
            r = take_stored(data, out, &last, block_size, bs, &n_stores, published, kids);
            if (r == TAKE) n_stored += 1;
        } else if (str_is(kind, S_removed)) {
            r = take_removed(data, out, &last, suppressed, &n_removes, &n_removed, published,
                             kids);
        } else {
            break;
        }
    stop:
        if (r == FAIL) goto fail;
        if (r == LEAVE) break;
        n_in += 1;
    }
    result = Py_BuildValue("nNlllll", i, last, n_in, n_stores, n_stored, n_removes, n_removed);
    return result;
fail:
    Py_DECREF(last);
    return NULL;
}

/* Whether every item of ``list`` is an exact int (such a list cannot be part of a cycle). */
static int ints_only(PyObject *list) {
    Py_ssize_t j, n = PyList_GET_SIZE(list);
    for (j = 0; j < n; j++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(list, j))) return 0;
    return 1;
}

PyDoc_STRVAR(v2_stored_map_doc,
"v2_stored_map(h, parent, tokens, block_size) -> dict\n\n"
"The BlockStored map of one V2 hook store, equal to the literal the Python code builds\n"
"(``block_hashes`` [h], ``token_ids`` list(tokens), lora_id/lora_name None, medium GPU),\n"
"kept out of the cyclic collector with its lists (as the compiled ingest loop keeps its\n"
"maps: a batch waiting for the publisher thread then costs the engine thread's collections\n"
"nothing). The token list stays tracked unless it holds only exact ints.");

static PyObject *v2_stored_map(PyObject *module, PyObject *args) {
    PyObject *h, *parent, *tokens, *block_size, *hashes, *token_ids, *ev;
    if (!PyArg_ParseTuple(args, "OOOO", &h, &parent, &tokens, &block_size)) return NULL;
    token_ids = PySequence_List(tokens);
    if (token_ids == NULL) return NULL;
    if (ints_only(token_ids)) PyObject_GC_UnTrack(token_ids);
    hashes = PyList_New(1);
    if (hashes == NULL) { Py_DECREF(token_ids); return NULL; }
    Py_INCREF(h);
    PyList_SET_ITEM(hashes, 0, h);
    if (PyLong_CheckExact(h)) PyObject_GC_UnTrack(hashes);
    ev = stored_map(hashes, parent, token_ids, block_size, Py_None, S_GPU, Py_None);
    Py_DECREF(hashes);
    Py_DECREF(token_ids);
    if (ev != NULL && !PyObject_GC_IsTracked(hashes) && !PyObject_GC_IsTracked(token_ids)
        && (parent == Py_None || PyLong_CheckExact(parent)) && PyLong_CheckExact(block_size))
        PyObject_GC_UnTrack(ev);
    return ev;
}

PyDoc_STRVAR(v2_removed_map_doc,
"v2_removed_map(h) -> dict\n\n"
"The BlockRemoved map of one V2 hook removal ({type, block_hashes [h], medium GPU}), kept out\n"
"of the cyclic collector like v2_stored_map's.");

static PyObject *v2_removed_map(PyObject *module, PyObject *h) {
    PyObject *hashes = PyList_New(1), *ev;
    if (hashes == NULL) return NULL;
    Py_INCREF(h);
    PyList_SET_ITEM(hashes, 0, h);
    ev = removed_map(hashes, S_GPU);
    Py_DECREF(hashes);
    if (ev != NULL && PyLong_CheckExact(h)) {
        PyObject_GC_UnTrack(hashes);
        PyObject_GC_UnTrack(ev);
    }
    return ev;
}

static PyMethodDef methods[] = {
    {"ingest_dicts", ingest_dicts, METH_VARARGS, ingest_dicts_doc},
    {"v2_stored_map", v2_stored_map, METH_VARARGS, v2_stored_map_doc},
    {"v2_removed_map", v2_removed_map, METH_O, v2_removed_map_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbm_plugin._event_sink_c",
    "Compiled ingest loop of KvEventSink (optional; event_sink.py holds the reference).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__event_sink_c(void) {
    if (intern_wire_keys() < 0) return NULL;
    INTERN(K_data, "data");
    INTERN(K_window_size, "window_size");
    INTERN(K_attention_dp_rank, "attention_dp_rank");
    INTERN(K_blocks, "blocks");
    INTERN(K_tokens, "tokens");
    INTERN(K_token_id, "token_id");
    INTERN(K_block_hash, "block_hash");
    INTERN(K_parent_hash, "parent_hash");
    INTERN(S_stored, "stored");
    INTERN(S_removed, "removed");
    INTERN(S_GPU, "GPU");
    return PyModule_Create(&module_def);
}
