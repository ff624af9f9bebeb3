/* A byte-pair-encoding model for vocabularies of sentencepiece's kind (GGUF's "llama"
 * tokenizer: pieces with "\u2581" for spaces, bytes as "<0xXX>" pieces), merging exactly as
 * the `tokenizers` library's BPE model does (tokenizers/src/models/bpe/word.rs): a word's
 * characters, each a piece or its bytes' pieces, then the pair of lowest merge rank merged
 * first, the leftmost on a tie, until no adjacent pair has a merge.
 *
 * The merges, two ways:
 * - a table (bpe_new): the file's own merges, rank = their order;
 * - scores (bpe_new_scored): a vocabulary without merges, whose merges transformers generates
 *   from the scores (every split of a piece into two pieces; transformers' generate_merges,
 *   coordinator/text/tokenizer.py) and ranks by the merged piece's score, highest first, then
 *   the left part's length in characters, longest first, then the right part's, then the merged
 *   piece's id. That order is computed here for each pair as it is met: a pair merges where its
 *   two pieces joined are a piece, so no merge table is built at all.
 *
 * Why not that library: its BPE keeps a vocabulary of 262144 pieces and Gemma 3's 514847
 * generated merges in Rust hash maps of owned strings, 110 MB resident in the coordinator for
 * a model whose weights are 253 MB (and 2.6 s to generate the merges). Here the pieces are the
 * caller's byte buffer, the vocabulary a table of 32-bit ids and the scores an array: 3 MB for
 * the same file. The text around the model (added pieces, the space prefix, decoding) is
 * coordinator/text/pieces.py; the tests hold both against the library.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    Py_buffer blob_view, offsets_view; /* the caller's buffers, held (not copied) while this lives */
    const uint8_t *blob;    /* every piece's bytes, back to back */
    const uint32_t *offsets; /* piece i is blob[offsets[i] .. offsets[i+1]) */
    uint32_t n_pieces;
    uint32_t *vocab;        /* open addressing: piece id + 1, 0 empty */
    uint64_t vocab_mask;
    uint64_t *merge_keys;   /* (left << 32 | right) + 1, 0 empty; NULL: scored */
    uint64_t *merge_vals;   /* rank << 32 | merged piece */
    uint64_t merge_size;    /* not a power of two: a load of 0.7 */
    Py_buffer scores_view;  /* scored: float32 per piece, held */
    uint8_t *chars;         /* scored: each piece's length in characters (255: longer) */
    int32_t byte_ids[256];  /* "<0xXX>" pieces, -1 where missing */
    int32_t unk_id;         /* -1: none */
    int fuse_unk;
} Bpe;

static uint64_t hash_bytes(const uint8_t *p, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 1099511628211ULL;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint64_t k) {
    k ^= k >> 33; k *= 0xff51afd7ed558ccdULL; k ^= k >> 33; k *= 0xc4ceb9fe1a85ec53ULL;
    return k ^ (k >> 33);
}

static uint64_t table_size(uint64_t n) {
    uint64_t s = 16;
    while (s < 2 * n) s <<= 1;
    return s;
}

static uint64_t merge_slot(const Bpe *b, uint64_t key) { return hash_pair(key) % b->merge_size; }

static int32_t piece_id(const Bpe *b, const uint8_t *p, size_t n) {
    for (uint64_t i = hash_bytes(p, n) & b->vocab_mask;; i = (i + 1) & b->vocab_mask) {
        uint32_t v = b->vocab[i];
        if (!v) return -1;
        uint32_t id = v - 1, len = b->offsets[id + 1] - b->offsets[id];
        if (len == n && !memcmp(b->blob + b->offsets[id], p, n)) return (int32_t)id;
    }
}

/* A merge's place in the order, lowest first: (rank, 0) from a table, or for scores (the
 * merged piece's score highest first as an order-keeping integer, then the left and right
 * lengths longest first; the merged piece's id). */
#define MAX_PIECE 512  /* scored: the longest piece (bpe_new_scored) */

typedef struct { uint64_t rank, tie; } Order;

static int order_before(Order a, Order b) { return a.rank != b.rank ? a.rank < b.rank : a.tie < b.tie; }

static uint64_t score_order(float f) {  /* higher scores smaller */
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  /* ascending with f */
    return (uint64_t)(0xFFFFFFFFu - u);
}

/* The merge of pair (l, r): 1 and its order and piece, or 0. */
static int merge_of(const Bpe *b, uint32_t l, uint32_t r, Order *order, uint32_t *piece) {
    if (!b->merge_keys) {
        uint32_t ll = b->offsets[l + 1] - b->offsets[l], rl = b->offsets[r + 1] - b->offsets[r];
        uint8_t joined[2 * MAX_PIECE];  /* no piece is longer than MAX_PIECE (bpe_new_scored checked) */
        if (ll + rl > MAX_PIECE) return 0;
        memcpy(joined, b->blob + b->offsets[l], ll);
        memcpy(joined + ll, b->blob + b->offsets[r], rl);
        int32_t m = piece_id(b, joined, ll + rl);
        if (m < 0) return 0;
        const float *scores = b->scores_view.buf;
        *order = (Order){score_order(scores[m]) << 16 | (uint64_t)(255 - b->chars[l]) << 8 | (255 - b->chars[r]),
                         (uint64_t)m};
        *piece = (uint32_t)m;
        return 1;
    }
    uint64_t key = ((uint64_t)l << 32 | r) + 1;
    for (uint64_t i = merge_slot(b, key);; i = i + 1 == b->merge_size ? 0 : i + 1) {
        if (!b->merge_keys[i]) return 0;
        if (b->merge_keys[i] == key) {
            *order = (Order){b->merge_vals[i] >> 32, 0};
            *piece = (uint32_t)b->merge_vals[i];
            return 1;
        }
    }
}

static void bpe_release(Bpe *b) {
    if (b->blob_view.obj) PyBuffer_Release(&b->blob_view);
    if (b->offsets_view.obj) PyBuffer_Release(&b->offsets_view);
    if (b->scores_view.obj) PyBuffer_Release(&b->scores_view);
    free(b->vocab); free(b->merge_keys); free(b->merge_vals); free(b->chars);
    free(b);
}

static void bpe_free(PyObject *capsule) {
    Bpe *b = PyCapsule_GetPointer(capsule, "bpe");
    if (b) bpe_release(b);
}

/* The pieces' table (b->blob, b->offsets set): 0, or -1 with an exception set. A piece spelled
 * twice keeps its last id, as the {piece: id} map the library is given. */
static int build_vocabulary(Bpe *b, size_t blob_len) {
    size_t n = b->n_pieces;
    for (size_t i = 0; i < n; i++)
        if (b->offsets[i] > b->offsets[i + 1] || b->offsets[i + 1] > (uint64_t)blob_len) {
            PyErr_SetString(PyExc_ValueError, "bpe: piece offsets out of order");
            return -1;
        }
    uint64_t vs = table_size(n);
    b->vocab = calloc(vs, 4);
    if (!b->vocab) { PyErr_NoMemory(); return -1; }
    b->vocab_mask = vs - 1;
    for (uint32_t id = 0; id < n; id++) {
        const uint8_t *p = b->blob + b->offsets[id];
        size_t len = b->offsets[id + 1] - b->offsets[id];
        uint64_t i = hash_bytes(p, len) & b->vocab_mask;
        for (; b->vocab[i]; i = (i + 1) & b->vocab_mask) {
            uint32_t o = b->vocab[i] - 1;
            if (b->offsets[o + 1] - b->offsets[o] == len && !memcmp(b->blob + b->offsets[o], p, len)) break;
        }
        b->vocab[i] = id + 1;
    }
    return 0;
}

/* What both constructors take first: blob, offsets (held: released with the model, or here if
 * this fails), byte_ids, unk_id, fuse_unk. */
static Bpe *bpe_start(Py_buffer *blob, Py_buffer *offs, Py_buffer *bytes, int unk_id, int fuse_unk) {
    Bpe *b = calloc(1, sizeof(Bpe));
    if (!b) {
        PyBuffer_Release(blob);
        PyBuffer_Release(offs);
        PyErr_NoMemory();
        return NULL;
    }
    b->blob_view = *blob;
    b->offsets_view = *offs;
    size_t n = offs->len / 4;
    if (n < 2 || offs->len % 4 || bytes->len != 256 * 4) {
        PyErr_SetString(PyExc_ValueError, "bpe: malformed vocabulary arrays");
        bpe_release(b);
        return NULL;
    }
    b->n_pieces = (uint32_t)(n - 1);
    b->unk_id = unk_id;
    b->fuse_unk = fuse_unk;
    memcpy(b->byte_ids, bytes->buf, sizeof b->byte_ids);
    b->blob = blob->buf;
    b->offsets = offs->buf;
    if (build_vocabulary(b, blob->len)) { bpe_release(b); return NULL; }
    return b;
}

/* bpe_new(blob: bytes, offsets: uint32 buffer (n+1), byte_ids: int32 buffer (256), unk_id: int,
 * fuse_unk: bool, merges: int32 buffer (m, 2) of piece ids in rank order) -> capsule, which
 * holds blob and offsets (the caller must not change them) and copies nothing of them.
 * A merge whose joined pieces are not a piece is skipped; a pair named twice keeps its last
 * rank, as the library's map does. */
static PyObject *bpe_new(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer blob, offs, bytes, merges;
    int unk_id, fuse_unk;
    if (!PyArg_ParseTuple(args, "y*y*y*ipy*", &blob, &offs, &bytes, &unk_id, &fuse_unk, &merges)) return NULL;
    Bpe *b = bpe_start(&blob, &offs, &bytes, unk_id, fuse_unk);
    PyObject *out = NULL;
    if (!b) goto done;
    if (merges.len % 8) {
        PyErr_SetString(PyExc_ValueError, "bpe_new: merges are pairs of int32 piece ids");
        goto done;
    }
    size_t n = b->n_pieces, m = merges.len / 8;
    uint64_t ms = m + m * 3 / 7 + 16;
    b->merge_keys = calloc(ms, 8);
    b->merge_vals = malloc(ms * 8);
    b->merge_size = ms;
    if (!b->merge_keys || !b->merge_vals) {
        PyErr_NoMemory();
        goto done;
    }
    const int32_t *mp = merges.buf;
    uint8_t *joined = NULL;
    size_t cap = 0;
    for (size_t r = 0; r < m; r++) {
        int32_t l = mp[2 * r], rr = mp[2 * r + 1];
        if (l < 0 || rr < 0 || (size_t)l >= n || (size_t)rr >= n) continue;
        size_t ll = b->offsets[l + 1] - b->offsets[l], rl = b->offsets[rr + 1] - b->offsets[rr];
        if (ll + rl > cap) {
            cap = 2 * (ll + rl);
            uint8_t *j = realloc(joined, cap);
            if (!j) { free(joined); PyErr_NoMemory(); goto done; }
            joined = j;
        }
        memcpy(joined, b->blob + b->offsets[l], ll);
        memcpy(joined + ll, b->blob + b->offsets[rr], rl);
        int32_t piece = piece_id(b, joined, ll + rl);
        if (piece < 0) continue;
        uint64_t key = ((uint64_t)(uint32_t)l << 32 | (uint32_t)rr) + 1;
        uint64_t i = merge_slot(b, key);
        while (b->merge_keys[i] && b->merge_keys[i] != key) i = i + 1 == b->merge_size ? 0 : i + 1;
        b->merge_keys[i] = key;
        b->merge_vals[i] = (uint64_t)r << 32 | (uint32_t)piece;
    }
    free(joined);
    out = PyCapsule_New(b, "bpe", bpe_free);
done:
    if (!out && b) bpe_release(b);  /* blob and offsets with it (bpe_start released them if it failed) */
    PyBuffer_Release(&merges); PyBuffer_Release(&bytes);
    return out;
}

/* bpe_new_scored(blob, offsets, byte_ids, unk_id, fuse_unk, scores: float32 buffer (n)) ->
 * capsule: the merges transformers generates from the scores, in its order (the header),
 * found as pairs are met. Holds blob, offsets and scores. ValueError for a piece longer than
 * MAX_PIECE bytes (the caller then generates the merges and uses bpe_new). */
static PyObject *bpe_new_scored(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer blob, offs, bytes, scores;
    int unk_id, fuse_unk;
    if (!PyArg_ParseTuple(args, "y*y*y*ipy*", &blob, &offs, &bytes, &unk_id, &fuse_unk, &scores)) return NULL;
    Bpe *b = bpe_start(&blob, &offs, &bytes, unk_id, fuse_unk);
    if (!b) { PyBuffer_Release(&bytes); PyBuffer_Release(&scores); return NULL; }
    PyBuffer_Release(&bytes);
    b->scores_view = scores;
    PyObject *out = NULL;
    size_t n = b->n_pieces;
    if ((size_t)scores.len != 4 * n) {
        PyErr_SetString(PyExc_ValueError, "bpe_new_scored: one float32 score per piece");
        goto done;
    }
    b->chars = malloc(n ? n : 1);
    if (!b->chars) { PyErr_NoMemory(); goto done; }
    for (size_t i = 0; i < n; i++) {
        uint32_t len = b->offsets[i + 1] - b->offsets[i], c = 0;
        if (len > MAX_PIECE) {
            PyErr_SetString(PyExc_ValueError, "bpe_new_scored: a piece longer than 512 bytes");
            goto done;
        }
        for (uint32_t k = 0; k < len; k++) c += (b->blob[b->offsets[i] + k] & 0xC0) != 0x80;
        b->chars[i] = (uint8_t)(c > 255 ? 255 : c);  /* <= 512 bytes: a tie only past 255 characters */
    }
    out = PyCapsule_New(b, "bpe", bpe_free);
done:
    if (!out) bpe_release(b);
    return out;
}

typedef struct { int32_t id, prev, next, len; } Symbol;
typedef struct { Order order; uint32_t pos, piece; } Merge;

/* Heap order: first in merge order, then leftmost (the library's Merge ordering). */
static int before(const Merge *a, const Merge *b) {
    if (a->order.rank != b->order.rank || a->order.tie != b->order.tie) return order_before(a->order, b->order);
    return a->pos < b->pos;
}

static void heap_push(Merge *h, size_t *n, Merge m) {
    size_t i = (*n)++;
    while (i && before(&m, &h[(i - 1) / 2])) { h[i] = h[(i - 1) / 2]; i = (i - 1) / 2; }
    h[i] = m;
}

static Merge heap_pop(Merge *h, size_t *n) {
    Merge top = h[0], last = h[--*n];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) break;
        if (c + 1 < *n && before(&h[c + 1], &h[c])) c++;
        if (!before(&h[c], &last)) break;
        h[i] = h[c];
        i = c;
    }
    if (*n) h[i] = last;
    return top;
}

static size_t utf8_len(uint8_t c) {
    return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
}

static void push_pair(const Bpe *b, Symbol *s, int pos, Merge *heap, size_t *nh) {
    Order order;
    uint32_t piece;
    if (pos >= 0 && s[pos].next >= 0 && merge_of(b, s[pos].id, s[s[pos].next].id, &order, &piece))
        heap_push(heap, nh, (Merge){order, (uint32_t)pos, piece});
}

/* bpe_encode(capsule, word: bytes (UTF-8)) -> list of piece ids. */
static PyObject *bpe_encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule;
    Py_buffer word;
    if (!PyArg_ParseTuple(args, "Oy*", &capsule, &word)) return NULL;
    Bpe *b = PyCapsule_GetPointer(capsule, "bpe");
    if (!b) { PyBuffer_Release(&word); return NULL; }
    const uint8_t *w = word.buf;
    size_t n = word.len;
    /* at most one symbol per byte; the heap holds at most one entry per merge made plus the
     * first pass's, bounded by 3 per byte */
    Symbol *s = malloc((n + 1) * sizeof(Symbol));
    Merge *heap = malloc((3 * n + 1) * sizeof(Merge));
    PyObject *out = NULL;
    if (!s || !heap) { PyErr_NoMemory(); goto done; }
    int ns = 0;
    int unk_pending = 0; /* a fused unknown's length in bytes, pushed before the next symbol */
    for (size_t i = 0; i < n;) {
        size_t cl = utf8_len(w[i]);
        if (i + cl > n) cl = n - i;
        int32_t id = piece_id(b, w + i, cl);
        if (id < 0) {
            int all = 1;
            for (size_t k = 0; k < cl; k++) all &= b->byte_ids[w[i + k]] >= 0;
            if (all) {
                if (unk_pending) { s[ns] = (Symbol){b->unk_id, ns - 1, ns + 1, unk_pending}; ns++; unk_pending = 0; }
                for (size_t k = 0; k < cl; k++) { s[ns] = (Symbol){b->byte_ids[w[i + k]], ns - 1, ns + 1, 1}; ns++; }
            } else if (b->unk_id >= 0) {
                if (b->fuse_unk) unk_pending += (int)cl;
                else { if (unk_pending) { s[ns] = (Symbol){b->unk_id, ns - 1, ns + 1, unk_pending}; ns++; unk_pending = 0; }
                       s[ns] = (Symbol){b->unk_id, ns - 1, ns + 1, (int)cl}; ns++; }
            }
        } else {
            if (unk_pending) { s[ns] = (Symbol){b->unk_id, ns - 1, ns + 1, unk_pending}; ns++; unk_pending = 0; }
            s[ns] = (Symbol){id, ns - 1, ns + 1, (int)cl}; ns++;
        }
        i += cl;
    }
    if (unk_pending) { s[ns] = (Symbol){b->unk_id, ns - 1, ns + 1, unk_pending}; ns++; }
    if (ns) s[ns - 1].next = -1;
    size_t nh = 0;
    for (int i = 0; i + 1 < ns; i++) push_pair(b, s, i, heap, &nh);
    while (nh) {
        Merge top = heap_pop(heap, &nh);
        Symbol *cur = &s[top.pos];
        if (!cur->len || cur->next < 0) continue;
        int nx = cur->next;
        Order order;
        uint32_t piece;
        /* an entry whose pair has changed since it was pushed is stale */
        if (!merge_of(b, cur->id, s[nx].id, &order, &piece) || piece != top.piece) continue;
        cur->id = (int32_t)top.piece;
        cur->len += s[nx].len;
        cur->next = s[nx].next;
        s[nx].len = 0;
        if (cur->next >= 0) s[cur->next].prev = (int)top.pos;
        push_pair(b, s, cur->prev, heap, &nh);
        push_pair(b, s, (int)top.pos, heap, &nh);
    }
    out = PyList_New(0);
    for (int i = 0; out && i < ns; i++) {
        if (!s[i].len) continue;
        PyObject *v = PyLong_FromLong(s[i].id);
        if (!v || PyList_Append(out, v)) { Py_XDECREF(v); Py_CLEAR(out); break; }
        Py_DECREF(v);
    }
done:
    free(s); free(heap);
    PyBuffer_Release(&word);
    return out;
}

/* bpe_piece(capsule, piece: bytes) -> its id, or -1. */
static PyObject *bpe_piece(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule;
    Py_buffer piece;
    if (!PyArg_ParseTuple(args, "Oy*", &capsule, &piece)) return NULL;
    Bpe *b = PyCapsule_GetPointer(capsule, "bpe");
    long id = b ? piece_id(b, piece.buf, piece.len) : -1;
    PyBuffer_Release(&piece);
    return b ? PyLong_FromLong(id) : NULL;
}

static PyMethodDef methods[] = {
    {"bpe_piece", bpe_piece, METH_VARARGS, "A piece's id, or -1."},
    {"bpe_new", bpe_new, METH_VARARGS, "A BPE model from pieces, byte pieces and merges."},
    {"bpe_new_scored", bpe_new_scored, METH_VARARGS, "A BPE model from pieces, byte pieces and scores."},
    {"bpe_encode", bpe_encode, METH_VARARGS, "A word's piece ids."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bpe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bpe(void) { return PyModule_Create(&module); }
