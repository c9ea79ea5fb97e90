/* The compiled removal loops of ConsolidatorCore in dedup mode (part of the extension
 * kvbm_plugin.consolidator._core_c; the module itself and the store loops are in _core_c.c).
 *
 * A removal walks the event's hashes in order, taking each one whose block either stays
 * resident elsewhere or goes with no live child and no held-back entry (then it is forgotten,
 * and so is each parent it leaves resident nowhere and childless). At the first hash that would
 * cascade (a block going while it still has children) or reaches a held-back block, it stops:
 * the Python loop (ConsolidatorCore._remove_rest) takes that hash and the rest of the event,
 * so a cascade costs what the Python walk of the descendants costs, and every other removal
 * stays here whatever is held back.
 */

#include "_core_c.h"

const char remove_dedup_doc[] =
"remove_dedup(blocks, known, held, unlisted, hashes, orphans)\n"
"    -> (wires, unknown, stop)\n\n"
"The dedup block loop of ConsolidatorCore._removed on the same structures, for hashes[:stop]:\n"
"the published (signed) hashes now resident nowhere, and how many hashes the slot did not\n"
"hold. ``stop`` < len(hashes): hashes[stop] would cascade or reaches a held-back block, and\n"
"nothing of it or after it has changed.";

int core_remove_ready(void) { return intern_wire_keys(); }

/* known[slot].get(ext) is block -> del known[slot][ext] */
static int forget_alias(PyObject *known, Py_ssize_t index, PyObject *ext, PyObject *block) {
    PyObject *slot_map, *named;
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

/* blocks.collect for ``block`` (owned; resident nowhere): forget it and each parent it leaves
 * resident nowhere with no child. Consumes the reference. */
static int collect(PyObject *blocks, PyObject *known, PyObject *unlisted, PyObject *orphans,
                   PyObject *block) {
    for (;;) { /* resident nowhere and no child: forget it, then maybe its parent */
        PyObject *more, *parent, *pub, *named, *ident = BLOCK(block)->ident;
        Py_ssize_t children, parent_total;
        if (int_field(block, B_CHILDREN, &children) < 0) goto fail;
        if (children) break;
        if (PyDict_DelItem(blocks, ident) < 0
            || forget_alias(known, BLOCK(block)->alias_slot, BLOCK(block)->alias_ext, block) < 0)
            goto fail;
        more = BLOCK(block)->more_aliases;
        if (more != Py_None) {
            Py_ssize_t j;
            if (!PyList_CheckExact(more)) {
                PyErr_SetString(PyExc_TypeError, "consolidator aliases are not a list");
                goto fail;
            }
            for (j = 0; j < PyList_GET_SIZE(more); j++) {
                PyObject *alias = PyList_GET_ITEM(more, j);
                if (!PyTuple_CheckExact(alias) || PyTuple_GET_SIZE(alias) != 2) {
                    PyErr_SetString(PyExc_TypeError, "consolidator alias is not a pair");
                    goto fail;
                }
                {
                    Py_ssize_t slot = PyLong_AsSsize_t(PyTuple_GET_ITEM(alias, 0));
                    if ((slot == -1 && PyErr_Occurred())
                        || forget_alias(known, slot, PyTuple_GET_ITEM(alias, 1), block) < 0)
                        goto fail;
                }
            }
        }
        pub = BLOCK(block)->pub;
        if (PyDict_GET_SIZE(unlisted) > 0) {
            named = PyDict_GetItemWithError(unlisted, pub);
            if (named == NULL && PyErr_Occurred()) goto fail;
            if (named == block && PyDict_DelItem(unlisted, pub) < 0) goto fail;
        }
        parent = BLOCK(block)->parent;
        if (parent == Py_None) { /* only a root block can be an orphan */
            if (PySet_GET_SIZE(orphans) > 0 && PySet_Discard(orphans, ident) < 0) goto fail;
            break;
        }
        if (!is_block(parent) || add_to(parent, B_CHILDREN, -1, NULL) < 0
            || drop_kid(parent, ident) < 0 || int_field(parent, B_TOTAL, &parent_total) < 0)
            goto fail;
        if (parent_total) break;
        Py_INCREF(parent);
        Py_SETREF(block, parent);
    }
    Py_DECREF(block);
    return 0;
fail:
    Py_DECREF(block);
    return -1;
}

/* The dedup block loop of _removed for hashes[:*stop]: the signed hashes now resident nowhere
 * (new list). */
static PyObject *remove_loop(PyObject *blocks, PyObject *known, PyObject *held,
                             PyObject *unlisted, PyObject *hashes, PyObject *orphans,
                             Py_ssize_t *unknown_out, Py_ssize_t *stop) {
    PyObject *wires, *block;
    Py_ssize_t i, n, unknown = 0;

    wires = PyList_New(0);
    if (wires == NULL) return NULL;
    n = PyList_GET_SIZE(hashes);
    for (i = 0; i < n; i++) {
        PyObject *ext = PyList_GET_ITEM(hashes, i);
        Py_ssize_t total, children;
        block = PyDict_GetItemWithError(held, ext);
        if (block == NULL) {
            if (PyErr_Occurred()) goto fail;
            unknown += 1;
            continue;
        }
        if (!is_block(block) || int_field(block, B_TOTAL, &total) < 0
            || int_field(block, B_CHILDREN, &children) < 0)
            goto fail;
        if (total <= 1) {
            /* It goes: with children it cascades, held back it was never published; either
             * way the Python loop decides it from here. */
            int back = is_held_back(block);
            if (back < 0) goto fail;
            if (children > 0 || back) break;
        }
        Py_INCREF(block); /* owned: the dicts below may drop every other reference */
        if (PyDict_DelItem(held, ext) < 0 || add_to(block, B_TOTAL, -1, &total) < 0) {
            Py_DECREF(block);
            goto fail;
        }
        if (total) {
            Py_DECREF(block);
            continue;
        }
        if (PyList_Append(wires, BLOCK(block)->wire) < 0) {
            Py_DECREF(block);
            goto fail;
        }
        if (collect(blocks, known, unlisted, orphans, block) < 0) goto fail;
    }
    *unknown_out = unknown;
    *stop = i;
    return wires;
fail:
    Py_DECREF(wires);
    return NULL;
}

PyObject *remove_dedup(PyObject *module, PyObject *args) {
    PyObject *blocks, *known, *held, *unlisted, *hashes, *orphans, *wires;
    Py_ssize_t unknown = 0, stop = 0;

    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!", &PyDict_Type, &blocks, &PyList_Type, &known,
                          &PyDict_Type, &held, &PyDict_Type, &unlisted, &PyList_Type, &hashes,
                          &PySet_Type, &orphans))
        return NULL;
    wires = remove_loop(blocks, known, held, unlisted, hashes, orphans, &unknown, &stop);
    if (wires == NULL) return NULL;
    return Py_BuildValue("Nnn", wires, unknown, stop);
}

int removed_one(PyObject *rank, PyObject *raw, PyObject *source, PyObject *cache,
                PyObject *remove_rest, Py_ssize_t *cnt) {
    PyObject *raw_hashes, *medium, *hashes = NULL, *blocks = NULL, *known = NULL, *held = NULL;
    PyObject *unlisted = NULL, *out = NULL, *last = NULL, *wires = NULL, *orphans = NULL;
    PyObject *held_slot;
    Py_ssize_t slot_index, unknown = 0, nw, stop = 0;
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
    unlisted = PyObject_GetAttr(rank, K_unlisted_attr);
    out = PyObject_GetAttr(rank, K_out_attr);
    last = PyObject_GetAttr(rank, K_last_remove_attr);
    orphans = PyObject_GetAttr(rank, K_orphans_attr);
    if (blocks == NULL || known == NULL || held == NULL || unlisted == NULL || out == NULL
        || last == NULL || orphans == NULL)
        goto done;
    held_slot = slot_map(held, slot_index);
    if (held_slot == NULL) goto done;
    if (!PyDict_CheckExact(blocks) || !PyList_CheckExact(known)
        || !PyDict_CheckExact(unlisted) || !PyList_CheckExact(out)
        || !PySet_CheckExact(orphans)) {
        PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
        goto done;
    }
    cnt[N_REMOVES_IN] += 1;
    cnt[N_REMOVE_BLOCKS_IN] += PyList_GET_SIZE(hashes);
    wires = remove_loop(blocks, known, held_slot, unlisted, hashes, orphans, &unknown, &stop);
    if (wires == NULL) goto done;
    if (stop < PyList_GET_SIZE(hashes)) { /* a cascade or a held-back block: Python's turn */
        PyObject *rest = PyObject_CallFunction(remove_rest, "OOOnO", rank, held_slot, hashes,
                                               stop, wires);
        Py_ssize_t more;
        if (rest == NULL) goto done;
        more = PyLong_AsSsize_t(rest);
        Py_DECREF(rest);
        if (more == -1 && PyErr_Occurred()) goto done;
        unknown += more;
    }
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
    Py_XDECREF(unlisted);
    Py_XDECREF(out);
    Py_XDECREF(last);
    Py_XDECREF(orphans);
    return r;
}
