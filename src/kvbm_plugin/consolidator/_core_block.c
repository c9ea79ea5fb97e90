/* The compiled consolidator's block (part of the extension kvbm_plugin.consolidator._core_c):
 * one block of one dp rank, the compact form of the Python core's 12-item block list
 * (consolidator/blocks.py, layout IDENT ... HELD_BACK = B_* in _core_c.h).
 *
 * A core that runs the compiled loops makes every block a ``Block`` (blocks.new_block), the
 * compiled loops through new_block() below; a core without them keeps lists. The Python code
 * reads and writes either the same way, ``block[TOTAL] += 1``: a Block is a sequence of
 * exactly B_LEN items (ints for the four counters, objects for the rest). What it saves per
 * block, against the list: the list's collector header and its separate item array (one
 * allocation of 96 bytes instead of two of 152), and the counters are machine ints. A block
 * refers only to its parent block, ints and its own containers of ints, never to itself
 * through them: it is not part of any reference cycle, so it is not a collector type. Kept for
 * the leader's heap target (<= 400 B per tier block at 1M): the list would add about 56 B.
 *
 * Made and used on the consolidator's ingest thread only (the thread that owns the core), with
 * the GIL held; freed wherever its last reference goes (a chain of parents is freed in a loop,
 * not by recursion, whatever its length).
 */

#include "_core_c.h"

static Py_ssize_t block_length(PyObject *self) {
    (void)self;
    return B_LEN;
}

/* The object field at ``index`` (borrowed), or NULL for a counter. */
static PyObject **object_field(BlockObject *b, Py_ssize_t index) {
    switch (index) {
    case B_IDENT: return &b->ident;
    case B_PUB: return &b->pub;
    case B_WIRE: return &b->wire;
    case B_PARENT: return &b->parent;
    case B_COUNTS: return &b->counts;
    case B_ALIAS_EXT: return &b->alias_ext;
    case B_MORE_ALIASES: return &b->more_aliases;
    case B_KIDS: return &b->kids;
    default: return NULL;
    }
}

static int *counter_field(BlockObject *b, Py_ssize_t index) {
    switch (index) {
    case B_CHILDREN: return &b->children;
    case B_TOTAL: return &b->total;
    case B_ALIAS_SLOT: return &b->alias_slot;
    case B_HELD_BACK: return &b->held_back;
    default: return NULL;
    }
}

static PyObject *block_item(PyObject *self, Py_ssize_t index) {
    BlockObject *b = (BlockObject *)self;
    PyObject **field;
    if (index < 0 || index >= B_LEN) {
        PyErr_SetString(PyExc_IndexError, "consolidator block index out of range");
        return NULL;
    }
    field = object_field(b, index);
    if (field != NULL) {
        Py_INCREF(*field);
        return *field;
    }
    return PyLong_FromLong(*counter_field(b, index));
}

static int block_ass_item(PyObject *self, Py_ssize_t index, PyObject *value) {
    BlockObject *b = (BlockObject *)self;
    PyObject **field;
    long n;
    if (index < 0 || index >= B_LEN) {
        PyErr_SetString(PyExc_IndexError, "consolidator block index out of range");
        return -1;
    }
    if (value == NULL) {
        PyErr_SetString(PyExc_TypeError, "a consolidator block's items cannot be deleted");
        return -1;
    }
    field = object_field(b, index);
    if (field != NULL) {
        Py_INCREF(value);
        Py_XSETREF(*field, value);
        return 0;
    }
    n = PyLong_AsLong(value);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < INT_MIN || n > INT_MAX) {
        PyErr_Format(PyExc_OverflowError, "consolidator block counter %zd = %ld does not fit",
                     index, n);
        return -1;
    }
    *counter_field(b, index) = (int)n;
    return 0;
}

/* The items as a new list (for slices and repr). */
static PyObject *block_as_list(PyObject *self) {
    PyObject *list = PyList_New(B_LEN);
    Py_ssize_t i;
    if (list == NULL) return NULL;
    for (i = 0; i < B_LEN; i++) {
        PyObject *item = block_item(self, i);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *block_subscript(PyObject *self, PyObject *key) {
    PyObject *list, *out;
    if (PyLong_CheckExact(key)) { /* the Python core's own reads: block[TOTAL] */
        Py_ssize_t i = PyLong_AsSsize_t(key);
        if (i == -1 && PyErr_Occurred()) return NULL;
        return block_item(self, i < 0 ? i + B_LEN : i);
    }
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) i += B_LEN;
        return block_item(self, i);
    }
    list = block_as_list(self); /* a slice: what the same slice of the list form gives */
    if (list == NULL) return NULL;
    out = PyObject_GetItem(list, key);
    Py_DECREF(list);
    return out;
}

static int block_ass_subscript(PyObject *self, PyObject *key, PyObject *value) {
    Py_ssize_t i;
    if (PyLong_CheckExact(key)) {
        i = PyLong_AsSsize_t(key);
        if (i == -1 && PyErr_Occurred()) return -1;
        return block_ass_item(self, i < 0 ? i + B_LEN : i, value);
    }
    if (!PyIndex_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "consolidator block indices must be integers");
        return -1;
    }
    i = PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0) i += B_LEN;
    return block_ass_item(self, i, value);
}

static PyObject *block_repr(PyObject *self) {
    PyObject *list = block_as_list(self), *r;
    if (list == NULL) return NULL;
    r = PyUnicode_FromFormat("Block(%R)", list);
    Py_DECREF(list);
    return r;
}

/* Drops the fields other than the parent; returns the parent (owned, maybe NULL). */
static PyObject *block_clear_fields(BlockObject *b) {
    PyObject *parent = b->parent;
    b->parent = NULL;
    Py_CLEAR(b->ident);
    Py_CLEAR(b->pub);
    Py_CLEAR(b->wire);
    Py_CLEAR(b->counts);
    Py_CLEAR(b->alias_ext);
    Py_CLEAR(b->more_aliases);
    Py_CLEAR(b->kids);
    return parent;
}

static void block_dealloc(PyObject *self) {
    PyObject *parent = block_clear_fields((BlockObject *)self);
    Py_TYPE(self)->tp_free(self);
    /* Up the chain while this was the parent's last reference: each parent is freed here,
     * its own parent taken first, so a chain of any length is freed without recursion. */
    while (parent != NULL && Py_IS_TYPE(parent, &Block_Type) && Py_REFCNT(parent) == 1) {
        PyObject *next = ((BlockObject *)parent)->parent;
        ((BlockObject *)parent)->parent = NULL;
        Py_DECREF(parent); /* frees it (its dealloc finds no parent); ``next`` is ours now */
        parent = next;
    }
    Py_XDECREF(parent);
}

PyObject *new_dedup_block(PyObject *ident, PyObject *pub, PyObject *wire, PyObject *parent,
                          int slot, PyObject *ext) {
    BlockObject *b = PyObject_New(BlockObject, &Block_Type);
    if (b == NULL) return NULL;
    Py_INCREF(ident);
    b->ident = ident;
    Py_INCREF(pub);
    b->pub = pub;
    Py_INCREF(wire);
    b->wire = wire;
    Py_INCREF(parent);
    b->parent = parent;
    Py_INCREF(Py_None);
    b->counts = Py_None;
    Py_INCREF(ext);
    b->alias_ext = ext;
    Py_INCREF(Py_None);
    b->more_aliases = Py_None;
    Py_INCREF(Py_None);
    b->kids = Py_None;
    b->children = b->total = b->held_back = 0;
    b->alias_slot = slot;
    return (PyObject *)b;
}

PyObject *new_block_of(PyObject *const *items) {
    BlockObject *b = PyObject_New(BlockObject, &Block_Type);
    Py_ssize_t i;
    if (b == NULL) return NULL;
    b->ident = b->pub = b->wire = b->parent = b->counts = NULL;
    b->alias_ext = b->more_aliases = b->kids = NULL;
    b->children = b->total = b->alias_slot = b->held_back = 0;
    for (i = 0; i < B_LEN; i++) {
        if (block_ass_item((PyObject *)b, i, items[i]) < 0) {
            Py_DECREF(b);
            return NULL;
        }
    }
    return (PyObject *)b;
}

static PyObject *block_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)type;
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs) > 0) || PyTuple_GET_SIZE(args) != B_LEN) {
        PyErr_Format(PyExc_TypeError, "Block() takes exactly %d positional items", (int)B_LEN);
        return NULL;
    }
    return new_block_of(&PyTuple_GET_ITEM(args, 0));
}

static PySequenceMethods block_as_sequence = {
    .sq_length = block_length,
    .sq_item = block_item,
    .sq_ass_item = block_ass_item,
};

static PyMappingMethods block_as_mapping = {
    .mp_length = block_length,
    .mp_subscript = block_subscript,
    .mp_ass_subscript = block_ass_subscript,
};

PyTypeObject Block_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvbm_plugin.consolidator._core_c.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_dealloc = block_dealloc,
    .tp_repr = block_repr,
    .tp_as_sequence = &block_as_sequence,
    .tp_as_mapping = &block_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Block(ident, pub, wire, parent, children, total, counts, alias_slot, alias_ext,"
              " more_aliases, kids, held_back): one consolidator block, the compact form of"
              " consolidator/blocks.py's block list (same items, same indices).",
    .tp_new = block_new,
};
