/* Compiled fast paths of consolidator_core.py: ConsolidatorCore in dedup mode (module
 * kvbm_plugin.consolidator._core_c).
 *
 * The per-block loops of the dedup core: a chain of stored blocks (_store_chain), a removal
 * (_removed), and a whole batch's common events (apply_events). They work on the core's own
 * Python structures (the rank's dicts and the block lists, layout B_* below, the same as
 * consolidator_core.py's _IDENT ...), so the Python code and these take turns on one state. The
 * rare branches call back into the Python core (a derived published hash, a second alias, a
 * release of the hash's previous block). Called on the consolidator's ingest thread only,
 * with the GIL held throughout.
 *
 * Input events are read only through lookups that run no Python code: an event map whose keys
 * are not all exact str, a medium that is not an exact str, a token that is not an exact int
 * (its __hash__ / __eq__ could change or free what is held borrowed) is left to the Python
 * code, as is anything it refuses (a token id outside u32, a lora_id other than None or a u64,
 * a lora_name other than None or a str, a token count that does not fit the arithmetic).
 */

#include "../_util/native_common.h"

enum { B_IDENT, B_PUB, B_WIRE, B_PARENT, B_CHILDREN, B_TOTAL, B_COUNTS, B_ALIAS_SLOT,
       B_ALIAS_EXT, B_MORE_ALIASES, B_LEN };

static int is_block(PyObject *b) {
    if (PyList_CheckExact(b) && PyList_GET_SIZE(b) == B_LEN) return 1;
    PyErr_Format(PyExc_TypeError, "consolidator block is not a %d-item list", (int)B_LEN);
    return 0;
}

/* block[index] += delta (an int field); the new value in *value. */
static int add_to(PyObject *block, int index, Py_ssize_t delta, Py_ssize_t *value) {
    Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(block, index));
    PyObject *v;
    if (n == -1 && PyErr_Occurred()) return -1;
    v = PyLong_FromSsize_t(n + delta);
    if (v == NULL) return -1;
    PyList_SetItem(block, index, v); /* steals v, releases the old value */
    if (value != NULL) *value = n + delta;
    return 0;
}

static int int_field(PyObject *block, int index, Py_ssize_t *value) {
    *value = PyLong_AsSsize_t(PyList_GET_ITEM(block, index));
    return (*value == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* Signed int64 form of a u64 published hash. */
static PyObject *wire_of(PyObject *pub) {
    unsigned long long u = PyLong_AsUnsignedLongLong(pub);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromLongLong((long long)u);
}

static PyObject *new_block(PyObject *ident, PyObject *pub, PyObject *parent, PyObject *slot,
                           PyObject *ext) {
    PyObject *wire = wire_of(pub), *block, *zero;
    if (wire == NULL) return NULL;
    block = PyList_New(B_LEN);
    zero = PyLong_FromLong(0);
    if (block == NULL || zero == NULL) {
        Py_XDECREF(block);
        Py_XDECREF(zero);
        Py_DECREF(wire);
        return NULL;
    }
    Py_INCREF(ident);
    PyList_SET_ITEM(block, B_IDENT, ident);
    Py_INCREF(pub);
    PyList_SET_ITEM(block, B_PUB, pub);
    PyList_SET_ITEM(block, B_WIRE, wire);
    Py_INCREF(parent);
    PyList_SET_ITEM(block, B_PARENT, parent);
    Py_INCREF(zero);
    PyList_SET_ITEM(block, B_CHILDREN, zero);
    PyList_SET_ITEM(block, B_TOTAL, zero);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(block, B_COUNTS, Py_None);
    Py_INCREF(slot);
    PyList_SET_ITEM(block, B_ALIAS_SLOT, slot);
    Py_INCREF(ext);
    PyList_SET_ITEM(block, B_ALIAS_EXT, ext);
    Py_INCREF(Py_None);
    PyList_SET_ITEM(block, B_MORE_ALIASES, Py_None);
    /* A block refers only to older blocks (its parent) and to ints: never part of a cycle.
     * Blocks live as long as some tier holds them; untracked, the collector never walks them. */
    PyObject_GC_UnTrack(block);
    return block;
}

static PyObject *stored_run(PyObject *wire, PyObject *parent_wire, PyObject *block_size,
                            PyObject *lora_id, PyObject *medium, PyObject *lora_name) {
    PyObject *hashes = PyList_New(1), *ev;
    if (hashes == NULL) return NULL;
    Py_INCREF(wire);
    PyList_SET_ITEM(hashes, 0, wire);
    ev = stored_map(hashes, parent_wire, Py_None, block_size, lora_id, medium, lora_name);
    Py_DECREF(hashes);
    return ev;
}

PyDoc_STRVAR(store_chain_doc,
"store_chain(rank, blocks, known, held, published, out, hashes, tokens, block_size,\n"
"            parent, pident, parent_wire, slot, lora_id, lora_name, medium, group,\n"
"            fresh_pub, add_alias, release) -> (visible, duplicates, runs, run_blocks) | None\n\n"
"The block loop of ConsolidatorCore._store_chain in dedup mode, on the same structures.\n"
"Identities are computed first (a token that is not a u32 int raises TypeError before\n"
"anything changed). None, with nothing changed, when a hash of the chain would release\n"
"another block.");

/* The chain loop shared by store_chain and stored_one (arguments as store_chain's). */
static PyObject *chain(PyObject *rank, PyObject *blocks, PyObject *known, PyObject *held,
                       PyObject *published, PyObject *out, PyObject *hashes, PyObject *tokens,
                       PyObject *bs_obj, PyObject *parent, PyObject *pident,
                       PyObject *parent_wire, PyObject *slot, PyObject *lora_id,
                       PyObject *lora_name, PyObject *medium, PyObject *group,
                       PyObject *fresh_pub, PyObject *add_alias, PyObject *release,
                       int *mutated) {
    PyObject *idents = NULL, *runs = NULL, *block = NULL, *run = NULL, *run_hashes = NULL;
    PyObject *result = NULL;
    Py_ssize_t *firsts = NULL, n, bs, i, nruns = 0, run_end = -1, visible = 0, dups = 0;
    Py_ssize_t run_blocks = 0;

    bs = PyLong_AsSsize_t(bs_obj);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    n = PyList_GET_SIZE(hashes);
    if (bs <= 0 || (n > 0 && bs > PY_SSIZE_T_MAX / n) || PyList_GET_SIZE(tokens) != n * bs) {
        PyErr_SetString(PyExc_ValueError, "store_chain: token count is not blocks * block_size");
        return NULL;
    }
    if (parent != Py_None && !is_block(parent)) return NULL;

    /* Pass 1: the content-chain identities, hash((parent identity, tuple(block's tokens))),
     * exactly the Python loop's values. */
    idents = PyList_New(n);
    if (idents == NULL) return NULL;
    {
        PyObject *pid = pident;
        for (i = 0; i < n; i++) {
            PyObject *piece = PyTuple_New(bs), *pair, *ident;
            Py_hash_t h;
            Py_ssize_t k;
            if (piece == NULL) goto fail;
            for (k = 0; k < bs; k++) {
                PyObject *token = PyList_GET_ITEM(tokens, i * bs + k);
                /* u32 exact ints only (what the Python code accepts): hashing one runs no
                 * Python code, whereas a token's own __hash__ could change ``tokens`` under
                 * this loop. TypeError before anything changed, as for an unhashable
                 * token: the caller leaves the event to the Python code. */
                if (!PyLong_CheckExact(token) || !int_in_range(token, 0xFFFFFFFFULL)) {
                    Py_DECREF(piece);
                    PyErr_SetString(PyExc_TypeError, "store_chain: a token id is not a u32 "
                                    "int");
                    goto fail;
                }
                Py_INCREF(token);
                PyTuple_SET_ITEM(piece, k, token);
            }
            pair = PyTuple_Pack(2, pid, piece);
            Py_DECREF(piece);
            if (pair == NULL) goto fail;
            h = PyObject_Hash(pair);
            Py_DECREF(pair);
            if (h == -1 && PyErr_Occurred()) goto fail;
            ident = PyLong_FromSsize_t(h);
            if (ident == NULL) goto fail;
            PyList_SET_ITEM(idents, i, ident);
            pid = ident;
        }
    }
    /* Pass 1b, read-only: a hash the slot holds for other content, or one repeated along the
     * chain, releases a block mid-chain (a source reusing one hash); that chain is left to the
     * Python loop (None), which keeps the output prefix-closed through the release. */
    {
        PyObject *seen = n > 1 ? PySet_New(NULL) : NULL;
        int leave = 0;
        if (n > 1 && seen == NULL) goto fail;
        for (i = 0; i < n && !leave; i++) {
            PyObject *ext = PyList_GET_ITEM(hashes, i), *old, *mine;
            old = PyDict_GetItemWithError(held, ext);
            if (old == NULL && PyErr_Occurred()) { Py_XDECREF(seen); goto fail; }
            if (old != NULL) {
                mine = PyDict_GetItemWithError(blocks, PyList_GET_ITEM(idents, i));
                if (mine == NULL && PyErr_Occurred()) { Py_XDECREF(seen); goto fail; }
                leave = mine != old;
            }
            if (seen != NULL && !leave) {
                int dup = PySet_Contains(seen, ext);
                if (dup < 0 || (!dup && PySet_Add(seen, ext) < 0)) { Py_DECREF(seen); goto fail; }
                leave = dup;
            }
        }
        Py_XDECREF(seen);
        if (leave) {
            Py_INCREF(Py_None);
            result = Py_None;
            goto done;
        }
    }
    runs = PyList_New(0);
    firsts = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(Py_ssize_t));
    if (runs == NULL || firsts == NULL) {
        if (firsts == NULL) PyErr_NoMemory();
        goto fail;
    }

    /* Pass 2: residency and output, block by block. ``parent`` is owned from here on: a
     * release called back below may drop the last other reference to it. */
    *mutated = 1;
    Py_INCREF(parent);
    for (i = 0; i < n; i++) {
        PyObject *ext = PyList_GET_ITEM(hashes, i), *ident = PyList_GET_ITEM(idents, i);
        PyObject *old;
        block = PyDict_GetItemWithError(blocks, ident);
        if (block == NULL) {
            PyObject *pub;
            int taken;
            if (PyErr_Occurred()) goto fail_parent;
            taken = PyDict_Contains(published, ext);
            if (taken < 0) goto fail_parent;
            pub = taken ? PyObject_CallFunctionObjArgs(fresh_pub, published, ext, ident, NULL)
                        : (Py_INCREF(ext), ext);
            if (pub == NULL) goto fail_parent;
            block = new_block(ident, pub, parent, slot, ext);
            if (block == NULL || PyDict_SetItem(published, pub, block) < 0
                || PyDict_SetItem(blocks, ident, block) < 0
                || PyDict_SetItem(known, ext, block) < 0
                || (parent != Py_None && add_to(parent, B_CHILDREN, 1, NULL) < 0)) {
                Py_DECREF(pub);
                goto fail_parent;
            }
            Py_DECREF(pub);
        } else {
            PyObject *named;
            if (!is_block(block)) { block = NULL; goto fail_parent; }
            Py_INCREF(block);
            named = PyDict_GetItemWithError(known, ext);
            if (named != block) {
                PyObject *r;
                if (named == NULL && PyErr_Occurred()) goto fail_parent;
                r = PyObject_CallFunctionObjArgs(add_alias, rank, block, slot, ext, NULL);
                if (r == NULL) goto fail_parent;
                Py_DECREF(r);
            }
        }
        old = PyDict_GetItemWithError(held, ext);
        if (old == block) {
            dups += 1;
        } else {
            Py_ssize_t total;
            if (old == NULL && PyErr_Occurred()) goto fail_parent;
            Py_XINCREF(old); /* held's reference goes with the next line */
            if (PyDict_SetItem(held, ext, block) < 0 || add_to(block, B_TOTAL, 1, &total) < 0) {
                Py_XDECREF(old);
                goto fail_parent;
            }
            if (old != NULL) { /* the hash named other content: released after ``block`` took
                                * its holding (see the Python loop) */
                PyObject *r = PyObject_CallFunctionObjArgs(release, rank, old, group, medium,
                                                           NULL);
                Py_DECREF(old);
                if (r == NULL) goto fail_parent;
                Py_DECREF(r);
            }
            if (total == 1) {
                PyObject *wire = PyList_GET_ITEM(block, B_WIRE);
                Py_ssize_t nout = PyList_GET_SIZE(out);
                visible += 1;
                if (run_end == i && run != NULL && nout > 0
                    && PyList_GET_ITEM(out, nout - 1) == run) {
                    if (PyList_Append(run_hashes, wire) < 0) goto fail_parent;
                } else {
                    PyObject *pw = parent == Py_None ? parent_wire
                                                     : PyList_GET_ITEM(parent, B_WIRE);
                    PyObject *ev = stored_run(wire, pw, bs_obj, lora_id, medium, lora_name);
                    if (ev == NULL) goto fail_parent;
                    if (PyList_Append(out, ev) < 0 || PyList_Append(runs, ev) < 0) {
                        Py_DECREF(ev);
                        goto fail_parent;
                    }
                    Py_DECREF(ev); /* ``runs`` keeps it alive */
                    run = ev;
                    run_hashes = PyDict_GetItemWithError(ev, K_block_hashes);
                    if (run_hashes == NULL) goto fail_parent;
                    firsts[nruns++] = i;
                }
                run_end = i + 1;
            }
        }
        Py_SETREF(parent, block); /* the next block's parent; ``block`` is owned by it now */
        block = NULL;
    }
    Py_DECREF(parent);

    /* Each run carries its blocks' tokens: the whole chain without a copy, else a slice. */
    for (i = 0; i < nruns; i++) {
        PyObject *ev = PyList_GET_ITEM(runs, i), *ids;
        Py_ssize_t count = PyList_GET_SIZE(PyDict_GetItem(ev, K_block_hashes)), first = firsts[i];
        int rc;
        run_blocks += count;
        if (first == 0 && count == n) {
            ids = tokens;
            Py_INCREF(ids);
        } else {
            ids = PyList_GetSlice(tokens, first * bs, (first + count) * bs);
            if (ids == NULL) goto fail;
        }
        rc = PyDict_SetItem(ev, K_token_ids, ids);
        Py_DECREF(ids);
        if (rc < 0) goto fail;
    }
    result = Py_BuildValue("nnnn", visible, dups, nruns, run_blocks);
    goto done;
fail_parent:
    Py_XDECREF(block);
    Py_DECREF(parent);
fail:
    result = NULL;
done:
    Py_XDECREF(idents);
    Py_XDECREF(runs);
    PyMem_Free(firsts);
    return result;
}

static PyObject *store_chain(PyObject *module, PyObject *args) {
    PyObject *rank, *blocks, *known, *held, *published, *out, *hashes, *tokens, *bs_obj;
    PyObject *parent, *pident, *parent_wire, *slot, *lora_id, *lora_name, *medium, *group;
    PyObject *fresh_pub, *add_alias, *release;

    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!O!O!O!OOOOOOOOOOO", &rank, &PyDict_Type,
                          &blocks, &PyDict_Type, &known, &PyDict_Type, &held, &PyDict_Type,
                          &published, &PyList_Type, &out, &PyList_Type, &hashes,
                          &PyList_Type, &tokens, &PyLong_Type, &bs_obj,
                          &parent, &pident, &parent_wire, &slot, &lora_id, &lora_name,
                          &medium, &group, &fresh_pub, &add_alias, &release))
        return NULL;
    int mutated = 0;
    return chain(rank, blocks, known, held, published, out, hashes, tokens, bs_obj, parent,
                 pident, parent_wire, slot, lora_id, lora_name, medium, group, fresh_pub,
                 add_alias, release, &mutated);
}

/* Set once by consolidator_core.py (core_constants): its _ROOT, _UNKNOWN_PARENT, len(MEDIA),
 * MEDIUM_GPU and the rank attribute names. */
static PyObject *C_root, *C_unknown_parent, *C_gpu, *C_zero;
static Py_ssize_t C_media;
static PyObject *K_blocks_attr, *K_known_attr, *K_held_attr, *K_published_attr, *K_out_attr;

PyDoc_STRVAR(core_constants_doc,
"core_constants(root, unknown_parent, num_media, medium_gpu)\n\n"
"The consolidator's constants, set once at import (apply_events needs them).");

static PyObject *core_constants(PyObject *module, PyObject *args) {
    PyObject *root, *unknown, *gpu;
    Py_ssize_t media;
    if (!PyArg_ParseTuple(args, "O!O!nU", &PyLong_Type, &root, &PyLong_Type, &unknown, &media,
                          &gpu))
        return NULL;
    Py_INCREF(root);
    Py_XSETREF(C_root, root);
    Py_INCREF(unknown);
    Py_XSETREF(C_unknown_parent, unknown);
    Py_INCREF(gpu);
    Py_XSETREF(C_gpu, gpu);
    C_media = media;
    Py_RETURN_NONE;
}

/* raw.get(key) (borrowed, NULL when absent) for an exact dict; -1 on error. */
static int field(PyObject *raw, PyObject *key, PyObject **out) {
    *out = PyDict_GetItemWithError(raw, key);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* u64 form of an exact int (new reference), as ``value & (2**64 - 1)``; the int itself when it
 * already is one. */
static PyObject *u64_of(PyObject *h) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(h, &overflow);
    unsigned long long u;
    if (overflow == 0 && v >= 0) {
        Py_INCREF(h);
        return h;
    }
    if (v == -1 && overflow == 0 && PyErr_Occurred()) return NULL;
    u = PyLong_AsUnsignedLongLongMask(h);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLongLong(u);
}

static PyObject *u64_hashes(PyObject *module, PyObject *values);

/* Counter deltas of the compiled event paths, in ConsolidatorCore._add_counts' order. */
enum { N_STORES_IN, N_STORE_BLOCKS_IN, N_UNKNOWN_PARENTS, N_DUPLICATES, N_STORES_OUT,
       N_STORE_BLOCKS_OUT, N_REMOVES_IN, N_REMOVE_BLOCKS_IN, N_UNKNOWN_REMOVES, N_REMOVES_OUT,
       N_REMOVE_BLOCKS_OUT, N_VISIBLE, N_COUNTS };

static PyObject *K_last_remove_attr, *K_hidden_attr;

/* 1 when the rank holds a block back in dedup group 0 (rank.hidden[0] non-empty): prefix
 * closure is then decided by the Python code, event by event; 0 when empty; -1 on error. */
static int holds_back(PyObject *rank) {
    PyObject *hidden = PyObject_GetAttr(rank, K_hidden_attr), *group;
    int r;
    if (hidden == NULL) return -1;
    if (!PyList_CheckExact(hidden) || PyList_GET_SIZE(hidden) < 1
        || !PyDict_CheckExact(group = PyList_GET_ITEM(hidden, 0))) {
        Py_DECREF(hidden);
        PyErr_SetString(PyExc_TypeError, "consolidator rank.hidden is not a list of dicts");
        return -1;
    }
    r = PyDict_GET_SIZE(group) > 0;
    Py_DECREF(hidden);
    return r;
}

static PyObject *counts_tuple(const Py_ssize_t *cnt) {
    PyObject *t = PyTuple_New(N_COUNTS);
    int k;
    if (t == NULL) return NULL;
    for (k = 0; k < N_COUNTS; k++) {
        PyObject *v = PyLong_FromSsize_t(cnt[k]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, k, v);
    }
    return t;
}

/* The tier index of a medium spelling the Python code has seen (its cache), or LEAVE. */
static int cached_tier(PyObject *cache, PyObject *medium, Py_ssize_t *tier) {
    PyObject *v;
    /* Only None or an exact str is looked up: another object's __hash__ / __eq__ would run
     * Python code while the event's fields are held borrowed. */
    if (medium != NULL && medium != Py_None && !PyUnicode_CheckExact(medium)) return LEAVE;
    v = PyDict_GetItemWithError(cache, medium == NULL ? Py_None : medium);
    if (v == NULL) {
        if (!PyErr_Occurred()) return LEAVE;
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) return FAIL;
        PyErr_Clear(); /* an unhashable medium: the Python code names it */
        return LEAVE;
    }
    *tier = PyLong_AsSsize_t(v);
    return (*tier == -1 && PyErr_Occurred()) ? FAIL : TAKE;
}

/* rank.<name>[index] (borrowed; the rank keeps its lists alive), checked to be a dict. */
static PyObject *slot_map(PyObject *list, Py_ssize_t index) {
    PyObject *m;
    if (!PyList_CheckExact(list) || index < 0 || index >= PyList_GET_SIZE(list)) {
        PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        return NULL;
    }
    m = PyList_GET_ITEM(list, index);
    if (!PyDict_CheckExact(m)) {
        PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        return NULL;
    }
    return m;
}

/* The slot an event's medium names (through the Python code's medium cache) and its hashes in
 * u64 form (new list), or LEAVE: a medium spelling not seen yet, a hash that is not an int. */
static int event_slot_hashes(PyObject *raw_hashes, PyObject *medium, PyObject *source,
                             PyObject *cache, Py_ssize_t *slot_index, PyObject **hashes) {
    Py_ssize_t tier;
    int r;
    if ((r = cached_tier(cache, medium, &tier)) != TAKE) return r;
    *slot_index = PyLong_AsSsize_t(source) * C_media + tier;
    if (PyErr_Occurred()) return FAIL;
    *hashes = u64_hashes(NULL, raw_hashes);
    if (*hashes == NULL) return FAIL;
    if (*hashes == Py_None) {
        Py_CLEAR(*hashes);
        return LEAVE;
    }
    return TAKE;
}

/* ConsolidatorCore._stored + _store_chain for one BlockStored map (dedup), or LEAVE with
 * nothing changed. */
static int stored_one(PyObject *rank, PyObject *raw, PyObject *source, PyObject *cache,
                      PyObject *fresh_pub, PyObject *add_alias, PyObject *release,
                      Py_ssize_t *cnt) {
    PyObject *raw_hashes, *raw_parent, *bs_obj, *tokens, *medium, *lora_id, *lora_name;
    PyObject *hashes = NULL, *parent_ext = NULL, *slot = NULL, *blocks = NULL, *known = NULL;
    PyObject *held = NULL, *published = NULL, *out = NULL, *parent = Py_None, *pident = NULL;
    PyObject *parent_wire = NULL, *counts = NULL, *known_slot, *held_slot;
    Py_ssize_t bs, n, slot_index, unknown_parents = 0, run_info[4];
    int r = FAIL, mutated = 0;

    if (C_root == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "consolidator: core_constants() was not called");
        return FAIL;
    }
    if (field(raw, K_block_hashes, &raw_hashes) < 0
        || field(raw, K_parent_block_hash, &raw_parent) < 0
        || field(raw, K_block_size, &bs_obj) < 0 || field(raw, K_token_ids, &tokens) < 0
        || field(raw, K_medium, &medium) < 0 || field(raw, K_lora_id, &lora_id) < 0
        || field(raw, K_lora_name, &lora_name) < 0)
        return FAIL;
    /* The shapes the Python code accepts without a decision; anything else is left to it. */
    if (raw_hashes == NULL || !PyList_CheckExact(raw_hashes) || bs_obj == NULL
        || !PyLong_CheckExact(bs_obj) || tokens == NULL || !PyList_CheckExact(tokens)
        || (raw_parent != NULL && raw_parent != Py_None && !PyLong_CheckExact(raw_parent)))
        return LEAVE;
    bs = PyLong_AsSsize_t(bs_obj);
    if (bs == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return LEAVE;
    }
    n = PyList_GET_SIZE(raw_hashes);
    /* n * bs must not overflow (a huge block_size would wrap to a small count). */
    if (bs <= 0 || n == 0 || bs > PY_SSIZE_T_MAX / n || PyList_GET_SIZE(tokens) != n * bs)
        return LEAVE;
    /* Tokens that are not u32 exact ints are left to the Python code by chain()'s first pass
     * (before anything changed). */
    if (lora_id != NULL && lora_id != Py_None
        && !(PyLong_CheckExact(lora_id) && int_in_range(lora_id, ULLONG_MAX)))
        return LEAVE;
    if (lora_name != NULL && lora_name != Py_None && !PyUnicode_CheckExact(lora_name))
        return LEAVE;
    if ((r = event_slot_hashes(raw_hashes, medium, source, cache, &slot_index, &hashes)) != TAKE)
        return r;
    r = FAIL;
    if (lora_id == NULL) lora_id = Py_None;
    if (lora_name == NULL) lora_name = Py_None;
    {
        /* A LoRA id or extra keys are part of the identity: the Python code decides. */
        PyObject *extra;
        int truthy;
        if (field(raw, K_extra_keys, &extra) < 0) goto done;
        if (extra != NULL && extra != Py_None) { r = LEAVE; goto done; }
        truthy = lora_id == Py_None ? 0 : PyObject_IsTrue(lora_id);
        if (truthy < 0) goto done;
        if (truthy) { r = LEAVE; goto done; }
    }
    slot = PyLong_FromSsize_t(slot_index);
    blocks = PyObject_GetAttr(rank, K_blocks_attr);
    known = PyObject_GetAttr(rank, K_known_attr);
    held = PyObject_GetAttr(rank, K_held_attr);
    published = PyObject_GetAttr(rank, K_published_attr);
    out = PyObject_GetAttr(rank, K_out_attr);
    if (slot == NULL || blocks == NULL || known == NULL || held == NULL || published == NULL
        || out == NULL)
        goto done;
    known_slot = slot_map(known, slot_index);
    held_slot = known_slot == NULL ? NULL : slot_map(held, slot_index);
    if (held_slot == NULL) goto done;
    if (!PyDict_CheckExact(blocks) || !PyDict_CheckExact(published) || !PyList_CheckExact(out)) {
        PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        goto done;
    }
    /* The parent: its block when a slot knows the hash (this slot first) and it is published;
     * anything else (unknown, or not published) is held back by the Python code. */
    if (raw_parent == NULL || raw_parent == Py_None) {
        Py_INCREF(C_root);
        pident = C_root;
        Py_INCREF(Py_None);
        parent_wire = Py_None;
    } else {
        Py_ssize_t j, nslots = PyList_GET_SIZE(known);
        PyObject *found;
        parent_ext = u64_of(raw_parent);
        if (parent_ext == NULL) goto done;
        found = PyDict_GetItemWithError(known_slot, parent_ext);
        for (j = 0; found == NULL && !PyErr_Occurred() && j < nslots; j++) {
            PyObject *m = slot_map(known, j);
            if (m == NULL) goto done;
            found = PyDict_GetItemWithError(m, parent_ext);
        }
        if (found == NULL && PyErr_Occurred()) goto done;
        if (found != NULL) {
            Py_ssize_t parent_total;
            if (!is_block(found) || int_field(found, B_TOTAL, &parent_total) < 0) goto done;
            if (parent_total == 0) { /* not published: the Python code holds the store back */
                r = LEAVE;
                goto done;
            }
            parent = found;
            pident = PyList_GET_ITEM(found, B_IDENT);
            Py_INCREF(pident);
            parent_wire = PyList_GET_ITEM(found, B_WIRE);
            Py_INCREF(parent_wire);
        } else {
            /* A parent no source knows: the store is held back, by the Python code. */
            r = LEAVE;
            goto done;
        }
    }
    counts = chain(rank, blocks, known_slot, held_slot, published, out, hashes, tokens, bs_obj,
                   parent, pident, parent_wire, slot, lora_id, lora_name, C_gpu, C_zero,
                   fresh_pub, add_alias, release, &mutated);
    if (counts == Py_None) { /* a hash released mid-chain: the Python code decides */
        r = LEAVE;
        goto done;
    }
    if (counts == NULL) {
        /* A token that is not a u32 int fails the identity pass, before anything changed:
         * the Python code refuses the event, naming it. */
        if (!mutated && PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            r = LEAVE;
        }
        goto done;
    }
    if (!PyArg_ParseTuple(counts, "nnnn", &run_info[0], &run_info[1], &run_info[2],
                          &run_info[3]))
        goto done;
    cnt[N_STORES_IN] += 1;
    cnt[N_STORE_BLOCKS_IN] += n;
    cnt[N_UNKNOWN_PARENTS] += unknown_parents;
    cnt[N_VISIBLE] += run_info[0];
    cnt[N_DUPLICATES] += run_info[1];
    if (run_info[2]) {
        cnt[N_STORES_OUT] += run_info[2];
        cnt[N_STORE_BLOCKS_OUT] += run_info[3];
        if (PyObject_SetAttr(rank, K_last_remove_attr, Py_None) < 0) goto done;
    }
    r = TAKE;
done:
    Py_XDECREF(counts);
    Py_XDECREF(hashes);
    Py_XDECREF(parent_ext);
    Py_XDECREF(slot);
    Py_XDECREF(blocks);
    Py_XDECREF(known);
    Py_XDECREF(held);
    Py_XDECREF(published);
    Py_XDECREF(out);
    Py_XDECREF(pident);
    Py_XDECREF(parent_wire);
    return r;
}

static PyObject *remove_loop(PyObject *blocks, PyObject *known, PyObject *held,
                             PyObject *published, PyObject *hashes, Py_ssize_t *unknown);

/* 1 when removing ``hashes`` from the slot ``held`` would leave a block resident nowhere while
 * it still has live children (a parent removed before its descendants: the Python code
 * cascades the removal), 0 when not, -1 on error. Read-only. */
static int would_cascade(PyObject *held, PyObject *hashes) {
    Py_ssize_t i, n = PyList_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        PyObject *block = PyDict_GetItemWithError(held, PyList_GET_ITEM(hashes, i));
        Py_ssize_t total, children;
        if (block == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        if (!is_block(block) || int_field(block, B_TOTAL, &total) < 0
            || int_field(block, B_CHILDREN, &children) < 0)
            return -1;
        if (total <= 1 && children > 0) return 1;
    }
    return 0;
}

/* ConsolidatorCore._removed (dedup) + _emit_removes for one BlockRemoved map, or LEAVE. */
static int removed_one(PyObject *rank, PyObject *raw, PyObject *source, PyObject *cache,
                       Py_ssize_t *cnt) {
    PyObject *raw_hashes, *medium, *hashes = NULL, *blocks = NULL, *known = NULL, *held = NULL;
    PyObject *published = NULL, *out = NULL, *last = NULL, *wires = NULL, *held_slot;
    Py_ssize_t slot_index, unknown = 0, nw;
    int r;

    if (field(raw, K_block_hashes, &raw_hashes) < 0 || field(raw, K_medium, &medium) < 0)
        return FAIL;
    if (raw_hashes == NULL || !PyList_CheckExact(raw_hashes)) return LEAVE;
    if ((r = event_slot_hashes(raw_hashes, medium, source, cache, &slot_index, &hashes)) != TAKE)
        return r;
    r = FAIL;
    blocks = PyObject_GetAttr(rank, K_blocks_attr);
    known = PyObject_GetAttr(rank, K_known_attr);
    held = PyObject_GetAttr(rank, K_held_attr);
    published = PyObject_GetAttr(rank, K_published_attr);
    out = PyObject_GetAttr(rank, K_out_attr);
    last = PyObject_GetAttr(rank, K_last_remove_attr);
    if (blocks == NULL || known == NULL || held == NULL || published == NULL || out == NULL
        || last == NULL)
        goto done;
    held_slot = slot_map(held, slot_index);
    if (held_slot == NULL) goto done;
    if (!PyDict_CheckExact(blocks) || !PyList_CheckExact(known)
        || !PyDict_CheckExact(published) || !PyList_CheckExact(out)) {
        PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        goto done;
    }
    {
        int cascade = would_cascade(held_slot, hashes);
        if (cascade < 0) goto done;
        if (cascade) {
            r = LEAVE;
            goto done;
        }
    }
    cnt[N_REMOVES_IN] += 1;
    cnt[N_REMOVE_BLOCKS_IN] += PyList_GET_SIZE(hashes);
    wires = remove_loop(blocks, known, held_slot, published, hashes, &unknown);
    if (wires == NULL) goto done;
    cnt[N_UNKNOWN_REMOVES] += unknown;
    nw = PyList_GET_SIZE(wires);
    if (nw) {
        /* _emit_removes: extend the BlockRemoved being built, else start one. */
        Py_ssize_t nout = PyList_GET_SIZE(out);
        PyObject *last_medium = NULL;
        cnt[N_VISIBLE] -= nw;
        cnt[N_REMOVE_BLOCKS_OUT] += nw;
        if (last != Py_None && nout > 0 && PyList_GET_ITEM(out, nout - 1) == last
            && PyDict_CheckExact(last)) {
            last_medium = PyDict_GetItemWithError(last, K_medium);
            if (last_medium == NULL && PyErr_Occurred()) goto done;
        }
        if (last_medium != NULL && str_is(last_medium, C_gpu)) {
            PyObject *lh = PyDict_GetItemWithError(last, K_block_hashes);
            if (lh == NULL || !PyList_CheckExact(lh)) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "BlockRemoved map lost its list");
                goto done;
            }
            if (list_extend(lh, wires) < 0) goto done;
        } else {
            PyObject *ev = removed_map(wires, C_gpu);
            if (ev == NULL || PyList_Append(out, ev) < 0
                || PyObject_SetAttr(rank, K_last_remove_attr, ev) < 0) {
                Py_XDECREF(ev);
                goto done;
            }
            Py_DECREF(ev);
            cnt[N_REMOVES_OUT] += 1;
        }
    }
    r = TAKE;
done:
    Py_XDECREF(wires);
    Py_XDECREF(hashes);
    Py_XDECREF(blocks);
    Py_XDECREF(known);
    Py_XDECREF(held);
    Py_XDECREF(published);
    Py_XDECREF(out);
    Py_XDECREF(last);
    return r;
}

PyDoc_STRVAR(apply_events_doc,
"apply_events(rank, events, start, source, medium_cache, fresh_pub, add_alias, release)\n"
"    -> (stop, counts, error)\n\n"
"ConsolidatorCore.apply_event for events[start:] (dedup mode) until the first event the\n"
"Python code must decide (stop is its index; len(events) when all were taken). ``error``:\n"
"None, or the exception that event stop raised part-way (a bug, not bad input); that event\n"
"then counts as consumed. ``counts``: the counter deltas of every event taken.");

static PyObject *apply_events(PyObject *module, PyObject *args) {
    PyObject *rank, *events, *source, *cache, *fresh_pub, *add_alias, *release;
    PyObject *counts, *error = Py_None;
    Py_ssize_t start, i, n, cnt[N_COUNTS] = {0};

    if (!PyArg_ParseTuple(args, "OO!nO!O!OOO", &rank, &PyList_Type, &events, &start,
                          &PyLong_Type, &source, &PyDict_Type, &cache, &fresh_pub, &add_alias,
                          &release))
        return NULL;
    n = PyList_GET_SIZE(events);
    for (i = start < 0 ? 0 : start; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i), *kind;
        int r;
        /* Only maps whose keys are all exact str: a lookup in any other could run a key's
         * __eq__, which could change the map or the list under us. */
        if (!PyDict_CheckExact(ev) || !str_keys_only(ev)) break;
        Py_INCREF(ev); /* a callback (release ...) could in theory change the list */
        kind = PyDict_GetItemWithError(ev, K_type);
        if (kind == NULL) {
            Py_DECREF(ev);
            if (PyErr_Occurred()) goto failed;
            break;
        }
        {
            int back = holds_back(rank);
            if (back != 0) {
                Py_DECREF(ev);
                if (back < 0) goto failed;
                break; /* a block is held back: the Python code decides from here */
            }
        }
        if (str_is(kind, S_BlockStored))
            r = stored_one(rank, ev, source, cache, fresh_pub, add_alias, release, cnt);
        else if (str_is(kind, S_BlockRemoved))
            r = removed_one(rank, ev, source, cache, cnt);
        else
            r = LEAVE;
        Py_DECREF(ev);
        if (r == LEAVE) break;
        if (r == FAIL) goto failed;
        n = PyList_GET_SIZE(events);
    }
    counts = counts_tuple(cnt);
    if (counts == NULL) return NULL;
    return Py_BuildValue("nNO", i, counts, error);
failed:
    {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        if (value == NULL) {
            Py_INCREF(Py_None);
            value = Py_None;
        }
        counts = counts_tuple(cnt);
        if (counts == NULL) {
            Py_DECREF(value);
            return NULL;
        }
        return Py_BuildValue("nNN", i, counts, value);
    }
}

/* known[slot].get(ext) is block -> del known[slot][ext] */
static int forget_alias(PyObject *known, PyObject *slot, PyObject *ext, PyObject *block) {
    Py_ssize_t index = PyLong_AsSsize_t(slot);
    PyObject *slot_map, *named;
    if (index == -1 && PyErr_Occurred()) return -1;
    if (index < 0 || index >= PyList_GET_SIZE(known)) {
        PyErr_Format(PyExc_IndexError, "consolidator slot %zd out of range", index);
        return -1;
    }
    slot_map = PyList_GET_ITEM(known, index);
    if (!PyDict_CheckExact(slot_map)) {
        PyErr_SetString(PyExc_TypeError, "consolidator known[slot] is not a dict");
        return -1;
    }
    named = PyDict_GetItemWithError(slot_map, ext);
    if (named == NULL) return PyErr_Occurred() ? -1 : 0;
    return named == block ? PyDict_DelItem(slot_map, ext) : 0;
}

/* The dedup block loop of _removed: the signed hashes now resident nowhere (new list). */
static PyObject *remove_loop(PyObject *blocks, PyObject *known, PyObject *held,
                             PyObject *published, PyObject *hashes, Py_ssize_t *unknown_out) {
    PyObject *wires, *block = NULL;
    Py_ssize_t i, n, unknown = 0;

    wires = PyList_New(0);
    if (wires == NULL) return NULL;
    n = PyList_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        PyObject *ext = PyList_GET_ITEM(hashes, i);
        Py_ssize_t total;
        block = PyDict_GetItemWithError(held, ext);
        if (block == NULL) {
            if (PyErr_Occurred()) goto fail;
            unknown += 1;
            continue;
        }
        Py_INCREF(block); /* owned: the dicts below may drop every other reference */
        if (PyDict_DelItem(held, ext) < 0 || !is_block(block)
            || add_to(block, B_TOTAL, -1, &total) < 0)
            goto fail_block;
        if (total) {
            Py_DECREF(block);
            continue;
        }
        if (PyList_Append(wires, PyList_GET_ITEM(block, B_WIRE)) < 0) goto fail_block;
        for (;;) { /* resident nowhere and no child: forget it, then maybe its parent */
            PyObject *more, *parent, *pub, *named;
            Py_ssize_t children, parent_total;
            if (int_field(block, B_CHILDREN, &children) < 0) goto fail_block;
            if (children) break;
            if (PyDict_DelItem(blocks, PyList_GET_ITEM(block, B_IDENT)) < 0
                || forget_alias(known, PyList_GET_ITEM(block, B_ALIAS_SLOT),
                                PyList_GET_ITEM(block, B_ALIAS_EXT), block) < 0)
                goto fail_block;
            more = PyList_GET_ITEM(block, B_MORE_ALIASES);
            if (more != Py_None) {
                Py_ssize_t j;
                if (!PyList_CheckExact(more)) {
                    PyErr_SetString(PyExc_TypeError, "consolidator aliases are not a list");
                    goto fail_block;
                }
                for (j = 0; j < PyList_GET_SIZE(more); j++) {
                    PyObject *alias = PyList_GET_ITEM(more, j);
                    if (!PyTuple_CheckExact(alias) || PyTuple_GET_SIZE(alias) != 2) {
                        PyErr_SetString(PyExc_TypeError, "consolidator alias is not a pair");
                        goto fail_block;
                    }
                    if (forget_alias(known, PyTuple_GET_ITEM(alias, 0),
                                     PyTuple_GET_ITEM(alias, 1), block) < 0)
                        goto fail_block;
                }
            }
            pub = PyList_GET_ITEM(block, B_PUB);
            named = PyDict_GetItemWithError(published, pub);
            if (named == NULL && PyErr_Occurred()) goto fail_block;
            if (named == block && PyDict_DelItem(published, pub) < 0) goto fail_block;
            parent = PyList_GET_ITEM(block, B_PARENT);
            if (parent == Py_None) break;
            if (!is_block(parent) || add_to(parent, B_CHILDREN, -1, NULL) < 0
                || int_field(parent, B_TOTAL, &parent_total) < 0)
                goto fail_block;
            if (parent_total) break;
            Py_INCREF(parent);
            Py_SETREF(block, parent);
        }
        Py_DECREF(block);
    }
    *unknown_out = unknown;
    return wires;
fail_block:
    Py_DECREF(block);
fail:
    Py_DECREF(wires);
    return NULL;
}

PyDoc_STRVAR(remove_dedup_doc,
"remove_dedup(blocks, known, held, published, hashes) -> (wires, unknown) | None\n\n"
"The dedup block loop of ConsolidatorCore._removed on the same structures: the published\n"
"(signed) hashes that are now resident nowhere, and how many hashes the slot did not hold;\n"
"None (nothing changed) when a block would go while it has live children (a cascade).");

static PyObject *remove_dedup(PyObject *module, PyObject *args) {
    PyObject *blocks, *known, *held, *published, *hashes, *wires;
    Py_ssize_t unknown = 0;

    if (!PyArg_ParseTuple(args, "O!O!O!O!O!", &PyDict_Type, &blocks, &PyList_Type, &known,
                          &PyDict_Type, &held, &PyDict_Type, &published, &PyList_Type, &hashes))
        return NULL;
    switch (would_cascade(held, hashes)) {
    case -1: return NULL;
    case 1: Py_RETURN_NONE; /* the Python loop cascades the removal */
    default: break;
    }
    wires = remove_loop(blocks, known, held, published, hashes, &unknown);
    if (wires == NULL) return NULL;
    return Py_BuildValue("Nn", wires, unknown);
}

PyDoc_STRVAR(u64_hashes_doc,
"u64_hashes(values: list) -> list | None\n\n"
"``[h & (2**64 - 1) for h in values]`` when every item is an exact int (ConsolidatorCore's\n"
"_hashes); None when one is not, for the Python code to name it in its error.");

static PyObject *u64_hashes(PyObject *module, PyObject *values) {
    PyObject *out;
    Py_ssize_t i, n;
    if (!PyList_CheckExact(values)) {
        PyErr_SetString(PyExc_TypeError, "u64_hashes: expected a list");
        return NULL;
    }
    n = PyList_GET_SIZE(values);
    out = PyList_New(n);
    if (out == NULL) return NULL;
    for (i = 0; i < n; i++) {
        PyObject *h = PyList_GET_ITEM(values, i), *u64;
        if (!PyLong_CheckExact(h)) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        u64 = u64_of(h);
        if (u64 == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, u64);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"store_chain", store_chain, METH_VARARGS, store_chain_doc},
    {"remove_dedup", remove_dedup, METH_VARARGS, remove_dedup_doc},
    {"u64_hashes", u64_hashes, METH_O, u64_hashes_doc},
    {"apply_events", apply_events, METH_VARARGS, apply_events_doc},
    {"core_constants", core_constants, METH_VARARGS, core_constants_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbm_plugin.consolidator._core_c",
    "Compiled dedup loops of ConsolidatorCore (optional; consolidator_core.py holds the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__core_c(void) {
    if (intern_wire_keys() < 0) return NULL;
    INTERN(K_blocks_attr, "blocks");
    INTERN(K_known_attr, "known");
    INTERN(K_held_attr, "held");
    INTERN(K_published_attr, "published");
    INTERN(K_out_attr, "out");
    INTERN(K_last_remove_attr, "last_remove");
    INTERN(K_hidden_attr, "hidden");
    if ((C_zero = PyLong_FromLong(0)) == NULL) return NULL;
    return PyModule_Create(&module_def);
}
