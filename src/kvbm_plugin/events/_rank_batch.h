/* The compiled batch of one data-parallel rank (RankBatch, the compiled form of
 * event_sink._Rank): the open event kept as C arrays and written out as its wire bytes.
 * Defined in _rank_batch.c; the loops that fill it (the buffered dicts, the V2 hooks) are in
 * _sink_c.c. One extension module, kvbm_plugin.events._sink_c, holds both. */

#ifndef KVBM_RANK_BATCH_H
#define KVBM_RANK_BATCH_H

#include "../_util/native_common.h"

#include <stdint.h>

enum { OPEN_NONE = 0, OPEN_STORED = 1, OPEN_REMOVED = 2 };

typedef struct {
    PyObject_HEAD
    /* The attributes of event_sink._Rank (see there). ``last`` is a map the Python code built
     * (or the open event turned into one); it is None while an event is open. */
    PyObject *events, *last, *suppressed, *live, *live_keys, *published, *kids;
    /* The Python V2 hooks, for the calls the fast path does not take. */
    PyObject *fallback_store, *fallback_remove;
    int fast_hooks; /* the V2 fast path may run: every layer group is published */
    Py_ssize_t block_size;
    PyObject *block_size_obj;
    /* The open event. */
    int open;
    int64_t *hashes;
    Py_ssize_t n_hashes, cap_hashes;
    int has_parent, has_lora;
    int64_t parent;
    uint64_t lora;
    uint32_t *tokens, *scratch; /* scratch: one block's token ids, read before they count */
    Py_ssize_t cap_scratch;
    Py_ssize_t n_tokens, cap_tokens;
    /* Events written out since the batch's last item, encoded one after another. */
    char *run;
    Py_ssize_t n_run, cap_run, run_events;
    /* What the V2 fast path took (the sink adds them to its counters). */
    long long v2_blocks_stored, v2_stores, v2_blocks_removed, v2_removes;
} RankBatch;

extern PyTypeObject RankBatchType;

/* Interns the names the batch writes and readies its type; once, at module import. */
int rank_batch_ready(void);

/* ``*buf`` holds at least ``need`` items of ``item`` bytes (grown by doubling). */
int rb_grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item);

/* Append one stored block (wire hash ``h``, its token ids in rb->scratch) to the batch,
 * coalescing as the Python code does: onto ``last`` (a map) or onto the open event when it is
 * this chain's previous store with the same adapter (``lora``, u64, when ``has_lora``).
 * Returns 1 for a new store, 0 extended, -1 error. */
int rb_append_store(RankBatch *rb, int64_t h, int has_parent, int64_t parent, int has_lora,
                    uint64_t lora);

/* Append removed wire hashes to the batch, coalescing like the Python code.
 * Returns 1 for a new removal event, 0 extended, -1 error. */
int rb_append_removed(RankBatch *rb, const int64_t *hashes, Py_ssize_t n);

/* The V2 hooks' fast path (RankBatch methods; _sink_c.c). */
PyObject *RankBatch_v2_store(RankBatch *rb, PyObject *block);
PyObject *RankBatch_v2_remove(RankBatch *rb, PyObject *key);

#endif
