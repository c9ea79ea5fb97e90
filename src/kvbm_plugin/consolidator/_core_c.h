/* Shared by the two translation units of the compiled consolidator loops (one extension,
 * kvbm_plugin.consolidator._core_c): _core_c.c (the module, the stores, a whole batch) and
 * _core_remove.c (the removals). The block layout and the helpers both need.
 *
 * The layout is the Python core's (consolidator/blocks.py): B_* mirrors its IDENT ...
 * HELD_BACK, the indices of a Block's items (_core_block.c).
 * Called on the consolidator's ingest thread only, with the GIL held throughout.
 */

#ifndef KVBM_CORE_C_H
#define KVBM_CORE_C_H

#include "../_util/native_common.h"

enum { B_IDENT, B_PUB, B_WIRE, B_PARENT, B_CHILDREN, B_TOTAL, B_COUNTS, B_ALIAS_SLOT,
       B_ALIAS_EXT, B_MORE_ALIASES, B_KIDS, B_HELD_BACK, B_LEN };

/* Counter deltas of the compiled event paths, in ConsolidatorCore._add_counts' order. */
enum { N_STORES_IN, N_STORE_BLOCKS_IN, N_UNKNOWN_PARENTS, N_DUPLICATES, N_STORES_OUT,
       N_STORE_BLOCKS_OUT, N_REMOVES_IN, N_REMOVE_BLOCKS_IN, N_UNKNOWN_REMOVES, N_REMOVES_OUT,
       N_REMOVE_BLOCKS_OUT, N_VISIBLE, N_COUNTS };

/* Set by _core_c.c: the Python core's constants (core_constants) and the rank's attribute
 * names, interned at import. */
extern PyObject *C_root, *C_unknown_parent, *C_gpu, *C_zero;
extern Py_ssize_t C_media;
extern PyObject *K_blocks_attr, *K_known_attr, *K_held_attr, *K_unlisted_attr, *K_out_attr,
    *K_last_remove_attr, *K_hidden_attr, *K_entries_attr, *K_waiting_attr, *K_orphans_attr;

/* _core_block.c: the block of a core that runs these loops (consolidator/blocks.py's list
 * layout, compact: object fields, and the four counters as machine ints). */
typedef struct {
    PyObject_HEAD
    PyObject *ident, *pub, *wire, *parent, *counts, *alias_ext, *more_aliases, *kids;
    int children, total, alias_slot, held_back;
} BlockObject;
extern PyTypeObject Block_Type;
/* A new Block of B_LEN items in list order (borrowed), or NULL with an exception set. */
PyObject *new_block_of(PyObject *const *items);
/* A new dedup-mode Block with no holding, child or alias yet (the arguments borrowed). */
PyObject *new_dedup_block(PyObject *ident, PyObject *pub, PyObject *wire, PyObject *parent,
                          int slot, PyObject *ext);

#define BLOCK(b) ((BlockObject *)(b))

static inline int is_block(PyObject *b) {
    if (Py_IS_TYPE(b, &Block_Type)) return 1;
    PyErr_SetString(PyExc_TypeError, "consolidator block is not a compiled Block (a core made "
                    "without the compiled loops keeps lists)");
    return 0;
}

/* The counter field ``index`` (B_CHILDREN, B_TOTAL, B_HELD_BACK). */
static inline int *counter_of(PyObject *block, int index) {
    BlockObject *b = BLOCK(block);
    return index == B_CHILDREN ? &b->children : index == B_TOTAL ? &b->total : &b->held_back;
}

/* block[index] += delta (a counter); the new value in *value. */
static inline int add_to(PyObject *block, int index, Py_ssize_t delta, Py_ssize_t *value) {
    int *field = counter_of(block, index);
    *field += (int)delta;
    if (value != NULL) *value = *field;
    return 0;
}

static inline int int_field(PyObject *block, int index, Py_ssize_t *value) {
    *value = *counter_of(block, index);
    return 0;
}

/* blocks.add_kid: record ``ident`` as a new child of ``parent`` (B_KIDS: None, one child's
 * identity, or a dict of identities). */
static inline int add_kid(PyObject *parent, PyObject *ident) {
    PyObject *kids = BLOCK(parent)->kids, *d;
    if (kids == Py_None) {
        Py_INCREF(ident);
        Py_SETREF(BLOCK(parent)->kids, ident);
        return 0;
    }
    if (PyDict_CheckExact(kids)) return PyDict_SetItem(kids, ident, Py_None);
    d = PyDict_New();
    if (d == NULL || PyDict_SetItem(d, kids, Py_None) < 0
        || PyDict_SetItem(d, ident, Py_None) < 0) {
        Py_XDECREF(d);
        return -1;
    }
    Py_SETREF(BLOCK(parent)->kids, d); /* releases the one child's identity */
    return 0;
}

/* blocks.drop_kid: forget the collected child ``ident`` of ``parent``. */
static inline int drop_kid(PyObject *parent, PyObject *ident) {
    PyObject *kids = BLOCK(parent)->kids;
    int same;
    if (PyDict_CheckExact(kids)) {
        int has = PyDict_Contains(kids, ident);
        if (has < 0 || (has && PyDict_DelItem(kids, ident) < 0)) return -1;
        if (PyDict_GET_SIZE(kids) > 0) return 0;
    } else if (kids == Py_None) {
        return 0;
    } else {
        same = PyObject_RichCompareBool(kids, ident, Py_EQ); /* two ints: no Python code */
        if (same <= 0) return same;
    }
    Py_INCREF(Py_None);
    Py_SETREF(BLOCK(parent)->kids, Py_None);
    return 0;
}

/* blocks.pub_taken: 1 when a live block publishes ``pub`` (a known map names one by it that
 * publishes it, or rank.unlisted has it), 0 when none does, -1 on error. */
static inline int pub_taken(PyObject *known_list, PyObject *unlisted, PyObject *pub) {
    Py_ssize_t j;
    if (PyDict_GET_SIZE(unlisted) > 0) {
        int has = PyDict_Contains(unlisted, pub);
        if (has != 0) return has;
    }
    for (j = 0; j < PyList_GET_SIZE(known_list); j++) {
        PyObject *m = PyList_GET_ITEM(known_list, j), *b;
        if (!PyDict_CheckExact(m)) {
            PyErr_SetString(PyExc_TypeError, "unexpected consolidator rank layout");
            return -1;
        }
        if (PyDict_GET_SIZE(m) == 0) continue;
        b = PyDict_GetItemWithError(m, pub);
        if (b == NULL) {
            if (PyErr_Occurred()) return -1;
            continue;
        }
        if (!is_block(b)) return -1;
        if (BLOCK(b)->pub == pub) return 1;
        {
            int same = PyObject_RichCompareBool(BLOCK(b)->pub, pub, Py_EQ); /* two ints */
            if (same != 0) return same;
        }
    }
    return 0;
}

/* blocks.set_known's first half, before ``known[ext]`` names another block: the block it
 * names now is listed in ``unlisted`` when ``ext`` is its published hash. */
static inline int list_overwritten(PyObject *known, PyObject *unlisted, PyObject *ext) {
    PyObject *old = PyDict_GetItemWithError(known, ext);
    int same;
    if (old == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!is_block(old)) return -1;
    same = PyObject_RichCompareBool(BLOCK(old)->pub, ext, Py_EQ); /* two ints */
    if (same <= 0) return same;
    return PyDict_SetItem(unlisted, ext, old);
}

/* raw.get(key) (borrowed, NULL when absent) for an exact dict; -1 on error. */
static inline int field(PyObject *raw, PyObject *key, PyObject **out) {
    *out = PyDict_GetItemWithError(raw, key);
    return (*out == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* rank.<name>[index] (borrowed; the rank keeps its lists alive), checked to be a dict. */
static inline PyObject *slot_map(PyObject *list, Py_ssize_t index) {
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

/* Attribute ``name`` of the rank's group-0 HeldBack (rank.hidden[0].<name>), an exact dict
 * (new reference). */
PyObject *held_back_map(PyObject *rank, PyObject *name);

/* 1 when ``block`` is held back (its B_HELD_BACK count is not 0), 0 when not, -1 on error. */
static inline int is_held_back(PyObject *block) {
    return BLOCK(block)->held_back != 0;
}

/* The slot an event's medium names (through the Python code's medium cache) and its hashes in
 * u64 form (new list), or LEAVE: a medium spelling not seen yet, a hash that is not an int. */
int event_slot_hashes(PyObject *raw_hashes, PyObject *medium, PyObject *source,
                      PyObject *cache, Py_ssize_t *slot_index, PyObject **hashes);

/* _core_remove.c. ConsolidatorCore._removed (dedup) + _emit_removes for one BlockRemoved map
 * (TAKE), or LEAVE with nothing changed; ``remove_rest`` is ConsolidatorCore._remove_rest. */
int removed_one(PyObject *rank, PyObject *raw, PyObject *source, PyObject *cache,
                PyObject *remove_rest, Py_ssize_t *cnt);
/* The module function remove_dedup and its docstring. */
PyObject *remove_dedup(PyObject *module, PyObject *args);
extern const char remove_dedup_doc[];
/* Interns the wire keys for _core_remove.c's own copy (native_common.h's are per unit). */
int core_remove_ready(void);

#endif
