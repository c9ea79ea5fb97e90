/* Compiled loops of consolidator/core.py: ConsolidatorCore in dedup mode (module
 * kvbm_plugin.consolidator._core_c; its removal loops are in _core_remove.c).
 *
 * Kept for the consolidator's ingest targets (>= 0.5x of a bare SUB + decode, >= 300k
 * block-events/s: the Python loops reach about 0.25x and 300k; docs/performance.md, "What each
 * compiled loop is for").
 *
 * The per-block loops of the dedup core: a chain of stored blocks (_store_chain), a removal
 * (_removed), and a whole batch's common events (apply_events). They work on the core's own
 * Python structures (the rank's dicts and the blocks: compiled Blocks of _core_block.c, whose
 * items B_* in _core_c.h are consolidator/blocks.py's IDENT ...), so the Python code and these
 * take turns on one state. The rare branches call back into the Python core (a derived
 * published hash, a second alias, a release of the hash's previous block, the rest of a
 * removal that cascades). They
 * run whatever is held back: an event touching a held-back block (or the parent one waits
 * for) is the Python code's. Called on the consolidator's ingest thread only, with the GIL
 * held throughout.
 *
 * Input events are read only through lookups that run no Python code: an event map whose keys
 * are not all exact str, a medium that is not an exact str, a token that is not an exact int
 * (its __hash__ / __eq__ could change or free what is held borrowed) is left to the Python
 * code, as is anything it refuses (a token id outside u32, a lora_id other than None or a u64,
 * a lora_name other than None or a str, a token count that does not fit the arithmetic).
 */

#include "_core_c.h"

/* Signed int64 form of a u64 published hash (new reference): ``pub`` itself when it is not
 * above INT64_MAX, as the Python loop's ``pub - U64 if pub > I64_MAX else pub`` (one int
 * object per block instead of two). */
static PyObject *wire_of(PyObject *pub) {
    unsigned long long u = PyLong_AsUnsignedLongLong(pub);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (u <= (unsigned long long)LLONG_MAX) {
        Py_INCREF(pub);
        return pub;
    }
    return PyLong_FromLongLong((long long)u);
}

static PyObject *new_block(PyObject *ident, PyObject *pub, PyObject *parent, PyObject *slot,
                           PyObject *ext) {
    PyObject *wire, *block;
    long slot_index = PyLong_AsLong(slot);
    if (slot_index == -1 && PyErr_Occurred()) return NULL;
    wire = wire_of(pub);
    if (wire == NULL) return NULL;
    block = new_dedup_block(ident, pub, wire, parent, (int)slot_index, ext);
    Py_DECREF(wire);
    /* A block refers only to older blocks (its parent) and to ints: never part of a cycle,
     * and not a collector type (see _core_block.c). */
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
"store_chain(rank, blocks, known, held, unlisted, out, hashes, tokens, block_size,\n"
"            parent, pident, parent_wire, slot, lora_id, lora_name, medium, group,\n"
"            fresh_pub, add_alias, release, held_back)\n"
"    -> (visible, duplicates, runs, run_blocks) | None\n\n"
"The block loop of ConsolidatorCore._store_chain in dedup mode, on the same structures\n"
"(``held_back``: the rank's HeldBack of group 0).\n"
"Identities are computed first (a token that is not a u32 int raises TypeError before\n"
"anything changed). None, with nothing changed, when a hash of the chain would release\n"
"another block, or a block of the chain is held back or waited for by a held-back one.");

/* The chain loop shared by store_chain and stored_one (arguments as store_chain's, and
 * ``known_list``: every slot's known map, rank.known, for blocks.pub_taken). */
static PyObject *chain(PyObject *rank, PyObject *blocks, PyObject *known_list,
                       PyObject *known, PyObject *held,
                       PyObject *unlisted, PyObject *out, PyObject *hashes, PyObject *tokens,
                       PyObject *bs_obj, PyObject *parent, PyObject *pident,
                       PyObject *parent_wire, PyObject *slot, PyObject *lora_id,
                       PyObject *lora_name, PyObject *medium, PyObject *group,
                       PyObject *fresh_pub, PyObject *add_alias, PyObject *release,
                       PyObject *hidden, PyObject *waiting, int *mutated) {
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
     * chain, releases a block mid-chain (a source reusing one hash); a block of the chain that
     * is held back, or that a held-back block waits for, is published or released through the
     * prefix-closure code. Such a chain is left to the Python loop (None). */
    {
        PyObject *seen = n > 1 ? PySet_New(NULL) : NULL;
        int leave = 0, any_back = PyDict_GET_SIZE(hidden) > 0;
        if (n > 1 && seen == NULL) goto fail;
        for (i = 0; i < n && !leave; i++) {
            PyObject *ext = PyList_GET_ITEM(hashes, i), *old, *mine;
            if (any_back) { /* a new block is neither held back nor waited for */
                PyObject *ident = PyList_GET_ITEM(idents, i);
                PyObject *existing = PyDict_GetItemWithError(blocks, ident);
                int back = 0;
                if (existing == NULL && PyErr_Occurred()) { Py_XDECREF(seen); goto fail; }
                if (existing != NULL) {
                    back = is_block(existing) ? is_held_back(existing) : -1;
                    if (back == 0 && PyDict_GET_SIZE(waiting) > 0)
                        back = PyDict_Contains(waiting, ident);
                }
                if (back < 0) { Py_XDECREF(seen); goto fail; }
                if (back) { leave = 1; break; }
            }
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
            taken = pub_taken(known_list, unlisted, ext);
            if (taken < 0) goto fail_parent;
            pub = taken ? PyObject_CallFunctionObjArgs(fresh_pub, rank, ext, ident, NULL)
                        : (Py_INCREF(ext), ext);
            if (pub == NULL) goto fail_parent;
            block = new_block(ident, pub, parent, slot, ext);
            /* A derived hash is listed (no known map names the block by it); a block this
             * slot named by its published hash before is listed from now on. */
            if (block == NULL || (pub != ext && PyDict_SetItem(unlisted, pub, block) < 0)
                || PyDict_SetItem(blocks, ident, block) < 0
                || list_overwritten(known, unlisted, ext) < 0
                || PyDict_SetItem(known, ext, block) < 0
                || (parent != Py_None && (add_to(parent, B_CHILDREN, 1, NULL) < 0
                                          || add_kid(parent, ident) < 0))) {
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
                PyObject *wire = BLOCK(block)->wire;
                Py_ssize_t nout = PyList_GET_SIZE(out);
                visible += 1;
                if (run_end == i && run != NULL && nout > 0
                    && PyList_GET_ITEM(out, nout - 1) == run) {
                    if (PyList_Append(run_hashes, wire) < 0) goto fail_parent;
                } else {
                    PyObject *pw = parent == Py_None ? parent_wire
                                                     : BLOCK(parent)->wire;
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
    PyObject *rank, *blocks, *known, *held, *unlisted, *out, *hashes, *tokens, *bs_obj;
    PyObject *parent, *pident, *parent_wire, *slot, *lora_id, *lora_name, *medium, *group;
    PyObject *fresh_pub, *add_alias, *release, *held_back, *hidden, *waiting, *known_list;
    PyObject *result;

    if (!PyArg_ParseTuple(args, "OO!O!O!O!O!O!O!O!OOOOOOOOOOOO", &rank, &PyDict_Type,
                          &blocks, &PyDict_Type, &known, &PyDict_Type, &held, &PyDict_Type,
                          &unlisted, &PyList_Type, &out, &PyList_Type, &hashes,
                          &PyList_Type, &tokens, &PyLong_Type, &bs_obj,
                          &parent, &pident, &parent_wire, &slot, &lora_id, &lora_name,
                          &medium, &group, &fresh_pub, &add_alias, &release, &held_back))
        return NULL;
    hidden = PyObject_GetAttr(held_back, K_entries_attr);
    waiting = PyObject_GetAttr(held_back, K_waiting_attr);
    known_list = PyObject_GetAttr(rank, K_known_attr);
    if (hidden == NULL || waiting == NULL || known_list == NULL || !PyDict_CheckExact(hidden)
        || !PyDict_CheckExact(waiting) || !PyList_CheckExact(known_list)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        result = NULL;
    } else {
        int mutated = 0;
        result = chain(rank, blocks, known_list, known, held, unlisted, out, hashes, tokens,
                       bs_obj, parent, pident, parent_wire, slot, lora_id, lora_name, medium,
                       group, fresh_pub, add_alias, release, hidden, waiting, &mutated);
    }
    Py_XDECREF(hidden);
    Py_XDECREF(waiting);
    Py_XDECREF(known_list);
    return result;
}

/* Set once by consolidator/core.py (core_constants): its _ROOT, _UNKNOWN_PARENT, len(MEDIA),
 * MEDIUM_GPU and the rank attribute names. */
PyObject *C_root, *C_unknown_parent, *C_gpu, *C_zero;
Py_ssize_t C_media;
PyObject *K_blocks_attr, *K_known_attr, *K_held_attr, *K_unlisted_attr, *K_out_attr,
    *K_last_remove_attr, *K_hidden_attr, *K_entries_attr, *K_waiting_attr, *K_orphans_attr;

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

PyObject *held_back_map(PyObject *rank, PyObject *name) {
    PyObject *hidden = PyObject_GetAttr(rank, K_hidden_attr), *map;
    if (hidden == NULL) return NULL;
    if (!PyList_CheckExact(hidden) || PyList_GET_SIZE(hidden) < 1) {
        Py_DECREF(hidden);
        PyErr_SetString(PyExc_TypeError, "consolidator rank.hidden is not a list");
        return NULL;
    }
    map = PyObject_GetAttr(PyList_GET_ITEM(hidden, 0), name);
    Py_DECREF(hidden);
    if (map != NULL && !PyDict_CheckExact(map)) {
        Py_DECREF(map);
        PyErr_SetString(PyExc_TypeError, "consolidator held-back map is not a dict");
        return NULL;
    }
    return map;
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

int event_slot_hashes(PyObject *raw_hashes, PyObject *medium, PyObject *source,
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
    PyObject *held = NULL, *unlisted = NULL, *out = NULL, *parent = Py_None, *pident = NULL;
    PyObject *parent_wire = NULL, *counts = NULL, *known_slot, *held_slot, *hidden = NULL;
    PyObject *waiting = NULL;
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
        /* An adapter (task id 0 included) or extra keys are part of the identity: the
         * Python code decides. */
        PyObject *extra;
        if (field(raw, K_extra_keys, &extra) < 0) goto done;
        if (extra != NULL && extra != Py_None) { r = LEAVE; goto done; }
        if (lora_id != Py_None || lora_name != Py_None) { r = LEAVE; goto done; }
    }
    slot = PyLong_FromSsize_t(slot_index);
    blocks = PyObject_GetAttr(rank, K_blocks_attr);
    known = PyObject_GetAttr(rank, K_known_attr);
    held = PyObject_GetAttr(rank, K_held_attr);
    unlisted = PyObject_GetAttr(rank, K_unlisted_attr);
    out = PyObject_GetAttr(rank, K_out_attr);
    hidden = held_back_map(rank, K_entries_attr);
    waiting = hidden == NULL ? NULL : held_back_map(rank, K_waiting_attr);
    if (slot == NULL || blocks == NULL || known == NULL || held == NULL || unlisted == NULL
        || out == NULL || waiting == NULL)
        goto done;
    known_slot = slot_map(known, slot_index);
    held_slot = known_slot == NULL ? NULL : slot_map(held, slot_index);
    if (held_slot == NULL) goto done;
    if (!PyDict_CheckExact(blocks) || !PyDict_CheckExact(unlisted) || !PyList_CheckExact(out)) {
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
            { /* held back, so not published: the same */
                int back = is_held_back(found);
                if (back < 0) goto done;
                if (back) { r = LEAVE; goto done; }
            }
            parent = found;
            pident = BLOCK(found)->ident;
            Py_INCREF(pident);
            parent_wire = BLOCK(found)->wire;
            Py_INCREF(parent_wire);
        } else {
            /* A parent no source knows: the store is held back, by the Python code. */
            r = LEAVE;
            goto done;
        }
    }
    counts = chain(rank, blocks, known, known_slot, held_slot, unlisted, out, hashes, tokens,
                   bs_obj, parent, pident, parent_wire, slot, lora_id, lora_name, C_gpu, C_zero,
                   fresh_pub, add_alias, release, hidden, waiting, &mutated);
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
    Py_XDECREF(unlisted);
    Py_XDECREF(out);
    Py_XDECREF(pident);
    Py_XDECREF(parent_wire);
    Py_XDECREF(hidden);
    Py_XDECREF(waiting);
    return r;
}

PyDoc_STRVAR(apply_events_doc,
"apply_events(rank, events, start, source, medium_cache, fresh_pub, add_alias, release,\n"
"             remove_rest)\n"
"    -> (stop, counts, error)\n\n"
"ConsolidatorCore.apply_event for events[start:] (dedup mode) until the first event the\n"
"Python code must decide (stop is its index; len(events) when all were taken). ``error``:\n"
"None, or the exception that event stop raised part-way (a bug, not bad input); that event\n"
"then counts as consumed. ``counts``: the counter deltas of every event taken.");

static PyObject *apply_events(PyObject *module, PyObject *args) {
    PyObject *rank, *events, *source, *cache, *fresh_pub, *add_alias, *release, *remove_rest;
    PyObject *counts, *error = Py_None;
    Py_ssize_t start, i, n, cnt[N_COUNTS] = {0};

    if (!PyArg_ParseTuple(args, "OO!nO!O!OOOO", &rank, &PyList_Type, &events, &start,
                          &PyLong_Type, &source, &PyDict_Type, &cache, &fresh_pub, &add_alias,
                          &release, &remove_rest))
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
        if (str_is(kind, S_BlockStored))
            r = stored_one(rank, ev, source, cache, fresh_pub, add_alias, release, cnt);
        else if (str_is(kind, S_BlockRemoved))
            r = removed_one(rank, ev, source, cache, remove_rest, cnt);
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
    {"remove_dedup", remove_dedup, METH_VARARGS, (char *)remove_dedup_doc},
    {"u64_hashes", u64_hashes, METH_O, u64_hashes_doc},
    {"apply_events", apply_events, METH_VARARGS, apply_events_doc},
    {"core_constants", core_constants, METH_VARARGS, core_constants_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "kvbm_plugin.consolidator._core_c",
    "Compiled dedup loops of ConsolidatorCore (optional; consolidator/core.py holds the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__core_c(void) {
    if (intern_wire_keys() < 0) return NULL;
    INTERN(K_blocks_attr, "blocks");
    INTERN(K_known_attr, "known");
    INTERN(K_held_attr, "held");
    INTERN(K_unlisted_attr, "unlisted");
    INTERN(K_out_attr, "out");
    INTERN(K_last_remove_attr, "last_remove");
    INTERN(K_hidden_attr, "hidden");
    INTERN(K_entries_attr, "entries");
    INTERN(K_waiting_attr, "waiting");
    INTERN(K_orphans_attr, "orphans");
    if (core_remove_ready() < 0) return NULL;
    if ((C_zero = PyLong_FromLong(0)) == NULL) return NULL;
    if (PyType_Ready(&Block_Type) < 0) return NULL;
    {
        PyObject *module = PyModule_Create(&module_def);
        if (module == NULL) return NULL;
        Py_INCREF(&Block_Type);
        if (PyModule_AddObject(module, "Block", (PyObject *)&Block_Type) < 0) {
            Py_DECREF(&Block_Type);
            Py_DECREF(module);
            return NULL;
        }
        return module;
    }
}
