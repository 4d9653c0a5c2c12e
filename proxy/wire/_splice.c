/*
 * The native splice: the per-series work of a whole remote-write request, in C, with the
 * GIL released.
 *
 * What it does is exactly what proxy/wire/splice_v1.py and splice_v2.py do (those are
 * the reference; tests/wire/test_native_differential.py holds the two equal on random
 * valid and invalid requests, and a bounded fuzz run in CI looks for crashes):
 *
 *   - walk every series at wire level (RW 1.0 labels, RW 2.0 symbols + refs), checking
 *     the framing and the UTF-8 of every label string;
 *   - find the pod's (namespace, pod) through the plan's pairs and metric rules, with
 *     their `unless` conditions (literal alternations natively; any other regex calls
 *     back into Python under the GIL);
 *   - look the pod up in a per-pod table (PodTable), whose size grows with pods, never
 *     with series; the index's change listener keeps it current;
 *   - splice the stamp in sorted position: the sender's labels of stamped names dropped,
 *     a series whose labels are already right left byte-exact, every other byte of the
 *     request copied as a span of the input.
 *
 * RW 2.0 series name strings by ref, so a series of a few bytes may name 64 KiB symbols:
 * whatever a series does to the strings themselves is done once per distinct symbol and
 * request (a pod key's per-string hashes memoized by ref: v2_key_part; long label names
 * ranked past a budget: v2_name_cmp), never once per series (docs/wire.md, "Work per
 * series, whatever the symbols' length").
 *
 * Concurrency: the table is guarded by a writer-preferring rwlock. A splice takes the
 * read lock (with the GIL released) for the duration of one request; table updates take
 * the write lock, also with the GIL released, so no thread ever waits for the lock while
 * holding the GIL and the two can never deadlock. Entries are immutable blocks: an update
 * swaps the slot's pointer under the write lock and frees the old block after.
 *
 * Memory: one malloc'd block per pod (key, RW 1.0 fields, label descriptors), and per
 * request only scratch arrays freed before return. Nothing outlives a request.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "_convert.h"
#include "_snappy_edit.h"
#include "_wire.h"

/* ------------------------------------------------------------------------------------ */
/* errors                                                                               */

static PyObject *DecodeErrorType = NULL; /* proxy.compression.DecodeError, set at import */

typedef struct {
    const char *kind; /* NULL: no error */
    int status;
    char message[768]; /* a refusal of a series' labels names it: up to ~600 bytes */
    int python; /* 1: a Python exception is already set (matcher callback) */
} Err;

static void
err_set(Err *e, const char *kind, const char *fmt, ...)
{
    if (e->kind != NULL)
        return;
    e->kind = kind;
    e->status = 400;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->message, sizeof e->message, fmt, ap);
    va_end(ap);
}

#define INVALID(e, ...) err_set((e), "protobuf_invalid", "invalid protobuf: " __VA_ARGS__)

static void
err_raise(Err *e)
{
    if (e->python)
        return;
    if (DecodeErrorType == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: %s", e->kind, e->message);
        return;
    }
    PyObject *exc = PyObject_CallFunction(DecodeErrorType, "sis", e->kind, e->status, e->message);
    if (exc != NULL) {
        PyErr_SetObject(DecodeErrorType, exc);
        Py_DECREF(exc);
    }
}

/* ------------------------------------------------------------------------------------ */
/* wire primitives                                                                      */

/* Read one field at pos, inside [.., end). Mirrors primitives.read_field. */
static int
rd_field(const uint8_t *buf, size_t pos, size_t end, Field *f, Err *e)
{
    switch (wire_field(buf, pos, end, f)) {
    case WIRE_OK:
        return 1;
    case WIRE_VARINT:
        INVALID(e, "truncated or over-long varint");
        return 0;
    case WIRE_NUMBER_0:
        INVALID(e, "field number 0");
        return 0;
    case WIRE_NUMBER:
        INVALID(e, "field number %llu is past 2^29 - 1", (unsigned long long)f->number);
        return 0;
    case WIRE_PAST_END:
        INVALID(e, "field runs past the end of its message");
        return 0;
    default:
        INVALID(e, "unsupported wire type %d", f->wt);
        return 0;
    }
}

static inline uint64_t
load64(const uint8_t *p)
{
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

/* True when every byte is ASCII (then the string is valid UTF-8): 8 bytes at a time, the
 * tail as one overlapping load. */
static inline int
ascii(const uint8_t *s, size_t n)
{
    const uint64_t hi = 0x8080808080808080ULL;
    if (n >= 8) {
        uint64_t acc = load64(s + n - 8);
        for (size_t i = 0; i + 8 <= n; i += 8)
            acc |= load64(s + i);
        return !(acc & hi);
    }
    uint8_t acc = 0;
    for (size_t i = 0; i < n; i++)
        acc |= s[i];
    return acc < 0x80;
}

static inline int
text_ok(const uint8_t *s, size_t n)
{
    return ascii(s, n) || utf8_ok(s, n);
}

/* A fast 64-bit hash of a byte string (multiply-xorshift over 8-byte words). */
static inline uint64_t
hash_bytes(const uint8_t *s, size_t n, uint64_t h)
{
    const uint64_t m = 0x9E3779B97F4A7C15ULL;
    h ^= (uint64_t)n * 0xff51afd7ed558ccdULL;
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, s, 8);
        h = (h ^ w) * m;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    if (n) {
        uint64_t w = 0;
        for (size_t i = 0; i < n; i++)
            w |= (uint64_t)s[i] << (8 * i);
        h = (h ^ w) * m;
        h ^= h >> 29;
    }
    h ^= h >> 32;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 29;
    return h;
}

/* SipHash-1-3 (Aumasson, Bernstein; the variant Python's str hash and Rust's HashMap use):
 * a keyed hash for the RW 2.0 symbol index of a request whose fast-hash index went over
 * its probe budget. Without the key (v2_sip_k0/k1, secret, per process) no set of
 * colliding strings can be made for it; hash_bytes, of the multiply-xorshift family, may
 * have seed-independent multicollisions. ~2x hash_bytes' cost: never on the normal path. */
#define ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                           \
    do {                                                                                   \
        v0 += v1; v1 = ROTL64(v1, 13); v1 ^= v0; v0 = ROTL64(v0, 32);                      \
        v2 += v3; v3 = ROTL64(v3, 16); v3 ^= v2;                                           \
        v0 += v3; v3 = ROTL64(v3, 21); v3 ^= v0;                                           \
        v2 += v1; v1 = ROTL64(v1, 17); v1 ^= v2; v2 = ROTL64(v2, 32);                      \
    } while (0)

static uint64_t
siphash13(uint64_t k0, uint64_t k1, const uint8_t *s, size_t n)
{
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    uint64_t b = (uint64_t)n << 56;
    while (n >= 8) {
        uint64_t m;
        memcpy(&m, s, 8);
        v3 ^= m;
        SIPROUND;
        v0 ^= m;
        s += 8;
        n -= 8;
    }
    for (size_t i = 0; i < n; i++)
        b |= (uint64_t)s[i] << (8 * i);
    v3 ^= b;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static inline int
str_cmp(const uint8_t *a, size_t an, const uint8_t *b, size_t bn)
{
    /* adjacent label names mostly differ in their first byte */
    if (an && bn && a[0] != b[0])
        return a[0] < b[0] ? -1 : 1;
    size_t k = an < bn ? an : bn;
    if (k >= 8) {
        /* the first eight bytes decide most comparisons of label names */
        uint64_t x = __builtin_bswap64(load64(a)), y = __builtin_bswap64(load64(b));
        if (x != y)
            return x < y ? -1 : 1;
        int c = memcmp(a + 8, b + 8, k - 8);
        if (c)
            return c;
    }
    else
        for (size_t i = 0; i < k; i++)
            if (a[i] != b[i])
                return a[i] < b[i] ? -1 : 1;
    return an < bn ? -1 : an > bn ? 1 : 0;
}

/* a == b for two strings of length n (short ones compared inline) */
static inline int
str_eq(const uint8_t *a, const uint8_t *b, size_t n)
{
    if (n >= 8) {
        if (load64(a) != load64(b) || load64(a + n - 8) != load64(b + n - 8))
            return 0;
        return n <= 16 || memcmp(a + 8, b + 8, n - 16) == 0;
    }
    for (size_t i = 0; i < n; i++)
        if (a[i] != b[i])
            return 0;
    return 1;
}

/* A label name of the proxy's own prefix (plan.KARTA_PREFIX). */
static inline int
is_karta(const uint8_t *s, size_t n)
{
    return n >= 6 && s[0] == 'k' && memcmp(s, "karta_", 6) == 0;
}

/* ------------------------------------------------------------------------------------ */
/* the payloads a splice copies: walked, never rewritten (primitives.check_*)           */


/* Every field's framing (rd_field's rules) and the wire types of the known ones. */
static int
check_fields(const uint8_t *raw, size_t p, size_t end, const int8_t *wts, uint64_t nk,
             const char *what, Err *e)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        if (f.number <= nk && wts[f.number - 1] >= 0 && f.wt != wts[f.number - 1]) {
            INVALID(e, "%s field %d with a wrong wire type", what, (int)f.number);
            return 0;
        }
        p = f.end;
    }
    return 1;
}


/* A Histogram (nk: 16 fields in RW 1.0, 17 in 2.0): framing, wire types, its spans'
 * framing, packed varints that parse, packed doubles of whole 8-byte values. */
static int
check_histogram(const uint8_t *raw, size_t p, size_t end, uint64_t nk, Err *e)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        int kind = f.number <= nk ? HISTOGRAM_WT[f.number - 1] : -1;
        int bad = 0;
        if (kind == H_SPANS) {
            if (f.wt != 2)
                bad = 1;
            else if (!check_fields(raw, f.ps, f.end, SPAN_WT, 2, "bucket span", e))
                return 0;
        }
        else if (kind == H_VARINTS || kind == H_DOUBLES) {
            if (f.wt == 2) {
                if (kind == H_DOUBLES && (f.end - f.ps) % 8) {
                    INVALID(e, "histogram field %d: packed doubles of %zu bytes",
                            (int)f.number, f.end - f.ps);
                    return 0;
                }
                for (size_t pp = f.ps; kind == H_VARINTS && pp < f.end;) {
                    uint64_t x;
                    if (!rd_varint(raw, f.end, &pp, &x)) {
                        INVALID(e, "packed varints run past their field");
                        return 0;
                    }
                }
            }
            else
                bad = f.wt != (kind == H_VARINTS ? 0 : 1);
        }
        else
            bad = kind != -1 && f.wt != kind;
        if (bad) {
            INVALID(e, "histogram field %d with a wrong wire type", (int)f.number);
            return 0;
        }
        p = f.end;
    }
    return 1;
}

/* A Sample (nk: 2 for RW 1.0, 3 for 2.0). The usual shape, `09 <8 bytes> 10 <varint of
 * at most 8 bytes>` ending the payload, is checked with one load: the varint's bytes
 * before its last have the top bit set, its last does not (the walk would accept exactly
 * that); anything else takes the general walk. */
static inline int
check_sample(const uint8_t *raw, size_t p, size_t end, uint64_t nk, Err *e)
{
    size_t len = end - p;
    if (len >= 11 && len <= 18 && raw[p] == 0x09 && raw[p + 9] == 0x10) {
        unsigned shift = 8u * (unsigned)(18 - len); /* the varint: the top 18 - len .. */
        uint64_t mask = 0x8080808080808080ULL << shift;
        uint64_t top = load64(raw + end - 8) & mask; /* end - 8 >= p + 3: inside */
        if (top == (mask & 0x0080808080808080ULL))
            return 1;
    }
    return check_fields(raw, p, end, SAMPLE_WT, nk, "sample", e);
}

/* An RW 2.0 Exemplar: framing; its label refs an even number, inside the table. */
static int
check_exemplar_v2(const uint8_t *raw, size_t p, size_t end, size_t nsym, Err *e)
{
    size_t count = 0;
    uint64_t top = 0;
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        if (f.number == 1) {
            uint64_t x = 0;
            size_t pp = f.ps;
            if (f.wt == 2) {
                while (pp < f.end) {
                    if (!rd_varint(raw, f.end, &pp, &x)) {
                        INVALID(e, "packed varints run past their field");
                        return 0;
                    }
                    count++;
                    top = x > top ? x : top;
                }
            }
            else if (f.wt == 0) {
                rd_varint(raw, f.end, &pp, &x); /* read by rd_field: cannot fail */
                count++;
                top = x > top ? x : top;
            }
            else {
                INVALID(e, "exemplar labels_refs with a wrong wire type");
                return 0;
            }
        }
        else if (f.number <= 3 && f.wt != EXEMPLAR_WT[f.number - 1]) {
            INVALID(e, "exemplar field %d with a wrong wire type", (int)f.number);
            return 0;
        }
        p = f.end;
    }
    if (count & 1) {
        INVALID(e, "exemplar labels_refs has an odd number of entries");
        return 0;
    }
    if (count && top >= nsym) {
        INVALID(e, "exemplar symbol reference %llu past the table of %zu",
                (unsigned long long)top, nsym);
        return 0;
    }
    return 1;
}

/* An RW 2.0 Metadata: framing; help_ref and unit_ref inside the table. */
static int
check_metadata_v2(const uint8_t *raw, size_t p, size_t end, size_t nsym, Err *e)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        if (f.number <= 4 && METADATA_V2_WT[f.number - 1] >= 0 &&
            f.wt != METADATA_V2_WT[f.number - 1]) {
            INVALID(e, "metadata field %d with a wrong wire type", (int)f.number);
            return 0;
        }
        if (f.number == 3 || f.number == 4) {
            uint64_t x = 0;
            size_t pp = f.ps;
            rd_varint(raw, f.end, &pp, &x);
            if (x >= nsym) {
                INVALID(e, "metadata symbol reference %llu past the table of %zu",
                        (unsigned long long)x, nsym);
                return 0;
            }
        }
        p = f.end;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------ */
/* growable scratch arrays (plain malloc: used with the GIL released)                   */

typedef struct {
    void *data;
    size_t len, cap, item;
    int failed;
} Vec;

static void
vec_init(Vec *v, size_t item)
{
    v->data = NULL;
    v->len = v->cap = 0;
    v->item = item;
    v->failed = 0;
}

static void *
vec_push(Vec *v, size_t k)
{
    if (v->len + k > v->cap) {
        size_t cap = v->cap ? v->cap : 64;
        while (cap < v->len + k)
            cap *= 2;
        void *d = realloc(v->data, cap * v->item);
        if (d == NULL) {
            v->failed = 1;
            return NULL;
        }
        v->data = d;
        v->cap = cap;
    }
    void *at = (char *)v->data + v->len * v->item;
    v->len += k;
    return at;
}

static void
vec_free(Vec *v)
{
    free(v->data);
    v->data = NULL;
    v->len = v->cap = 0;
}

/* Scratch bytes that never move once handed out (spans point into them). */
typedef struct Chunk {
    struct Chunk *next;
    size_t used, cap;
    uint8_t data[];
} Chunk;

typedef struct {
    Chunk *head;
    size_t bytes; /* held in chunks: counted against a request's limit */
    int failed;
} Arena;

static uint8_t *
arena_alloc(Arena *a, size_t n)
{
    if (a->head == NULL || a->head->cap - a->head->used < n) {
        size_t cap = n > 16384 ? n : 16384;
        Chunk *c = malloc(sizeof(Chunk) + cap);
        if (c == NULL) {
            a->failed = 1;
            return NULL;
        }
        c->next = a->head;
        c->used = 0;
        c->cap = cap;
        a->head = c;
        a->bytes += sizeof(Chunk) + cap;
    }
    uint8_t *p = a->head->data + a->head->used;
    a->head->used += n;
    return p;
}

static void
arena_free(Arena *a)
{
    while (a->head) {
        Chunk *n = a->head->next;
        free(a->head);
        a->head = n;
    }
}

/* ------------------------------------------------------------------------------------ */
/* the pod table                                                                        */

typedef struct {
    uint32_t field_off, field_len; /* the encoded RW 1.0 Label field, in the entry's bytes */
    uint32_t name_off, name_len;
    uint32_t value_off, value_len;
    uint64_t name_hash, value_hash; /* hash_bytes(.., table's v2_seed): RW 2.0 lookups */
} StampLabel;

/* The seed of the per-request RW 2.0 symbol index: secret, per process (getrandom at
 * module init), so a sender cannot compute strings that collide in it (with a fixed seed
 * the hash of an 8-byte string is an invertible function of it: 20k symbols in one bucket
 * made the index O(n^2), 0.4 s, and the limits allowed ~40 minutes a request). A table
 * takes it when made and hashes its stamp strings with it, so its entries' hashes are the
 * index's. _set_v2_seed (tests) changes it for tables made after. */
static uint64_t v2_seed;
/* The pod tables' key hash seed: secret, per process (getrandom at module init), each
 * table's own mixed in from its address. */
static uint64_t table_seed;
/* the key of the keyed fallback (siphash13), secret, per process */
static uint64_t v2_sip_k0, v2_sip_k1;

typedef struct {
    uint64_t hash;
    uint32_t ns_len, pod_len;
    int32_t reason; /* < 0: a stamp (STAMP_KARTA: every name starts with karta_, as the
                     * contract's do); else an index into the table's reasons */
    uint32_t nlabels;
    uint32_t fields_len;
    uint32_t labels_off; /* offset of the StampLabel array in data */
    /* the first and the last stamp name (offsets in data): where an RW 1.0 stamp goes in
     * is decided from the entry's hot part alone, without its StampLabel array */
    uint32_t first_off, first_len, last_off, last_len;
    uint8_t data[];      /* ns, pod, fields (the hot part), padding, StampLabel[nlabels] */
} Entry;

/* Entries are cache-line aligned, so an RW 1.0 lookup reads exactly the lines of the
 * entry's hot part: header, key and fields (~5 lines at real stamps, where the whole
 * entry with its StampLabel array is ~8). */
#define LINE 64
#define ENTRY_HOT_LINES(en) \
    ((sizeof(Entry) + (size_t)(en)->ns_len + (en)->pod_len + (en)->fields_len + LINE - 1) / LINE)

#define STAMP_KARTA (-2)

#define ENTRY_NS(en) ((en)->data)
#define ENTRY_POD(en) ((en)->data + (en)->ns_len)
#define ENTRY_FIELDS(en) ((en)->data + (en)->ns_len + (en)->pod_len)
#define ENTRY_LABELS(en) ((const StampLabel *)((en)->data + (en)->labels_off))

/* the splice's own reason of a series the stamp would push past the plan's label limit
 * (plan.REASON_LABEL_LIMIT): the pod table's third fixed reason */
#define REASON_LABEL_LIMIT 2
/* and of a series that names another cluster (plan.REASON_OTHER_CLUSTER): the fourth */
#define REASON_OTHER_CLUSTER 3

static Entry TOMB_ENTRY;
#define TOMB (&TOMB_ENTRY)

typedef struct {
    uint64_t hash;
    Entry *entry; /* NULL: empty; TOMB: deleted */
} Slot;

typedef struct {
    PyObject_HEAD
    pthread_rwlock_t lock;
    Slot *slots;
    size_t cap;   /* a power of two */
    size_t used;  /* live entries */
    size_t tombs; /* deleted slots */
    uint64_t seed;
    uint64_t v2_seed; /* v2_seed when made: its entries' StampLabel hashes */
    PyObject *reasons;   /* list of str, append-only; 0 no_pod_label, 1 pod_unknown,
                          * 2 label_limit (REASON_LABEL_LIMIT), 3 other_cluster */
    PyObject *reason_ix; /* dict str -> int */
} PodTable;

/* A pod's key hash is made of one hash per string, hash_bytes(.., t->seed) of the
 * namespace and of the pod, mixed (key_mix): RW 2.0 hashes each distinct symbol once per
 * request (v2_key_part) and mixes per series, so a series that names an L-byte pod costs
 * O(1), not O(L) (a 536 KB request of 64 KiB namespace and pod symbols cost 10.8 CPU-s
 * when the key was one hash chained over both strings). The multiply makes the mix
 * asymmetric ((a, b) and (b, a) differ); the secret seed is in both parts. */
static inline uint64_t
key_mix(uint64_t ns_hash, uint64_t pod_hash)
{
    uint64_t k = ns_hash * 0x9E3779B97F4A7C15ULL ^ pod_hash;
    k ^= k >> 32;
    k *= 0xd6e8feb86659fd93ULL;
    return k ^ (k >> 32);
}

static inline uint64_t
key_hash(const PodTable *t, const uint8_t *ns, size_t nsl, const uint8_t *pod, size_t podl)
{
    return key_mix(hash_bytes(ns, nsl, t->seed), hash_bytes(pod, podl, t->seed));
}

/* The slot of (ns, pod), or NULL. Read lock (or write lock) held. */
static inline const Entry *
table_find(const PodTable *t, uint64_t h, const uint8_t *ns, size_t nsl, const uint8_t *pod,
           size_t podl)
{
    if (t->cap == 0)
        return NULL;
    size_t mask = t->cap - 1;
    size_t i = (size_t)h & mask;
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->entry == NULL)
            return NULL;
        if (s->hash == h && s->entry != TOMB) {
            const Entry *en = s->entry;
            if (en->ns_len == nsl && en->pod_len == podl && str_eq(ENTRY_NS(en), ns, nsl) &&
                str_eq(ENTRY_POD(en), pod, podl))
                return en;
        }
        i = (i + 1) & mask;
    }
}

/* Grow or clean the slot array when live + deleted slots pass half of it. Write lock. */
static int
table_reserve(PodTable *t, size_t more)
{
    if ((t->used + t->tombs + more) * 2 <= t->cap)
        return 1;
    size_t cap = 64;
    while ((t->used + more) * 2 > cap)
        cap *= 2;
    Slot *slots = calloc(cap, sizeof(Slot));
    if (slots == NULL)
        return 0;
    for (size_t i = 0; i < t->cap; i++) {
        Entry *en = t->slots[i].entry;
        if (en == NULL || en == TOMB)
            continue;
        size_t j = (size_t)t->slots[i].hash & (cap - 1);
        while (slots[j].entry != NULL)
            j = (j + 1) & (cap - 1);
        slots[j] = t->slots[i];
    }
    free(t->slots);
    t->slots = slots;
    t->cap = cap;
    t->tombs = 0;
    return 1;
}

/* Put (replace) or remove (en == NULL) the entry of key; returns the old entry to free
 * once the lock is released. Write lock held; table_reserve(1) done for a put. */
static Entry *
table_put(PodTable *t, uint64_t h, const uint8_t *ns, size_t nsl, const uint8_t *pod,
          size_t podl, Entry *en)
{
    size_t mask = t->cap - 1;
    size_t i = (size_t)h & mask;
    size_t tomb = (size_t)-1;
    for (;;) {
        Slot *s = &t->slots[i];
        if (s->entry == NULL)
            break;
        if (s->entry == TOMB) {
            if (tomb == (size_t)-1)
                tomb = i;
        }
        else if (s->hash == h) {
            Entry *old = s->entry;
            if (old->ns_len == nsl && old->pod_len == podl &&
                memcmp(ENTRY_NS(old), ns, nsl) == 0 && memcmp(ENTRY_POD(old), pod, podl) == 0) {
                if (en != NULL)
                    s->entry = en;
                else {
                    s->entry = TOMB;
                    t->used--;
                    t->tombs++;
                }
                return old;
            }
        }
        i = (i + 1) & mask;
    }
    if (en == NULL)
        return NULL;
    if (tomb != (size_t)-1) {
        i = tomb;
        t->tombs--;
    }
    t->slots[i].hash = h;
    t->slots[i].entry = en;
    t->used++;
    return NULL;
}

static int
reason_index(PodTable *t, PyObject *reason)
{
    PyObject *ix = PyDict_GetItemWithError(t->reason_ix, reason);
    if (ix != NULL)
        return (int)PyLong_AsLong(ix);
    if (PyErr_Occurred())
        return -1;
    Py_ssize_t n = PyList_GET_SIZE(t->reasons);
    if (n >= 1 << 20) {
        PyErr_SetString(PyExc_ValueError, "too many distinct reasons");
        return -1;
    }
    PyObject *num = PyLong_FromSsize_t(n);
    if (num == NULL)
        return -1;
    int rc = PyDict_SetItem(t->reason_ix, reason, num);
    Py_DECREF(num);
    if (rc < 0 || PyList_Append(t->reasons, reason) < 0)
        return -1;
    return (int)n;
}

static int
as_bytes(PyObject *o, const uint8_t **s, Py_ssize_t *n, const char *what)
{
    if (!PyBytes_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.80s", what, Py_TYPE(o)->tp_name);
        return 0;
    }
    *s = (const uint8_t *)PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    return 1;
}

/* A new entry for (ns, pod) -> answer: a tuple of (name, value) str pairs, or a reason. */
static Entry *
entry_new(PodTable *t, PyObject *nso, PyObject *podo, PyObject *answer)
{
    const uint8_t *ns, *pod;
    Py_ssize_t nsl, podl;
    if (!as_bytes(nso, &ns, &nsl, "namespace") || !as_bytes(podo, &pod, &podl, "pod"))
        return NULL;
    if (nsl > UINT32_MAX / 4 || podl > UINT32_MAX / 4) {
        PyErr_SetString(PyExc_ValueError, "namespace or pod too long");
        return NULL;
    }
    int reason = -1;
    Py_ssize_t nl = 0;
    PyObject *labels = NULL; /* list of (name bytes, value bytes) sorted by name */
    size_t fields_len = 0;
    if (PyUnicode_Check(answer)) {
        if (PyUnicode_GET_LENGTH(answer) == 0) {
            PyErr_SetString(PyExc_ValueError, "a reason must not be empty");
            return NULL;
        }
        reason = reason_index(t, answer);
        if (reason < 0)
            return NULL;
    }
    else {
        PyObject *seq = PySequence_Fast(answer, "an answer is a tuple of (name, value) pairs or a reason");
        if (seq == NULL)
            return NULL;
        labels = PyList_New(0);
        if (labels == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
            PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
            PyObject *n, *v;
            if (!PyArg_ParseTuple(pair, "UU;a stamped label is a (name, value) pair of str", &n, &v))
                goto fail;
            if (PyUnicode_GET_LENGTH(v) == 0)
                continue; /* empty values are left out, as PodStamp.of does */
            PyObject *nb = PyUnicode_AsUTF8String(n), *vb = PyUnicode_AsUTF8String(v);
            if (nb == NULL || vb == NULL) {
                Py_XDECREF(nb);
                Py_XDECREF(vb);
                goto fail;
            }
            PyObject *tup = PyTuple_Pack(2, nb, vb);
            Py_DECREF(nb);
            Py_DECREF(vb);
            if (tup == NULL || PyList_Append(labels, tup) < 0) {
                Py_XDECREF(tup);
                goto fail;
            }
            Py_DECREF(tup);
        }
        Py_DECREF(seq);
        seq = NULL;
        if (PyList_Sort(labels) < 0)
            goto fail;
        nl = PyList_GET_SIZE(labels);
        for (Py_ssize_t i = 0; i < nl; i++) {
            PyObject *tup = PyList_GET_ITEM(labels, i);
            size_t n = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(tup, 0));
            size_t v = (size_t)PyBytes_GET_SIZE(PyTuple_GET_ITEM(tup, 1));
            size_t inner = 1 + varint_len(n) + n + 1 + varint_len(v) + v;
            fields_len += 1 + varint_len(inner) + inner;
        }
        if (fields_len > UINT32_MAX / 4) {
            PyErr_SetString(PyExc_ValueError, "stamp too long");
            goto fail;
        }
        goto build;
    fail:
        Py_XDECREF(seq);
        Py_DECREF(labels);
        return NULL;
    }
build:;
    size_t head = (size_t)nsl + (size_t)podl + fields_len;
    size_t labels_off = (head + 7) & ~(size_t)7;
    size_t total = sizeof(Entry) + labels_off + (size_t)nl * sizeof(StampLabel);
    Entry *en = aligned_alloc(LINE, (total + LINE - 1) / LINE * LINE);
    if (en == NULL) {
        Py_XDECREF(labels);
        PyErr_NoMemory();
        return NULL;
    }
    en->hash = key_hash(t, ns, (size_t)nsl, pod, (size_t)podl);
    en->ns_len = (uint32_t)nsl;
    en->pod_len = (uint32_t)podl;
    en->reason = reason;
    en->nlabels = (uint32_t)nl;
    en->fields_len = (uint32_t)fields_len;
    en->labels_off = (uint32_t)labels_off;
    en->first_off = en->first_len = en->last_off = en->last_len = 0;
    memcpy(en->data, ns, (size_t)nsl);
    memcpy(en->data + nsl, pod, (size_t)podl);
    uint8_t *f = en->data + nsl + podl;
    StampLabel *sl = (StampLabel *)(en->data + labels_off);
    size_t off = 0;
    for (Py_ssize_t i = 0; i < nl; i++) {
        PyObject *tup = PyList_GET_ITEM(labels, i);
        PyObject *nb = PyTuple_GET_ITEM(tup, 0), *vb = PyTuple_GET_ITEM(tup, 1);
        size_t n = (size_t)PyBytes_GET_SIZE(nb), v = (size_t)PyBytes_GET_SIZE(vb);
        size_t inner = 1 + varint_len(n) + n + 1 + varint_len(v) + v;
        size_t start = off;
        f[off++] = 0x0A;
        off += put_varint(f + off, inner);
        f[off++] = 0x0A;
        off += put_varint(f + off, n);
        sl[i].name_off = (uint32_t)(nsl + podl + off);
        sl[i].name_len = (uint32_t)n;
        memcpy(f + off, PyBytes_AS_STRING(nb), n);
        off += n;
        f[off++] = 0x12;
        off += put_varint(f + off, v);
        sl[i].value_off = (uint32_t)(nsl + podl + off);
        sl[i].value_len = (uint32_t)v;
        memcpy(f + off, PyBytes_AS_STRING(vb), v);
        off += v;
        sl[i].field_off = (uint32_t)(nsl + podl + start);
        sl[i].field_len = (uint32_t)(off - start);
        sl[i].name_hash = hash_bytes((const uint8_t *)PyBytes_AS_STRING(nb), n, t->v2_seed);
        sl[i].value_hash = hash_bytes((const uint8_t *)PyBytes_AS_STRING(vb), v, t->v2_seed);
        if (i == 0) {
            en->first_off = sl[i].name_off;
            en->first_len = sl[i].name_len;
        }
        en->last_off = sl[i].name_off;
        en->last_len = sl[i].name_len;
        if (i == 0 && reason == -1)
            en->reason = STAMP_KARTA;
        if (!is_karta(en->data + sl[i].name_off, n))
            en->reason = -1;
    }
    Py_XDECREF(labels);
    return en;
}

typedef struct {
    Entry *entry; /* NULL: delete */
    PyObject *ns, *pod;
} Change;

/* Apply changes under one write lock; takes ownership of the entries. */
static int
table_apply(PodTable *t, Change *ch, size_t n)
{
    Entry **old = calloc(n ? n : 1, sizeof(Entry *));
    if (old == NULL) {
        for (size_t i = 0; i < n; i++)
            free(ch[i].entry);
        PyErr_NoMemory();
        return 0;
    }
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    if (!table_reserve(t, n))
        ok = 0;
    else {
        for (size_t i = 0; i < n; i++) {
            const uint8_t *ns = (const uint8_t *)PyBytes_AS_STRING(ch[i].ns);
            const uint8_t *pod = (const uint8_t *)PyBytes_AS_STRING(ch[i].pod);
            size_t nsl = (size_t)PyBytes_GET_SIZE(ch[i].ns), podl = (size_t)PyBytes_GET_SIZE(ch[i].pod);
            uint64_t h = ch[i].entry ? ch[i].entry->hash : key_hash(t, ns, nsl, pod, podl);
            old[i] = table_put(t, h, ns, nsl, pod, podl, ch[i].entry);
        }
    }
    pthread_rwlock_unlock(&t->lock);
    Py_END_ALLOW_THREADS
    if (!ok) {
        for (size_t i = 0; i < n; i++)
            free(ch[i].entry);
        free(old);
        PyErr_NoMemory();
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        free(old[i]);
    free(old);
    return 1;
}

static PyObject *
PodTable_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (!PyArg_ParseTuple(args, ":PodTable") || (kw && PyDict_Size(kw))) {
        PyErr_SetString(PyExc_TypeError, "PodTable() takes no arguments");
        return NULL;
    }
    PodTable *t = (PodTable *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    pthread_rwlockattr_t attr;
    pthread_rwlockattr_init(&attr);
#ifdef __GLIBC__
    /* an enum in glibc, not a macro: without it readers that overlap starve the writer */
    pthread_rwlockattr_setkind_np(&attr, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
#endif
    pthread_rwlock_init(&t->lock, &attr);
    pthread_rwlockattr_destroy(&attr);
    t->slots = NULL;
    t->cap = t->used = t->tombs = 0;
    /* secret as the RW 2.0 index's: pod names come from anyone who may create pods, and
     * names made to share a bucket would lengthen every lookup's probe in this table */
    t->seed = table_seed ^ ((uint64_t)(uintptr_t)t * 0x9E3779B97F4A7C15ULL);
    t->v2_seed = v2_seed;
    t->reasons = PyList_New(0);
    t->reason_ix = PyDict_New();
    if (t->reasons == NULL || t->reason_ix == NULL) {
        Py_DECREF(t);
        return NULL;
    }
    const char *fixed[] = {"no_pod_label", "pod_unknown", "label_limit", "other_cluster"};
    for (int i = 0; i < 4; i++) {
        PyObject *s = PyUnicode_FromString(fixed[i]);
        if (s == NULL || reason_index(t, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(t);
            return NULL;
        }
        Py_DECREF(s);
    }
    return (PyObject *)t;
}

static void
table_free_entries(PodTable *t)
{
    for (size_t i = 0; i < t->cap; i++)
        if (t->slots[i].entry != NULL && t->slots[i].entry != TOMB)
            free(t->slots[i].entry);
    free(t->slots);
    t->slots = NULL;
    t->cap = t->used = t->tombs = 0;
}

static void
PodTable_dealloc(PodTable *t)
{
    table_free_entries(t);
    pthread_rwlock_destroy(&t->lock);
    Py_XDECREF(t->reasons);
    Py_XDECREF(t->reason_ix);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int
check_key(PyObject *ns, PyObject *pod)
{
    if (!PyBytes_Check(ns) || !PyBytes_Check(pod)) {
        PyErr_SetString(PyExc_TypeError, "namespace and pod must be bytes");
        return 0;
    }
    return 1;
}

static PyObject *
PodTable_set(PodTable *t, PyObject *args)
{
    PyObject *ns, *pod, *answer;
    if (!PyArg_ParseTuple(args, "OOO:set", &ns, &pod, &answer) || !check_key(ns, pod))
        return NULL;
    Change c = {entry_new(t, ns, pod, answer), ns, pod};
    if (c.entry == NULL || !table_apply(t, &c, 1))
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
PodTable_delete(PodTable *t, PyObject *args)
{
    PyObject *ns, *pod;
    if (!PyArg_ParseTuple(args, "OO:delete", &ns, &pod) || !check_key(ns, pod))
        return NULL;
    Change c = {NULL, ns, pod};
    if (!table_apply(t, &c, 1))
        return NULL;
    Py_RETURN_NONE;
}

/* The keys' references of changes made by PodTable_update (NULL where none was taken),
 * and the array. */
static void
changes_release(Change *ch, Py_ssize_t n)
{
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_XDECREF(ch[j].ns);
        Py_XDECREF(ch[j].pod);
    }
    free(ch);
}

static PyObject *
PodTable_update(PodTable *t, PyObject *arg)
{
    PyObject *seq = PySequence_Fast(arg, "update() takes a sequence of (ns, pod, answer)");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Change *ch = calloc(n ? (size_t)n : 1, sizeof(Change));
    if (ch == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    Py_ssize_t i;
    for (i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i), *ns, *pod, *answer;
        if (!PyArg_ParseTuple(item, "OOO;a change is (namespace, pod, answer or None)", &ns, &pod,
                              &answer) ||
            !check_key(ns, pod))
            goto fail;
        /* owned: table_apply reads them with the GIL released, and PySequence_Fast
         * gives a list back as it is, whose items another thread may drop meanwhile */
        ch[i].ns = Py_NewRef(ns);
        ch[i].pod = Py_NewRef(pod);
        if (answer != Py_None && (ch[i].entry = entry_new(t, ns, pod, answer)) == NULL)
            goto fail;
    }
    int ok = table_apply(t, ch, (size_t)n);
    changes_release(ch, n);
    Py_DECREF(seq);
    if (!ok)
        return NULL;
    Py_RETURN_NONE;
fail:
    for (Py_ssize_t j = 0; j <= i && j < n; j++)
        free(ch[j].entry);
    changes_release(ch, n);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *
PodTable_get(PodTable *t, PyObject *args)
{
    PyObject *nso, *podo;
    if (!PyArg_ParseTuple(args, "OO:get", &nso, &podo) || !check_key(nso, podo))
        return NULL;
    const uint8_t *ns = (const uint8_t *)PyBytes_AS_STRING(nso);
    const uint8_t *pod = (const uint8_t *)PyBytes_AS_STRING(podo);
    size_t nsl = (size_t)PyBytes_GET_SIZE(nso), podl = (size_t)PyBytes_GET_SIZE(podo);
    PyObject *out = NULL;
    int reason = -2;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_rdlock(&t->lock);
    Py_END_ALLOW_THREADS
    /* holding the read lock with the GIL is fine here: nothing below waits */
    const Entry *en = table_find(t, key_hash(t, ns, nsl, pod, podl), ns, nsl, pod, podl);
    if (en == NULL)
        out = Py_NewRef(Py_None);
    else if (en->reason >= 0)
        reason = en->reason;
    else {
        out = PyTuple_New(en->nlabels);
        const StampLabel *sl = ENTRY_LABELS(en);
        for (uint32_t i = 0; out != NULL && i < en->nlabels; i++) {
            PyObject *p = Py_BuildValue("(y#y#)", en->data + sl[i].name_off, (Py_ssize_t)sl[i].name_len,
                                        en->data + sl[i].value_off, (Py_ssize_t)sl[i].value_len);
            if (p == NULL)
                Py_CLEAR(out);
            else
                PyTuple_SET_ITEM(out, i, p);
        }
    }
    pthread_rwlock_unlock(&t->lock);
    if (reason >= 0)
        out = Py_NewRef(PyList_GET_ITEM(t->reasons, reason));
    return out;
}

static PyObject *
PodTable_clear(PodTable *t, PyObject *Py_UNUSED(ignored))
{
    Slot *slots;
    size_t cap;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_wrlock(&t->lock);
    slots = t->slots;
    cap = t->cap;
    t->slots = NULL;
    t->cap = t->used = t->tombs = 0;
    pthread_rwlock_unlock(&t->lock);
    Py_END_ALLOW_THREADS
    for (size_t i = 0; i < cap; i++)
        if (slots[i].entry != NULL && slots[i].entry != TOMB)
            free(slots[i].entry);
    free(slots);
    Py_RETURN_NONE;
}

static Py_ssize_t
PodTable_len(PodTable *t)
{
    /* under the read lock: writers change it with the GIL released */
    size_t used;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_rdlock(&t->lock);
    used = t->used;
    pthread_rwlock_unlock(&t->lock);
    Py_END_ALLOW_THREADS
    return (Py_ssize_t)used;
}

static PyObject *
PodTable_memory(PodTable *t, PyObject *Py_UNUSED(ignored))
{
    /* bytes held by the table: slots and entry blocks */
    size_t total;
    Py_BEGIN_ALLOW_THREADS
    pthread_rwlock_rdlock(&t->lock);
    total = t->cap * sizeof(Slot);
    for (size_t i = 0; i < t->cap; i++) {
        const Entry *en = t->slots[i].entry;
        if (en != NULL && en != TOMB)
            total += (sizeof(Entry) + en->labels_off + en->nlabels * sizeof(StampLabel) +
                      LINE - 1) / LINE * LINE; /* as allocated: whole cache lines */
    }
    pthread_rwlock_unlock(&t->lock);
    Py_END_ALLOW_THREADS
    return PyLong_FromSize_t(total);
}

static PyMethodDef PodTable_methods[] = {
    {"set", (PyCFunction)PodTable_set, METH_VARARGS,
     "set(namespace, pod, answer): answer is the stamped (name, value) pairs or a reason"},
    {"delete", (PyCFunction)PodTable_delete, METH_VARARGS, "delete(namespace, pod)"},
    {"update", (PyCFunction)PodTable_update, METH_O,
     "update([(namespace, pod, answer or None), ...]) under one write lock"},
    {"get", (PyCFunction)PodTable_get, METH_VARARGS,
     "get(namespace, pod) -> ((name, value), ...) as bytes, a reason, or None"},
    {"clear", (PyCFunction)PodTable_clear, METH_NOARGS, "remove every pod"},
    {"memory", (PyCFunction)PodTable_memory, METH_NOARGS, "bytes held by the table"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods PodTable_as_sequence = {
    .sq_length = (lenfunc)PodTable_len,
};

static PyObject *
PodTable_implementation(PyObject *Py_UNUSED(self), void *Py_UNUSED(closure))
{
    return PyUnicode_FromString("native");
}

static PyGetSetDef PodTable_getset[] = {
    {"implementation", PodTable_implementation, NULL, "which table this is", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PodTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.wire._splice.PodTable",
    .tp_basicsize = sizeof(PodTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "(namespace, pod) -> stamp or reason; guarded by a writer-preferring rwlock",
    .tp_new = PodTable_new,
    .tp_dealloc = (destructor)PodTable_dealloc,
    .tp_methods = PodTable_methods,
    .tp_getset = PodTable_getset,
    .tp_as_sequence = &PodTable_as_sequence,
};

/* ------------------------------------------------------------------------------------ */
/* the plan                                                                             */

/* Label names a plan reads (its pairs, unless labels, __name__, the stamped names);
 * proxy/wire/native.py refuses larger plans with a clear error before they get here. */
#define MAX_SLOTS 1024
#define BUCKETS 4096
#define PER_BUCKET 8
#define BUCKET_FULL (-2)
#define FLAG_STAMPED 1

typedef struct {
    const uint8_t *s;
    size_t n;
} Str;

typedef struct {
    int slot;
    size_t nlit;
    Str *lits;
    PyObject *matcher; /* callable(value: bytes) -> bool, when not literals */
} UnlessC;

typedef struct {
    int ns_slot, pod_slot;
    size_t nunless;
    UnlessC *unless;
} PairC;

typedef struct {
    Str prefix;
    size_t npairs;
    PairC *pairs;
} RuleC;

typedef struct {
    PyObject_HEAD
    PyObject *keep; /* a list holding every object the plan points into */
    Str names[MAX_SLOTS];
    uint8_t flags[MAX_SLOTS];
    int nslots;
    uint64_t len_mask; /* bit k: some wanted name has length k (k < 64) */
    int long_names;    /* some wanted name is 64 bytes or longer */
    int16_t bucket[BUCKETS][PER_BUCKET]; /* name hash -> candidate slots, -1 terminated */
    size_t npairs;
    PairC *pairs;
    size_t nrules;
    RuleC *rules;
    int keep_sent;
    int drop_sent; /* sender_karta_labels: drop (plan.SplicePlan.drop_sent) */
    int has_matcher;
    /* plan.SplicePlan.max_labels, SIZE_MAX for its 0 (no limit): a stamped series within
     * it costs one compare (its labels + the stamp's, counts the splice has), no more */
    size_t max_labels;
    /* plan.SplicePlan.cluster: the cluster label's slot (-1: no check) and the proxy's
     * value of it. The name is one of the plan's slots, so the walk finds it in the name
     * lookup it does for every label anyway; the check is then one compare per series */
    int cluster_slot;
    Str cluster_value;
} Plan;

#define SLOT_NAME 0
#define SLOT_WORKLOAD 1

/* The bucket of a (non-empty) label name: length and first and last bytes. */
static inline size_t
name_bucket(const uint8_t *s, size_t n)
{
    return (n * 131u + (size_t)s[0] * 31u + (size_t)s[n / 2] * 7u + s[n - 1]) & (BUCKETS - 1);
}

static int
plan_slot(Plan *pl, PyObject *name, int flags)
{
    const uint8_t *s;
    Py_ssize_t n;
    if (!as_bytes(name, &s, &n, "a label name"))
        return -1;
    for (int i = 0; i < pl->nslots; i++)
        if (pl->names[i].n == (size_t)n && memcmp(pl->names[i].s, s, (size_t)n) == 0) {
            pl->flags[i] |= (uint8_t)flags;
            return i;
        }
    if (pl->nslots >= MAX_SLOTS) {
        PyErr_Format(PyExc_ValueError, "a plan reads at most %d distinct label names", MAX_SLOTS);
        return -1;
    }
    if (PyList_Append(pl->keep, name) < 0)
        return -1;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "a label name must not be empty");
        return -1;
    }
    int16_t *b = pl->bucket[name_bucket(s, (size_t)n)];
    int k = 0;
    while (k < PER_BUCKET && b[k] >= 0)
        k++;
    int i = pl->nslots++;
    if (k < PER_BUCKET - 1)
        b[k] = (int16_t)i;
    else
        b[PER_BUCKET - 1] = BUCKET_FULL; /* the names of a full bucket are found by a scan */
    pl->names[i].s = s;
    pl->names[i].n = (size_t)n;
    pl->flags[i] = (uint8_t)flags;
    if (n < 64)
        pl->len_mask |= (uint64_t)1 << n;
    else
        pl->long_names = 1;
    return i;
}

/* pairs: [(ns bytes, pod bytes, [(label bytes, literals tuple | None, matcher | None)])] */
static int
plan_pairs(Plan *pl, PyObject *seq_in, PairC **out, size_t *nout)
{
    PyObject *seq = PySequence_Fast(seq_in, "pairs must be a sequence");
    if (seq == NULL)
        return 0;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    *out = PyMem_Calloc(n ? (size_t)n : 1, sizeof(PairC));
    *nout = (size_t)n;
    if (*out == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *ns, *pod, *unless;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OOO;a pair is (ns, pod, unless)", &ns,
                              &pod, &unless))
            goto fail;
        PairC *p = &(*out)[i];
        if ((p->ns_slot = plan_slot(pl, ns, 0)) < 0 || (p->pod_slot = plan_slot(pl, pod, 0)) < 0)
            goto fail;
        PyObject *us = PySequence_Fast(unless, "unless must be a sequence");
        if (us == NULL)
            goto fail;
        Py_ssize_t nu = PySequence_Fast_GET_SIZE(us);
        p->unless = PyMem_Calloc(nu ? (size_t)nu : 1, sizeof(UnlessC));
        p->nunless = (size_t)nu;
        if (p->unless == NULL) {
            Py_DECREF(us);
            PyErr_NoMemory();
            goto fail;
        }
        for (Py_ssize_t j = 0; j < nu; j++) {
            PyObject *label, *lits, *matcher;
            UnlessC *u = &p->unless[j];
            if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(us, j), "OOO;unless is (label, literals, matcher)",
                                  &label, &lits, &matcher) ||
                (u->slot = plan_slot(pl, label, 0)) < 0) {
                Py_DECREF(us);
                goto fail;
            }
            if (lits != Py_None) {
                PyObject *ls = PySequence_Fast(lits, "literals must be a sequence");
                if (ls == NULL || PyList_Append(pl->keep, ls) < 0) {
                    Py_XDECREF(ls);
                    Py_DECREF(us);
                    goto fail;
                }
                Py_DECREF(ls); /* kept alive by pl->keep */
                Py_ssize_t nl = PySequence_Fast_GET_SIZE(ls);
                u->lits = PyMem_Calloc(nl ? (size_t)nl : 1, sizeof(Str));
                u->nlit = (size_t)nl;
                if (u->lits == NULL) {
                    Py_DECREF(us);
                    PyErr_NoMemory();
                    goto fail;
                }
                for (Py_ssize_t k = 0; k < nl; k++) {
                    Py_ssize_t ln;
                    if (!as_bytes(PySequence_Fast_GET_ITEM(ls, k), &u->lits[k].s, &ln, "a literal")) {
                        Py_DECREF(us);
                        goto fail;
                    }
                    u->lits[k].n = (size_t)ln;
                }
            }
            else {
                if (!PyCallable_Check(matcher)) {
                    PyErr_SetString(PyExc_TypeError, "an unless without literals needs a matcher");
                    Py_DECREF(us);
                    goto fail;
                }
                if (PyList_Append(pl->keep, matcher) < 0) {
                    Py_DECREF(us);
                    goto fail;
                }
                u->matcher = matcher;
                pl->has_matcher = 1;
            }
        }
        Py_DECREF(us);
    }
    Py_DECREF(seq);
    return 1;
fail:
    Py_DECREF(seq);
    return 0;
}

static void
free_pairs(PairC *pairs, size_t n)
{
    if (pairs == NULL)
        return;
    for (size_t i = 0; i < n; i++) {
        if (pairs[i].unless) {
            for (size_t j = 0; j < pairs[i].nunless; j++)
                PyMem_Free(pairs[i].unless[j].lits);
            PyMem_Free(pairs[i].unless);
        }
    }
    PyMem_Free(pairs);
}

static void
Plan_dealloc(Plan *pl)
{
    free_pairs(pl->pairs, pl->npairs);
    if (pl->rules) {
        for (size_t i = 0; i < pl->nrules; i++)
            free_pairs(pl->rules[i].pairs, pl->rules[i].npairs);
        PyMem_Free(pl->rules);
    }
    Py_XDECREF(pl->keep);
    Py_TYPE(pl)->tp_free((PyObject *)pl);
}

static PyObject *
Plan_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"pairs", "rules", "keep_sent", "stamped", "workload_label",
                             "drop_sent", "max_labels", "cluster", NULL};
    PyObject *pairs, *rules, *stamped, *workload, *cluster = Py_None;
    int keep_sent, drop_sent = 1;
    Py_ssize_t max_labels = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOpOO|pnO:Plan", kwlist, &pairs, &rules,
                                     &keep_sent, &stamped, &workload, &drop_sent, &max_labels,
                                     &cluster))
        return NULL;
    if (max_labels < 0) {
        PyErr_SetString(PyExc_ValueError, "max_labels must be 0 (no limit) or more");
        return NULL;
    }
    Plan *pl = (Plan *)type->tp_alloc(type, 0);
    if (pl == NULL)
        return NULL;
    memset(pl->bucket, 0xff, sizeof pl->bucket);
    pl->keep = PyList_New(0);
    if (pl->keep == NULL)
        goto fail;
    pl->keep_sent = keep_sent;
    pl->drop_sent = drop_sent;
    pl->max_labels = max_labels ? (size_t)max_labels : SIZE_MAX;
    pl->cluster_slot = -1;
    PyObject *name = PyBytes_FromString("__name__");
    if (name == NULL)
        goto fail;
    int s0 = plan_slot(pl, name, 0);
    Py_DECREF(name);
    if (s0 != SLOT_NAME)
        goto fail; /* (out of memory: set) */
    if (plan_slot(pl, workload, 0) != SLOT_WORKLOAD) {
        if (!PyErr_Occurred()) /* it found __name__'s slot */
            PyErr_SetString(PyExc_ValueError, "workload_label must not be __name__");
        goto fail;
    }
    PyObject *st = PySequence_Fast(stamped, "stamped must be a collection of bytes");
    if (st == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(st); i++)
        if (plan_slot(pl, PySequence_Fast_GET_ITEM(st, i), FLAG_STAMPED) < 0) {
            Py_DECREF(st);
            goto fail;
        }
    Py_DECREF(st);
    if (cluster != Py_None) {
        /* (label, value): both non-empty, the label neither __name__ nor karta_*
         * (plan.SplicePlan checks the same) */
        PyObject *cname, *cvalue;
        Py_ssize_t cn;
        if (!PyArg_ParseTuple(cluster, "OO;cluster is (label, value)", &cname, &cvalue) ||
            !as_bytes(cvalue, &pl->cluster_value.s, &cn, "the cluster value") ||
            PyList_Append(pl->keep, cvalue) < 0)
            goto fail;
        pl->cluster_value.n = (size_t)cn;
        const uint8_t *ls;
        Py_ssize_t ln;
        if (!as_bytes(cname, &ls, &ln, "the cluster label"))
            goto fail;
        if (ln == 0 || cn == 0 || is_karta(ls, (size_t)ln) ||
            ((size_t)ln == 8 && memcmp(ls, "__name__", 8) == 0)) {
            PyErr_SetString(PyExc_ValueError, "the cluster check needs a label name (not "
                                              "__name__ nor karta_*) and a value");
            goto fail;
        }
        if ((pl->cluster_slot = plan_slot(pl, cname, 0)) < 0)
            goto fail;
    }
    if (!plan_pairs(pl, pairs, &pl->pairs, &pl->npairs))
        goto fail;
    if (pl->npairs == 0) {
        PyErr_SetString(PyExc_ValueError, "a splice plan needs at least one (namespace, pod) pair");
        goto fail;
    }
    PyObject *rs = PySequence_Fast(rules, "rules must be a sequence");
    if (rs == NULL)
        goto fail;
    Py_ssize_t nr = PySequence_Fast_GET_SIZE(rs);
    pl->rules = PyMem_Calloc(nr ? (size_t)nr : 1, sizeof(RuleC));
    pl->nrules = (size_t)nr;
    if (pl->rules == NULL) {
        Py_DECREF(rs);
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *prefix, *rpairs;
        Py_ssize_t pn;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(rs, i), "OO;a rule is (prefix, pairs)", &prefix,
                              &rpairs) ||
            !as_bytes(prefix, &pl->rules[i].prefix.s, &pn, "a metric prefix") ||
            PyList_Append(pl->keep, prefix) < 0 ||
            !plan_pairs(pl, rpairs, &pl->rules[i].pairs, &pl->rules[i].npairs)) {
            Py_DECREF(rs);
            goto fail;
        }
        pl->rules[i].prefix.n = (size_t)pn;
    }
    Py_DECREF(rs);
    return (PyObject *)pl;
fail:
    Py_DECREF(pl);
    return NULL;
}

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "proxy.wire._splice.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Plan(pairs, rules, keep_sent, stamped, workload_label, drop_sent=True, "
              "max_labels=0, cluster=None): a compiled SplicePlan",
    .tp_new = Plan_new,
    .tp_dealloc = (destructor)Plan_dealloc,
};

/* The slot of a label name, or -1: a length mask, then one bucket of candidates. */
static inline int
slot_of(const Plan *pl, const uint8_t *s, size_t n)
{
    if (n < 64) {
        if (!((pl->len_mask >> n) & 1))
            return -1;
    }
    else if (!pl->long_names)
        return -1;
    const int16_t *b = pl->bucket[name_bucket(s, n)];
    for (int k = 0; k < PER_BUCKET && b[k] != -1; k++) {
        if (b[k] == BUCKET_FULL) {
            for (int i = 0; i < pl->nslots; i++)
                if (pl->names[i].n == n && str_eq(pl->names[i].s, s, n))
                    return i;
            return -1;
        }
        const Str *c = &pl->names[b[k]];
        if (c->n == n && str_eq(c->s, s, n))
            return b[k];
    }
    return -1;
}

/* ------------------------------------------------------------------------------------ */
/* one request                                                                          */

typedef struct {
    const uint8_t *name, *value, *field; /* field: the Label field's bytes (RW 1.0) */
    uint32_t nlen, vlen, flen;
    int slot;
    uint32_t r0, r1;     /* RW 2.0 refs; a stamp label has STAMP_REF */
    const Entry *stamp;  /* RW 2.0: the entry of a stamp label */
    uint32_t stamp_ix;   /* its index in the entry */
} Lab;

#define STAMP_REF UINT32_MAX

/* p NULL: the RW 2.0 symbols placeholder, until the walk's end fills it */
typedef EditSpan Span;

/* RW 2.0: the state of one request (walk_v2) */
typedef struct V2 {
    Vec syms;   /* Str */
    Vec slots;  /* int16_t per symbol: its plan slot */
    Vec series; /* size_t[3]: start, payload, end */
    size_t symbols_end;
    int has_symbols;
    /* the first ref of each string, built when the first series is stamped */
    int32_t *index;
    size_t icap;
    uint64_t seed; /* hash_bytes' seed: the table's v2_seed (its stamp strings' hashes) */
    int keyed;     /* 1: over its probe budget, the index was rebuilt with siphash13 */
    uint64_t ops, probes; /* inserts and lookups, and their probe steps past the first */
    Vec added; /* Str: strings appended to the table */
    /* entry -> offset of its refs in `refpool` (2 per stamp label) */
    const Entry **memo_key;
    size_t *memo_val;
    size_t mcap, mlen;
    Vec refpool; /* uint32_t */
    Vec refs;    /* uint32_t: the refs of the current series */
    uint64_t refmax; /* the largest of them, as sent (refs clamps at UINT32_MAX) */
    Vec newrefs; /* uint32_t */
    /* the per-string key hashes of long namespace and pod symbols (v2_key_part), by ref:
     * khash[ref] is hash_bytes(symbol, table seed) when bit ref of kmark is set. Made at
     * the first such symbol a series names (one per symbol: O(1) a lookup, whatever refs
     * a sender picks) */
    uint64_t *khash;
    uint8_t *kmark;
    /* the order of every symbol (v2_rank), made once the long-name comparisons of the
     * request pass their budget (V2_CMP_OVER_BUDGET); NULL before */
    uint32_t *rank;
    uint64_t key_bytes; /* bytes of namespace and pod symbols hashed for the pod key */
    uint64_t cmp_bytes; /* bytes of long label names compared (V2_LONG_NAME) */
} V2;

typedef struct {
    const Plan *plan;
    const PodTable *table;
    Err err;
    PyThreadState *ts; /* the released thread state, for matcher callbacks */
    /* counts */
    uint64_t series, samples, histograms, exemplars, attributed;
    uint64_t stripped; /* series that lost a karta_* label of the sender */
    /* the first series the stamp would have pushed past the label limit (plan.LabelLimited):
     * its __name__ and its labels with the stamp (limited_labels 0: none yet) */
    const uint8_t *limited_name;
    size_t limited_nlen, limited_labels;
    /* the cluster label's value of the first series that names another cluster
     * (plan.SpliceResult.other_cluster; NULL: none yet) */
    const uint8_t *other_cluster;
    size_t other_cluster_n;
    uint64_t *tally; /* per reason index */
    size_t ntally;
    /* per-series scratch */
    Vec labs;   /* Lab */
    Vec merged; /* Lab */
    Vec tmp;    /* Lab, merge sort */
    uint64_t series_id;
    uint64_t seen[MAX_SLOTS];
    Str vals[MAX_SLOTS];
    uint32_t vrefs[MAX_SLOTS]; /* RW 2.0: the symbol of each value in vals */
    /* output */
    Vec spans; /* Span */
    Arena arena;
    size_t out_len;
    size_t copy_from;
    const uint8_t *raw;
    /* what the splice may hold beside its input (SIZE_MAX: no limit), the RW 2.0 state it
     * holds too, and past the limit the estimate of what the whole request would */
    size_t limit;
    V2 *v2; /* RW 2.0; NULL in RW 1.0 */
    size_t fixed; /* held once the RW 2.0 scan is done: not extrapolated */
    size_t need;
    PyObject *grow; /* grow(need) -> the new limit (<= what is held: none), or NULL */
} Req;

static void
req_init(Req *r, const Plan *pl, const PodTable *t, const uint8_t *raw)
{
    memset(r, 0, sizeof *r);
    r->plan = pl;
    r->table = t;
    r->raw = raw;
    r->limit = SIZE_MAX;
    vec_init(&r->labs, sizeof(Lab));
    vec_init(&r->merged, sizeof(Lab));
    vec_init(&r->tmp, sizeof(Lab));
    vec_init(&r->spans, sizeof(Span));
}

static void
req_free(Req *r)
{
    vec_free(&r->labs);
    vec_free(&r->merged);
    vec_free(&r->tmp);
    vec_free(&r->spans);
    arena_free(&r->arena);
    free(r->tally);
}

static int
oom(Req *r)
{
    if (r->labs.failed || r->merged.failed || r->tmp.failed || r->spans.failed || r->arena.failed) {
        err_set(&r->err, "out_of_memory", "out of memory");
        r->err.status = 503;
        return 1;
    }
    return 0;
}

/* The walk's own error for a request past its limit: not raised, answered with r->need */
static const char OVER_LIMIT[] = "over_limit";

static size_t v2_held(const V2 *v);

/* Is the request past its limit, with `pos` of its `n` bytes walked? The splice holds, beside
 * its input, its spans, the arena (stamps copied, RW 2.0 symbols), the RW 2.0 state, and in
 * the output the bytes it adds: about a third of the decoded size for real series (stamps
 * ~20%), but for series smaller than their stamps many times it (docs/operations.md). Past
 * the limit the walk stops before holding more, with the whole request's estimate. */
static int
over_limit(Req *r, size_t pos, size_t n)
{
    if (r->limit == SIZE_MAX || r->err.kind)
        return 0;
    size_t held = r->spans.len * sizeof(Span) + r->arena.bytes +
                  (r->out_len > r->copy_from ? r->out_len - r->copy_from : 0) +
                  (r->v2 != NULL ? v2_held(r->v2) : 0);
    if (held <= r->limit)
        return 0;
    size_t fixed = held > r->fixed ? r->fixed : held;
    double need = (double)fixed + (double)(held - fixed) * ((double)n / (double)(pos ? pos : 1));
    r->need = need >= (double)PY_SSIZE_T_MAX ? (size_t)PY_SSIZE_T_MAX : (size_t)need + 1;
    if (r->grow != NULL) {
        /* asked under the GIL, as an unless matcher is (table writers wait for the lock
         * without it) */
        PyEval_RestoreThread(r->ts);
        Py_ssize_t more = -1;
        PyObject *out = PyObject_CallFunction(r->grow, "n", (Py_ssize_t)r->need);
        if (out != NULL) {
            more = PyLong_AsSsize_t(out);
            Py_DECREF(out);
        }
        int failed = more == -1 && PyErr_Occurred() != NULL;
        r->ts = PyEval_SaveThread();
        if (failed) {
            r->err.kind = "grow";
            r->err.python = 1;
            r->err.status = 500;
            return 1;
        }
        if (more > 0 && (size_t)more > held) {
            r->limit = (size_t)more;
            return 0;
        }
    }
    err_set(&r->err, OVER_LIMIT, "the splice would hold past its limit of %zu bytes", r->limit);
    return 1;
}

static void
tally(Req *r, int reason)
{
    if (reason < 0) {
        r->attributed++;
        return;
    }
    if ((size_t)reason >= r->ntally) {
        size_t n = (size_t)reason + 16;
        uint64_t *t = realloc(r->tally, n * sizeof(uint64_t));
        if (t == NULL) {
            r->arena.failed = 1;
            return;
        }
        memset(t + r->ntally, 0, (n - r->ntally) * sizeof(uint64_t));
        r->tally = t;
        r->ntally = n;
    }
    r->tally[reason]++;
}

static inline void
emit(Req *r, const uint8_t *p, size_t n)
{
    if (n == 0 && p != NULL)
        return;
    Span *s = vec_push(&r->spans, 1);
    if (s == NULL)
        return;
    s->p = p;
    s->n = n;
    r->out_len += n;
}

/* copy the input from copy_from up to `upto` */
static inline void
emit_input(Req *r, size_t upto)
{
    if (upto > r->copy_from)
        emit(r, r->raw + r->copy_from, upto - r->copy_from);
    r->copy_from = upto;
}

/* Does an `unless` condition hold for the value? The matcher runs under the GIL. */
static int
unless_holds(Req *r, const UnlessC *u, const uint8_t *v, size_t vn)
{
    if (u->matcher == NULL) {
        for (size_t i = 0; i < u->nlit; i++)
            if (u->lits[i].n == vn && str_eq(u->lits[i].s, v, vn))
                return 1;
        return 0;
    }
    PyEval_RestoreThread(r->ts);
    int res = -1;
    PyObject *arg = PyBytes_FromStringAndSize((const char *)v, (Py_ssize_t)vn);
    if (arg != NULL) {
        PyObject *out = PyObject_CallOneArg(u->matcher, arg);
        Py_DECREF(arg);
        if (out != NULL) {
            res = PyObject_IsTrue(out);
            Py_DECREF(out);
        }
    }
    if (res < 0) {
        /* keep the Python exception for the caller: remember it, clear it for now */
        r->err.kind = "matcher";
        r->err.python = 1;
        r->err.status = 500;
        res = 0;
    }
    r->ts = PyEval_SaveThread();
    return res;
}

#define VAL(r, slot) ((r)->seen[slot] == (r)->series_id ? &(r)->vals[slot] : NULL)

/* The decision of one series (labels in r->labs, slots set): the entry to stamp, or
 * NULL with *reason set (-1: attributed as it is). */
/* The pod a series names (labels in r->labs' slots: r->vals): 1 with *ns / *pod set, 0
 * with *reason set (-1: attributed as it is, `keep`; 0: no_pod_label; other_cluster). */
static int
choose_pod(Req *r, Str *ns_out, Str *pod_out, int *reason, const PairC **chosen)
{
    const Plan *pl = r->plan;
    const Str *v;
    *reason = -1;
    if (pl->keep_sent && (v = VAL(r, SLOT_WORKLOAD)) != NULL && v->n > 0)
        return 0;
    if (pl->cluster_slot >= 0 && (v = VAL(r, pl->cluster_slot)) != NULL && v->n > 0 &&
        (v->n != pl->cluster_value.n || !str_eq(v->s, pl->cluster_value.s, v->n))) {
        /* another cluster's series: this cluster's pods are not its pods */
        if (r->other_cluster == NULL) {
            r->other_cluster = v->s;
            r->other_cluster_n = v->n;
        }
        *reason = REASON_OTHER_CLUSTER;
        return 0;
    }
    const PairC *pairs = pl->pairs;
    size_t npairs = pl->npairs;
    if (pl->nrules) {
        const Str *name = VAL(r, SLOT_NAME);
        const uint8_t *ms = name ? name->s : (const uint8_t *)"";
        size_t mn = name ? name->n : 0;
        for (size_t i = 0; i < pl->nrules; i++) {
            const RuleC *rule = &pl->rules[i];
            if (rule->prefix.n <= mn && str_eq(ms, rule->prefix.s, rule->prefix.n)) {
                pairs = rule->pairs;
                npairs = rule->npairs;
                break;
            }
        }
    }
    for (size_t i = 0; i < npairs; i++) {
        const PairC *p = &pairs[i];
        const Str *ns = VAL(r, p->ns_slot), *pod = VAL(r, p->pod_slot);
        if (ns == NULL || ns->n == 0 || pod == NULL || pod->n == 0)
            continue;
        int skip = 0;
        for (size_t j = 0; j < p->nunless && !skip; j++) {
            const Str *uv = VAL(r, p->unless[j].slot);
            skip = unless_holds(r, &p->unless[j], uv ? uv->s : (const uint8_t *)"", uv ? uv->n : 0);
            if (r->err.kind)
                return 0;
        }
        if (skip)
            continue;
        *ns_out = *ns;
        *pod_out = *pod;
        *chosen = p; /* (RW 2.0: both are whole symbols, r->vrefs[its slots]) */
        return 1;
    }
    *reason = 0; /* no_pod_label */
    return 0;
}

/* The entry of a chosen pod, or NULL with *reason set (pod_unknown, or the pod's own). */
static inline const Entry *
lookup_pod(const PodTable *t, uint64_t h, const Str *ns, const Str *pod, int *reason)
{
    const Entry *en = table_find(t, h, ns->s, ns->n, pod->s, pod->n);
    if (en == NULL) {
        *reason = 1; /* pod_unknown */
        return NULL;
    }
    if (en->reason >= 0) {
        *reason = en->reason;
        return NULL;
    }
    return en;
}

/* A namespace or pod symbol shorter than this is hashed where a series names it, as in
 * RW 1.0 (a few words: cheaper than a memo's lines); a longer one once per request. */
#define V2_KEY_MEMO_MIN 64

/* hash_bytes(symbol ref (x), table seed): the part of a pod key (key_mix) that a namespace or
 * pod symbol gives. A long symbol's is memoized by ref, so a request hashes each distinct
 * one once however many series name it; per series the cost is then independent of the
 * symbol's length (v->key_bytes counts what is hashed: _v2_work_stats). */
static inline uint64_t
v2_key_part(Req *r, V2 *v, uint32_t ref, const Str *x)
{
    uint64_t seed = r->table->seed;
    if (x->n < V2_KEY_MEMO_MIN) {
        v->key_bytes += x->n;
        return hash_bytes(x->s, x->n, seed);
    }
    if (v->khash == NULL) {
        size_t nsym = v->syms.len;
        v->khash = malloc(nsym * sizeof(uint64_t));
        v->kmark = calloc(nsym / 8 + 1, 1);
        if (v->khash == NULL || v->kmark == NULL) {
            free(v->khash);
            free(v->kmark);
            v->khash = NULL;
            v->kmark = NULL;
            r->arena.failed = 1; /* 503, as any other allocation of the walk */
            return 0;
        }
    }
    if (!(v->kmark[ref >> 3] >> (ref & 7) & 1)) {
        v->khash[ref] = hash_bytes(x->s, x->n, seed);
        v->kmark[ref >> 3] |= (uint8_t)(1u << (ref & 7));
        v->key_bytes += x->n;
    }
    return v->khash[ref];
}

/* choose_pod + lookup_pod at once (RW 2.0): the key from the chosen pair's two symbols'
 * hashes (both are whole symbols: a pair's values are label values as sent). */
static const Entry *
decide(Req *r, V2 *v, int *reason)
{
    Str ns, pod;
    const PairC *p;
    if (!choose_pod(r, &ns, &pod, reason, &p))
        return NULL;
    const PodTable *t = r->table;
    uint64_t h = key_mix(v2_key_part(r, v, r->vrefs[p->ns_slot], &ns),
                         v2_key_part(r, v, r->vrefs[p->pod_slot], &pod));
    return lookup_pod(t, h, &ns, &pod, reason);
}

/* RW 2.0 label names are symbols that any number of series may name: two names of L
 * bytes with a common prefix cost a memcmp of L at every comparison, in every series (N
 * series of two 64 KiB names: 118 ms per 1.1 MB request, ~70x a request of short names).
 * Names up to V2_LONG_NAME bytes are compared as they are (their cost is the series'
 * own: a label is at least two bytes of refs); longer ones are counted, and once they pass
 * 1 KiB per series of the request plus 1 MiB, every symbol is ranked in byte order
 * (v2_rank: a sort of the table, O(S log S) comparisons, each at most its shorter string's
 * bytes) and names compare by rank from then on. An honest request stays below (names of
 * 64 bytes and more are rare, and most differ early). */
#define V2_LONG_NAME 64
#define V2_CMP_OVER_BUDGET(v, r) ((v)->cmp_bytes > 1024 * (r)->series + ((uint64_t)1 << 20))

/* v->rank := the order of every symbol (equal strings, equal ranks), so that rank order
 * is str_cmp's. 0: out of memory (r->arena.failed, the request's 503). */
static int
v2_rank(Req *r, V2 *v)
{
    size_t n = v->syms.len;
    const Str *syms = v->syms.data;
    if (n > UINT32_MAX) { /* (a table of 2^32 symbols is 8 GB: past every limit) */
        r->arena.failed = 1;
        return 0;
    }
    uint32_t *a = malloc((n ? n : 1) * sizeof(uint32_t));
    uint32_t *tmp = malloc((n ? n : 1) * sizeof(uint32_t));
    uint32_t *rank = malloc((n ? n : 1) * sizeof(uint32_t));
    if (a == NULL || tmp == NULL || rank == NULL) {
        free(a);
        free(tmp);
        free(rank);
        r->arena.failed = 1;
        return 0;
    }
    for (size_t i = 0; i < n; i++)
        a[i] = (uint32_t)i;
    /* bottom-up merge sort: each comparison costs at most the shorter string, so a pass
     * costs at most the table's bytes */
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n;
            size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                const Str *x = &syms[a[i]], *y = &syms[a[j]];
                v->cmp_bytes += x->n < y->n ? x->n : y->n;
                tmp[k++] = str_cmp(y->s, y->n, x->s, x->n) < 0 ? a[j++] : a[i++];
            }
            while (i < mid)
                tmp[k++] = a[i++];
            while (j < hi)
                tmp[k++] = a[j++];
        }
        uint32_t *t = a;
        a = tmp;
        tmp = t;
    }
    uint32_t rk = 0;
    for (size_t i = 0; i < n; i++) {
        if (i > 0) {
            const Str *x = &syms[a[i - 1]], *y = &syms[a[i]];
            v->cmp_bytes += x->n < y->n ? x->n : y->n;
            rk += str_cmp(x->s, x->n, y->s, y->n) != 0;
        }
        rank[a[i]] = rk;
    }
    free(a);
    free(tmp);
    v->rank = rank;
    return 1;
}

/* The order of two RW 2.0 label names (both symbols: a->r0, b->r0), as str_cmp's. */
static inline int
v2_name_cmp(Req *r, V2 *v, const Lab *a, const Lab *b)
{
    /* the usual names: differing in their first byte (str_cmp's first test), or short */
    if (a->nlen && b->nlen && a->name[0] != b->name[0])
        return a->name[0] < b->name[0] ? -1 : 1;
    size_t k = a->nlen < b->nlen ? a->nlen : b->nlen;
    if (k <= V2_LONG_NAME)
        return str_cmp(a->name, a->nlen, b->name, b->nlen);
    if (a->r0 == b->r0)
        return 0; /* one symbol */
    if (v->rank == NULL) {
        v->cmp_bytes += k;
        if (!V2_CMP_OVER_BUDGET(v, r) || !v2_rank(r, v))
            return str_cmp(a->name, a->nlen, b->name, b->nlen);
    }
    uint32_t x = v->rank[a->r0], y = v->rank[b->r0];
    return x < y ? -1 : x > y;
}

/* The order of two labels' names: RW 2.0 symbols through v2_name_cmp, anything else (RW
 * 1.0 labels, a stamp's: at most the stamp name's bytes) by their bytes. */
static inline int
lab_cmp(Req *r, const Lab *a, const Lab *b)
{
    if (r->v2 == NULL || a->r0 == STAMP_REF || b->r0 == STAMP_REF)
        return str_cmp(a->name, a->nlen, b->name, b->nlen);
    return v2_name_cmp(r, r->v2, a, b);
}

/* Stable merge sort of n labels (ties keep their order). */
static void
lab_sort(Req *r, Lab *a, Lab *tmp, size_t n)
{
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n;
            size_t hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi)
                tmp[k++] = lab_cmp(r, &a[j], &a[i]) < 0 ? a[j++] : a[i++];
            while (i < mid)
                tmp[k++] = a[i++];
            while (j < hi)
                tmp[k++] = a[j++];
        }
        memcpy(a, tmp, n * sizeof(Lab));
    }
}

/* Is a sender's label of this name removed (plan.SplicePlan.dropped)? */
static inline int
dropped(const Plan *pl, const Lab *l)
{
    return (l->slot >= 0 && (pl->flags[l->slot] & FLAG_STAMPED)) ||
           (pl->drop_sent && is_karta(l->name, l->nlen));
}

/* plan.NO_LABELS_LEFT: the refusal of a series the drop of the sender's karta_* labels
 * would leave with no label of a non-empty value (Prometheus reads an empty value as no
 * label, answers the empty label set 500, which senders retry forever, the batch's other
 * series with it) */
#define NO_LABELS_LEFT                                                                     \
    "a series whose only labels with a value are karta_* would be forwarded with no "     \
    "labels with a value (sender_karta_labels: drop removes them, and a TSDB reads a "    \
    "label with an empty value as absent), and the TSDB refuses an empty label set"

/* Would the drop leave the series with no label of a non-empty value, a label being
 * dropped (plan.check_kept, called where labels were dropped)? Stops at the first kept
 * label with a value, the first one of a sorted series (__name__) as a rule. */
static inline int
empty_after_drop(const Plan *pl, const Lab *labs, size_t n)
{
    int any = 0;
    for (size_t i = 0; i < n; i++) {
        if (!dropped(pl, &labs[i])) {
            if (labs[i].vlen)
                return 0;
        }
        else
            any = 1;
    }
    return any;
}

/* Would the stamp push the series past the plan's label limit (plan.decide's
 * label_limit)? Called only when its n labels and the stamp's are past it (the one
 * compare a stamped series pays; a limit of 0 is none, tested by the callers): the labels
 * the plan drops are not counted (the stamp replaces them), and a series sent past the
 * limit goes unstamped too. Notes the request's first such series for the log line. */
static int
stamp_over_limit(Req *r, const Lab *labs, size_t n, const Entry *en)
{
    const Plan *pl = r->plan;
    size_t total = en->nlabels;
    for (size_t i = 0; i < n; i++)
        total += !dropped(pl, &labs[i]);
    if (total <= pl->max_labels)
        return 0;
    if (r->limited_labels == 0) {
        r->limited_name = (const uint8_t *)"";
        r->limited_nlen = 0;
        for (size_t i = 0; i < n; i++)
            if (labs[i].slot == SLOT_NAME) {
                r->limited_name = labs[i].value;
                r->limited_nlen = labs[i].vlen;
                break;
            }
        r->limited_labels = total;
    }
    return 1;
}

/* proxy/shown.py's SHOWN / shown: a label string as a refusal shows it, its first SHOWN bytes,
 * printable ASCII as it is and every other byte (\\, ", not ASCII, invalid UTF-8) as
 * \\xNN, "..." after a cut; `out` holds SHOWN_CAP bytes. Byte for byte the reference's. */
#define SHOWN 64
#define SHOWN_CAP (4 * SHOWN + 4)

static void
shown(char *out, const uint8_t *s, size_t n)
{
    static const char hex[] = "0123456789abcdef";
    size_t k = 0, m = n < SHOWN ? n : SHOWN;
    for (size_t i = 0; i < m; i++) {
        uint8_t b = s[i];
        if (b >= 0x20 && b < 0x7F && b != '\\' && b != '"')
            out[k++] = (char)b;
        else {
            out[k++] = '\\';
            out[k++] = 'x';
            out[k++] = hex[b >> 4];
            out[k++] = hex[b & 15];
        }
    }
    if (n > SHOWN) {
        memcpy(out + k, "...", 3);
        k += 3;
    }
    out[k] = 0;
}

/* plan.series_named: a refusal of a series' labels (invalid_labels, invalid_utf8; not an
 * out-of-memory) names the series, its index in the request and its first __name__, so
 * that an operator finds it among thousands. */
static void
name_series(Err *e, uint64_t index, const Lab *labs, size_t n)
{
    if (e->kind == NULL || e->python ||
        (strcmp(e->kind, "invalid_labels") != 0 && strcmp(e->kind, "invalid_utf8") != 0))
        return;
    size_t len = strlen(e->message);
    char *at = e->message + len;
    size_t room = sizeof e->message - len;
    for (size_t i = 0; i < n; i++)
        if (labs[i].nlen == 8 && memcmp(labs[i].name, "__name__", 8) == 0) {
            char buf[SHOWN_CAP];
            shown(buf, labs[i].value, labs[i].vlen);
            snprintf(at, room, " (series %llu of the request, __name__ \"%s\")",
                     (unsigned long long)index, buf);
            return;
        }
    snprintf(at, room, " (series %llu of the request, no __name__)", (unsigned long long)index);
}

/* A string that is not UTF-8 (primitives.check_utf8, `what` its words): the refusal shows
 * it. */
static void
refuse_utf8(Err *e, const char *what, const uint8_t *s, size_t n)
{
    char buf[SHOWN_CAP];
    shown(buf, s, n);
    err_set(e, "invalid_utf8", "%s is not valid UTF-8: \"%s\"", what, buf);
}

/* Does the stamp carry this label, name and value? */
static int
in_stamp(const Entry *en, const Lab *l)
{
    const StampLabel *sl = ENTRY_LABELS(en);
    for (uint32_t i = 0; i < en->nlabels; i++)
        if (sl[i].name_len == l->nlen && sl[i].value_len == l->vlen &&
            memcmp(en->data + sl[i].name_off, l->name, l->nlen) == 0 &&
            memcmp(en->data + sl[i].value_off, l->value, l->vlen) == 0)
            return 1;
    return 0;
}

/* 400 invalid_labels for no label at all, an empty or a repeated name (plan.check_names);
 * *sorted := the names are strictly sorted (then an empty one can only be the first).
 * Unsorted names are sorted in a copy (rare: senders sort). Returns 0 with the error set,
 * or on OOM. */
static inline __attribute__((always_inline)) int
check_names(Req *r, const Lab *labs, size_t n, int *sorted, V2 *v)
{
    *sorted = 1;
    for (size_t i = 1; i < n; i++)
        if ((v != NULL ? v2_name_cmp(r, v, &labs[i - 1], &labs[i])
                       : str_cmp(labs[i - 1].name, labs[i - 1].nlen, labs[i].name, labs[i].nlen)) >= 0) {
            *sorted = 0;
            break;
        }
    const Lab *a = labs;
    if (!*sorted) {
        Lab *b, *t;
        r->merged.len = r->tmp.len = 0;
        if ((b = vec_push(&r->merged, n)) == NULL || (t = vec_push(&r->tmp, n)) == NULL)
            return 0;
        memcpy(b, labs, n * sizeof(Lab));
        lab_sort(r, b, t, n);
        a = b;
    }
    if (n == 0) {
        err_set(&r->err, "invalid_labels", "a series with no labels");
        return 0;
    }
    if (a[0].nlen == 0) {
        err_set(&r->err, "invalid_labels", "a label with an empty name");
        return 0;
    }
    for (size_t i = 1; i < n && !*sorted; i++)
        if (lab_cmp(r, &a[i - 1], &a[i]) == 0) {
            char buf[SHOWN_CAP];
            shown(buf, a[i].name, a[i].nlen);
            err_set(&r->err, "invalid_labels", "label name \"%s\" repeated in one series", buf);
            return 0;
        }
    return 1;
}

/* Under drop_sent: does the series carry a karta_* label? For strictly sorted labels and
 * a stamp block at `at` whose names all start with karta_ (the contract's do), such
 * labels can only be a run next to the block: two checks instead of a scan. */
static inline int
karta_around(const Lab *labs, size_t n, size_t at, const Entry *en)
{
    if (en->reason == STAMP_KARTA)
        return (at > 0 && is_karta(labs[at - 1].name, labs[at - 1].nlen)) ||
               (at < n && is_karta(labs[at].name, labs[at].nlen));
    for (size_t i = 0; i < n; i++)
        if (is_karta(labs[i].name, labs[i].nlen))
            return 1;
    return 0;
}

/* r->merged := the series' labels minus those the plan drops, plus the stamp, stably
 * sorted by name (as splice_v1.merge / splice_v2 sort kept + stamp); *lost := a dropped
 * label is not in the stamp as it was. Returns 0 on OOM. */
static int
merge_stamp(Req *r, const Lab *labs, size_t n, const Entry *en, int *lost)
{
    r->merged.len = 0;
    size_t total = n + en->nlabels;
    r->tmp.len = 0;
    if (vec_push(&r->merged, total) == NULL || vec_push(&r->tmp, total + en->nlabels) == NULL)
        return 0;
    r->tmp.len = 0;
    Lab *m = r->merged.data;
    size_t k = 0;
    int sorted = 1;
    const Lab *prev = NULL;
    *lost = 0;
    for (size_t i = 0; i < n; i++) {
        if (dropped(r->plan, &labs[i])) {
            *lost |= !in_stamp(en, &labs[i]);
            continue;
        }
        if (prev != NULL && lab_cmp(r, prev, &labs[i]) > 0)
            sorted = 0;
        prev = &labs[i];
        m[k++] = labs[i];
    }
    size_t kept = k;
    const StampLabel *sl = ENTRY_LABELS(en);
    Lab *st = (Lab *)r->tmp.data; /* the stamp labels, then reused as sort scratch */
    for (uint32_t i = 0; i < en->nlabels; i++) {
        Lab *x = &st[i];
        x->name = en->data + sl[i].name_off;
        x->nlen = sl[i].name_len;
        x->value = en->data + sl[i].value_off;
        x->vlen = sl[i].value_len;
        x->field = en->data + sl[i].field_off;
        x->flen = sl[i].field_len;
        x->slot = -1;
        x->r0 = x->r1 = STAMP_REF;
        x->stamp = en;
        x->stamp_ix = i;
    }
    if (sorted) {
        /* linear merge of two sorted runs; ties: the kept label first (stable) */
        Lab *out = (Lab *)r->tmp.data + en->nlabels;
        size_t i = 0, j = 0, o = 0;
        while (i < kept && j < en->nlabels)
            out[o++] = lab_cmp(r, &st[j], &m[i]) < 0 ? st[j++] : m[i++];
        while (i < kept)
            out[o++] = m[i++];
        while (j < en->nlabels)
            out[o++] = st[j++];
        /* tmp holds stamp (nlabels) + merged (total): make room */
        memcpy(m, out, o * sizeof(Lab));
        r->merged.len = o;
        return 1;
    }
    for (uint32_t i = 0; i < en->nlabels; i++)
        m[k++] = st[i];
    r->merged.len = k;
    lab_sort(r, m, (Lab *)r->tmp.data, k);
    return 1;
}

#define NO_POSITION ((size_t)-1)

/* Where the stamp goes in as one block: the index of the first label after it, when the
 * block fits between two labels (then the result is what the stable sort of merge_stamp
 * gives); NO_POSITION otherwise. `plain`: the caller knows the labels are strictly sorted
 * (check_names), none is one the plan drops (and, RW 1.0, they are all in front). */
static size_t
stamp_position(const Lab *labs, size_t n, const Entry *en, int plain)
{
    if (!plain)
        return NO_POSITION;
    const uint8_t *first = en->data + en->first_off, *last = en->data + en->last_off;
    size_t fn = en->first_len, ln = en->last_len;
    size_t i = n;
    while (i > 0 && str_cmp(labs[i - 1].name, labs[i - 1].nlen, first, fn) > 0)
        i--; /* from the end: the stamp's karta_ names sort before namespace, pod, ... */
    if (i > 0 && str_cmp(labs[i - 1].name, labs[i - 1].nlen, first, fn) == 0)
        return NO_POSITION;
    if (i < n && str_cmp(labs[i].name, labs[i].nlen, last, ln) <= 0)
        return NO_POSITION;
    return i;
}

/* ------------------------------------------------------------------------------------ */
/* RW 1.0                                                                               */

/* Any Label layout: fields in any order, unknown fields, long lengths. */
static int
read_label_slow(const uint8_t *raw, size_t p, size_t end, Lab *lab, Err *e)
{
    lab->name = lab->value = raw + p;
    lab->nlen = lab->vlen = 0;
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        if (f.number == 1 || f.number == 2) {
            if (f.wt != 2) {
                INVALID(e, "label name/value with a wrong wire type");
                return 0;
            }
            if (f.end - f.ps > UINT32_MAX) {
                INVALID(e, "label too long");
                return 0;
            }
            if (f.number == 1) {
                lab->name = raw + f.ps;
                lab->nlen = (uint32_t)(f.end - f.ps);
            }
            else {
                lab->value = raw + f.ps;
                lab->vlen = (uint32_t)(f.end - f.ps);
            }
        }
        p = f.end;
    }
    return 1;
}

/* Read a Label message's name and value (last one wins; other fields skipped). */
static inline __attribute__((always_inline)) int
read_label(const uint8_t *raw, size_t p, size_t end, Lab *lab, Err *e)
{
    lab->name = lab->value = raw + p;
    lab->nlen = lab->vlen = 0;
    /* the usual shape: 0a N name [12 V value], N one byte, V one or two bytes */
    if (end - p >= 2 && raw[p] == 0x0A && raw[p + 1] < 0x80) {
        size_t ne = p + 2 + raw[p + 1];
        if (ne == end) {
            lab->name = raw + p + 2;
            lab->nlen = raw[p + 1];
            lab->value = raw + end;
            return 1;
        }
        if (ne + 2 <= end && raw[ne] == 0x12) {
            size_t v = raw[ne + 1], vs = ne + 2;
            int ok = 1;
            if (v >= 0x80) {
                ok = ne + 3 <= end && raw[ne + 2] < 0x80;
                v = ok ? (v & 0x7F) | ((size_t)raw[ne + 2] << 7) : 0;
                vs = ne + 3;
            }
            if (ok && vs + v == end) {
                lab->name = raw + p + 2;
                lab->nlen = raw[p + 1];
                lab->value = raw + vs;
                lab->vlen = (uint32_t)v;
                return 1;
            }
        }
    }
    return read_label_slow(raw, p, end, lab, e);
}


/* An RW 1.0 Exemplar: framing; each label's framing and UTF-8. */
static int
check_exemplar_v1(const uint8_t *raw, size_t p, size_t end, Err *e)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f, e))
            return 0;
        if (f.number == 1) {
            Lab lab;
            if (f.wt != 2) {
                INVALID(e, "exemplar label with a wrong wire type");
                return 0;
            }
            if (!read_label(raw, f.ps, f.end, &lab, e))
                return 0;
            if (!text_ok(lab.name, lab.nlen)) {
                refuse_utf8(e, "exemplar label name", lab.name, lab.nlen);
                return 0;
            }
            if (!text_ok(lab.value, lab.vlen)) {
                refuse_utf8(e, "exemplar label value", lab.value, lab.vlen);
                return 0;
            }
        }
        else if (f.number <= 3 && f.wt != EXEMPLAR_WT[f.number - 1]) {
            INVALID(e, "exemplar field %d with a wrong wire type", (int)f.number);
            return 0;
        }
        p = f.end;
    }
    return 1;
}

/* RW 1.0 series go through a short pipeline so that table lookups do not wait on memory:
 * a series is parsed and its slot prefetched (stage A), LEAD series later its slot is read
 * and its entry prefetched (stage B), and LEAD series after that it is looked up and
 * spliced (stage C). Output order is the input order: stage C runs in series order. */
#define LEAD 4
#define PIPE (3 * LEAD + 1)

typedef struct {
    size_t start, s, q, lead_end;
    int in_front, any_stamped, sorted;
    Vec labs;     /* Lab */
    int reason;   /* after stage A: -2 look the pod up; -1 attributed as it is; >= 0 a reason */
    Str ns, pod;
    uint64_t hash;
    const Entry *cand; /* stage B's entry of a matching hash (its first line prefetched) */
} Pending;

/* Stage A: walk one series (labels, counts, UTF-8, the plan's slots) and choose its pod. */
static int
parse_v1(Req *r, Pending *P, size_t start, size_t s, size_t q)
{
    const uint8_t *raw = r->raw;
    Err *e = &r->err;
    r->series++;
    r->series_id++;
    P->labs.len = 0;
    P->start = start;
    P->s = s;
    P->q = q;
    P->lead_end = s;
    P->in_front = 1;
    int any_other = 0;
    size_t p = s;
    while (p < q) {
        Field f;
        if (raw[p] == 0x0A) {
            /* a label field, lengths read inline */
            size_t c = p + 1 < q ? raw[p + 1] : 0x80;
            size_t ps, pe;
            if (c < 0x80) {
                ps = p + 2;
                pe = ps + c;
            }
            else if (p + 2 < q && raw[p + 2] < 0x80) {
                ps = p + 3;
                pe = ps + ((c & 0x7F) | ((size_t)raw[p + 2] << 7));
            }
            else if (!rd_field(raw, p, q, &f, e))
                return 0;
            else {
                ps = f.ps;
                pe = f.end;
            }
            if (pe > q) {
                INVALID(e, "field runs past the end of its message");
                return 0;
            }
            Lab *lab = P->labs.len < P->labs.cap ? (Lab *)P->labs.data + P->labs.len++
                                                 : vec_push(&P->labs, 1);
            if (lab == NULL)
                return 0;
            if (!read_label(raw, ps, pe, lab, e))
                return 0;
            lab->field = raw + p;
            lab->flen = (uint32_t)(pe - p);
            if (any_other)
                P->in_front = 0;
            else
                P->lead_end = pe;
            p = pe;
            continue;
        }
        if (!rd_field(raw, p, q, &f, e))
            return 0;
        if (f.number == 1) {
            if (f.wt != 2) {
                INVALID(e, "label field with a wrong wire type");
                return 0;
            }
            /* a label whose tag is not the one-byte 0a (an over-long varint) */
            Lab *lab = vec_push(&P->labs, 1);
            if (lab == NULL || !read_label(raw, f.ps, f.end, lab, e))
                return 0;
            lab->field = raw + p;
            lab->flen = (uint32_t)(f.end - p);
            if (any_other)
                P->in_front = 0;
            else
                P->lead_end = f.end;
            p = f.end;
            continue;
        }
        if (f.number >= 2 && f.number <= 4) {
            if (f.wt != 2) {
                INVALID(e, "series data field with a wrong wire type");
                return 0;
            }
            int ok;
            if (f.number == 2) {
                r->samples++;
                ok = check_sample(raw, f.ps, f.end, 2, e);
            }
            else if (f.number == 3) {
                r->exemplars++;
                ok = check_exemplar_v1(raw, f.ps, f.end, e);
            }
            else {
                r->histograms++;
                ok = check_histogram(raw, f.ps, f.end, 16, e);
            }
            if (!ok)
                return 0;
        }
        any_other = 1;
        p = f.end;
    }
    Lab *labs = P->labs.data;
    size_t n = P->labs.len;
    const Plan *pl = r->plan;
    int any_stamped = 0;
    for (size_t i = 0; i < n; i++) {
        if (!text_ok(labs[i].name, labs[i].nlen)) {
            refuse_utf8(e, "label name", labs[i].name, labs[i].nlen);
            name_series(e, r->series - 1, labs, n);
            return 0;
        }
        if (!text_ok(labs[i].value, labs[i].vlen)) {
            refuse_utf8(e, "label value", labs[i].value, labs[i].vlen);
            name_series(e, r->series - 1, labs, n);
            return 0;
        }
        int slot = slot_of(pl, labs[i].name, labs[i].nlen);
        labs[i].slot = slot;
        if (slot >= 0) {
            r->seen[slot] = r->series_id;
            r->vals[slot].s = labs[i].value;
            r->vals[slot].n = labs[i].vlen;
            any_stamped |= pl->flags[slot] & FLAG_STAMPED;
        }
    }
    P->any_stamped = any_stamped;
    if (!check_names(r, labs, n, &P->sorted, NULL)) {
        name_series(e, r->series - 1, labs, n);
        return 0;
    }
    const PairC *chosen;
    if (choose_pod(r, &P->ns, &P->pod, &P->reason, &chosen)) {
        const PodTable *t = r->table;
        P->reason = -2;
        P->hash = key_hash(t, P->ns.s, P->ns.n, P->pod.s, P->pod.n);
        if (t->cap)
            __builtin_prefetch(&t->slots[(size_t)P->hash & (t->cap - 1)]);
    }
    else if (pl->drop_sent && P->reason != -1 && !e->kind && empty_after_drop(pl, labs, n)) {
        /* here, in stage A, not where finish_v1 drops them: a later series' defect found
         * by stage A first would otherwise be the answer, and the reference answers the
         * first defect in the request. A series whose labels with a value are all
         * karta_* names no pod (a pair needs a namespace and a pod with a value, and no
         * pair may read karta_*), so this is the only place it can go empty. */
        err_set(e, "invalid_labels", NO_LABELS_LEFT);
        name_series(e, r->series - 1, labs, n);
        return 0;
    }
    return !e->kind;
}

/* Stage B: read the slot (prefetched) and prefetch the first line of the entry it points
 * at; stage B2 reads that line's lengths and prefetches the rest of the hot part. */
static inline void
probe_v1(const PodTable *t, Pending *P)
{
    P->cand = NULL;
    if (P->reason != -2 || t->cap == 0)
        return;
    size_t mask = t->cap - 1;
    for (size_t i = (size_t)P->hash & mask;; i = (i + 1) & mask) {
        const Slot *sl = &t->slots[i];
        if (sl->entry == NULL)
            return;
        if (sl->hash == P->hash && sl->entry != TOMB) {
            P->cand = sl->entry;
            __builtin_prefetch(sl->entry);
            return;
        }
    }
}

static inline void
probe2_v1(const Pending *P)
{
    if (P->cand == NULL)
        return;
    const uint8_t *en = (const uint8_t *)P->cand;
    size_t lines = ENTRY_HOT_LINES(P->cand);
    for (size_t k = 1; k < lines; k++)
        __builtin_prefetch(en + LINE * k);
}

/* Emit a series with new labels: its head, the Label fields m[0..mn), then every other
 * field in its order. */
static void
emit_series_v1(Req *r, Pending *P, const Lab *m, size_t mn)
{
    const uint8_t *raw = r->raw;
    Err *e = &r->err;
    size_t start = P->start, s = P->s, q = P->q, lead_end = P->lead_end;
    int in_front = P->in_front;
    size_t new_len = 0;
    for (size_t i = 0; i < mn; i++)
        new_len += m[i].flen;
    size_t rest = 0;
    if (in_front)
        rest = q - lead_end;
    else {
        /* every non-label field, in order */
        for (size_t pp = s; pp < q;) {
            Field f;
            rd_field(raw, pp, q, &f, e); /* read before: cannot fail */
            if (f.number != 1)
                rest += f.end - pp;
            pp = f.end;
        }
    }
    uint8_t *head = arena_alloc(&r->arena, 11);
    if (head == NULL)
        return;
    head[0] = 0x0A;
    size_t hl = 1 + put_varint(head + 1, new_len + rest);
    emit_input(r, start);
    emit(r, head, hl);
    for (size_t i = 0; i < mn; i++)
        emit(r, m[i].field, m[i].flen);
    if (in_front)
        emit(r, raw + lead_end, q - lead_end);
    else
        for (size_t pp = s; pp < q;) {
            Field f;
            rd_field(raw, pp, q, &f, e);
            if (f.number != 1)
                emit(r, raw + pp, f.end - pp);
            pp = f.end;
        }
    r->copy_from = q;
}

/* The labels of a series that is not stamped, minus those the plan drops, in the
 * sender's order (not sorted): r->merged; returns how many, or (size_t)-1 on OOM. */
static size_t
kept_labels(Req *r, const Lab *labs, size_t n)
{
    r->merged.len = 0;
    Lab *m = vec_push(&r->merged, n ? n : 1);
    if (m == NULL)
        return (size_t)-1;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (!dropped(r->plan, &labs[i]))
            m[k++] = labs[i];
    return k;
}

/* The labels of a series that is not stamped, as they go out: `k` of them (k < n: those
 * kept_labels left in r->merged; k == n: all of `labs`), stably sorted by name (a sender
 * that does not sort would otherwise reach the TSDB so). NULL on OOM. */
static const Lab *
sorted_labels(Req *r, const Lab *labs, size_t n, size_t k)
{
    if (k == n) {
        r->merged.len = 0;
        Lab *m = vec_push(&r->merged, n ? n : 1);
        if (m == NULL)
            return NULL;
        memcpy(m, labs, n * sizeof(Lab));
    }
    r->tmp.len = 0;
    Lab *t = vec_push(&r->tmp, k ? k : 1);
    if (t == NULL)
        return NULL;
    Lab *m = r->merged.data;
    lab_sort(r, m, t, k);
    return m;
}

/* Stage C: look the pod up and splice the series. */
static void
finish_v1(Req *r, Pending *P)
{
    const uint8_t *raw = r->raw;
    size_t start = P->start, s = P->s, q = P->q, lead_end = P->lead_end;
    int in_front = P->in_front;
    Lab *labs = P->labs.data;
    size_t n = P->labs.len;
    int reason = P->reason;
    const Entry *en = NULL;
    if (reason == -2)
        en = lookup_pod(r->table, P->hash, &P->ns, &P->pod, &reason);
    if (en != NULL && r->plan->max_labels && n + en->nlabels > r->plan->max_labels
        && stamp_over_limit(r, labs, n, en)) {
        en = NULL; /* forwarded unstamped, the sender's karta_* dropped all the same */
        reason = REASON_LABEL_LIMIT;
    }
    tally(r, en ? -1 : reason);
    int drop_sent = r->plan->drop_sent;
    if (en == NULL || en->nlabels == 0) {
        /* not stamped: under drop_sent the sender's karta_* labels go; `keep` (reason -1
         * from stage A) lets the sender's attribution pass; unsorted labels go out sorted */
        size_t k = n;
        if (drop_sent && P->reason != -1) {
            k = kept_labels(r, labs, n);
            if (k == (size_t)-1)
                return;
            r->stripped += k != n;
        }
        if (P->sorted && k == n)
            return;
        const Lab *m = sorted_labels(r, labs, n, k);
        if (m != NULL)
            emit_series_v1(r, P, m, k);
        return;
    }
    size_t at = stamp_position(labs, n, en, in_front && P->sorted && !P->any_stamped);
    if (at != NO_POSITION && drop_sent && karta_around(labs, n, at, en))
        at = NO_POSITION; /* a sender's karta_* label to drop: the merge does it */
    if (at != NO_POSITION) {
        /* the usual case: the stamp goes in as one block, everything else is the input */
        size_t ins = at < n ? (size_t)(labs[at].field - raw) : lead_end;
        uint8_t *head = arena_alloc(&r->arena, 11);
        if (head == NULL)
            return;
        head[0] = 0x0A;
        size_t hl = 1 + put_varint(head + 1, (q - s) + en->fields_len);
        /* the stamp is copied now, while its entry's lines are in cache (prefetched for
         * this series); the spans are gathered after the walk, when the entry would be
         * a cache miss again, and the arena's bytes are recent and sequential */
        uint8_t *stamp = arena_alloc(&r->arena, en->fields_len);
        if (stamp == NULL)
            return;
        memcpy(stamp, ENTRY_FIELDS(en), en->fields_len);
        emit_input(r, start);
        emit(r, head, hl);
        emit(r, raw + s, ins - s);
        emit(r, stamp, en->fields_len);
        emit(r, raw + ins, q - ins);
        r->copy_from = q;
        return;
    }
    int lost;
    if (!merge_stamp(r, labs, n, en, &lost))
        return;
    Lab *m = r->merged.data;
    size_t mn = r->merged.len;
    if (mn == n) {
        int same = 1;
        for (size_t i = 0; i < n && same; i++)
            same = m[i].flen == labs[i].flen && memcmp(m[i].field, labs[i].field, m[i].flen) == 0;
        if (same)
            return; /* already exactly so */
    }
    r->stripped += (uint64_t)lost;
    emit_series_v1(r, P, m, mn);
}

static void
walk_v1(Req *r, size_t n)
{
    const uint8_t *raw = r->raw;
    Pending ring[PIPE];
    for (int i = 0; i < PIPE; i++)
        vec_init(&ring[i].labs, sizeof(Lab));
    size_t parsed = 0, done = 0; /* series through stage A, through stage C */
    size_t pos = 0;
    while (pos < n && !r->err.kind) {
        Field f;
        size_t start = pos, s, q;
        if (raw[pos] == 0x0A) {
            /* a series, its length read inline */
            size_t p = pos + 1;
            uint64_t ln;
            if (!rd_varint(raw, n, &p, &ln)) {
                INVALID(&r->err, "truncated or over-long varint");
                break;
            }
            if (ln > n - p) {
                INVALID(&r->err, "field runs past the end of its message");
                break;
            }
            s = p;
            q = p + ln;
        }
        else {
            if (!rd_field(raw, pos, n, &f, &r->err))
                break;
            pos = f.end;
            if ((f.number == 4 || f.number == 5) && f.wt == 2) {
                /* RW 2.0's symbols / timeseries: a 2.0 body sent as 1.0 would be read as
                 * an empty request and answered 2xx with nothing stored */
                err_set(&r->err, "protocol_mismatch",
                        "the body is an RW 2.0 request (symbols / timeseries fields 4, 5) but "
                        "the Content-Type says RW 1.0: send it as "
                        "application/x-protobuf;proto=io.prometheus.write.v2.Request");
                break;
            }
            if (f.number != 1)
                continue;
            if (f.wt != 2) {
                INVALID(&r->err, "timeseries field with a wrong wire type");
                break;
            }
            s = f.ps;
            q = f.end;
        }
        pos = q;
        if (!parse_v1(r, &ring[parsed % PIPE], start, s, q) || oom(r))
            break;
        parsed++;
        if (parsed > LEAD)
            probe_v1(r->table, &ring[(parsed - 1 - LEAD) % PIPE]);
        if (parsed > 2 * LEAD)
            probe2_v1(&ring[(parsed - 1 - 2 * LEAD) % PIPE]);
        if (parsed > 3 * LEAD) {
            finish_v1(r, &ring[done % PIPE]);
            done++;
            if (oom(r) || over_limit(r, pos, n))
                break;
        }
    }
    while (!r->err.kind && done < parsed) {
        finish_v1(r, &ring[done % PIPE]);
        done++;
        if (oom(r) || over_limit(r, pos, n))
            break;
    }
    for (int i = 0; i < PIPE; i++)
        vec_free(&ring[i].labs);
}

/* ------------------------------------------------------------------------------------ */
/* RW 2.0                                                                               */


static size_t
v2_held(const V2 *v)
{
    return v->syms.len * sizeof(Str) + v->slots.len * sizeof(int16_t) +
           v->series.len * sizeof(size_t) + v->added.len * sizeof(Str) +
           (v->refpool.len + v->refs.len + v->newrefs.len) * sizeof(uint32_t) +
           v->icap * sizeof(int32_t) + v->mcap * (sizeof(const Entry *) + sizeof(size_t)) +
           (v->khash != NULL ? v->syms.len * sizeof(uint64_t) + v->syms.len / 8 + 1 : 0) +
           (v->rank != NULL ? v->syms.len * sizeof(uint32_t) : 0);
}

static void
v2_free(V2 *v)
{
    vec_free(&v->syms);
    vec_free(&v->slots);
    vec_free(&v->series);
    vec_free(&v->added);
    vec_free(&v->refpool);
    vec_free(&v->refs);
    vec_free(&v->newrefs);
    free(v->index);
    free(v->memo_key);
    free(v->memo_val);
    free(v->khash);
    free(v->kmark);
    free(v->rank);
}

static int
v2_scan(Req *r, V2 *v, size_t n)
{
    const uint8_t *raw = r->raw;
    Err *e = &r->err;
    size_t pos = 0;
    while (pos < n) {
        Field f;
        if (!rd_field(raw, pos, n, &f, e))
            return 0;
        if ((f.number == 1 || f.number == 3) && f.wt == 2) {
            /* reserved in 2.0: an RW 1.0 body (timeseries 1, metadata 3) would be read as
             * an empty 2.0 request and answered 2xx with nothing stored */
            err_set(e, "protocol_mismatch",
                    "the body is an RW 1.0 request (timeseries / metadata fields 1, 3) but "
                    "the Content-Type says RW 2.0: send it as application/x-protobuf");
            return 0;
        }
        if (f.number == 4) {
            if (f.wt != 2) {
                INVALID(e, "symbols field with a wrong wire type");
                return 0;
            }
            Str *s = vec_push(&v->syms, 1);
            if (s == NULL)
                return 0;
            s->s = raw + f.ps;
            s->n = f.end - f.ps;
            v->symbols_end = f.end;
            v->has_symbols = 1;
        }
        else if (f.number == 5) {
            if (f.wt != 2) {
                INVALID(e, "timeseries field with a wrong wire type");
                return 0;
            }
            size_t *t = vec_push(&v->series, 3);
            if (t == NULL)
                return 0;
            t[0] = pos;
            t[1] = f.ps;
            t[2] = f.end;
            if (v->series.len % 3072 == 0 && over_limit(r, f.end, n))
                return 0;
        }
        pos = f.end;
    }
    if (over_limit(r, n, n))
        return 0;
    r->fixed = v2_held(v);
    Str *syms = v->syms.data;
    int16_t *slots = vec_push(&v->slots, v->syms.len ? v->syms.len : 1);
    if (slots == NULL)
        return 0;
    for (size_t i = 0; i < v->syms.len; i++) {
        if (!text_ok(syms[i].s, syms[i].n)) {
            char what[32];
            snprintf(what, sizeof what, "symbol %zu", i);
            refuse_utf8(e, what, syms[i].s, syms[i].n);
            return 0;
        }
        slots[i] = (int16_t)slot_of(r->plan, syms[i].s, syms[i].n);
    }
    if (v->syms.len && syms[0].n != 0) {
        INVALID(e, "symbols table must start with the empty string");
        return 0;
    }
    return 1;
}

/* The probe budget of the RW 2.0 symbol index: past 8 probe steps (beyond the first) per
 * insert or lookup on average, plus 4096, the index is rebuilt with the keyed hash. At a
 * load of 1/2 (the index is kept at most half full) linear probing takes ~0.5 steps past
 * the first per insert or hit and ~1.5 per miss on average, so an honest request stays
 * several times below it (4096 absorbs small tables' variance); symbols made to collide
 * reach it after O(n) work, where they cost O(n^2) in all. */
#define V2_OVER_BUDGET(v) (!(v)->keyed && (v)->probes > 8 * (v)->ops + 4096)

/* the last request's index work in this thread: _v2_index_stats (tests) */
static _Thread_local uint64_t v2_last_ops, v2_last_probes;
static _Thread_local int v2_last_keyed;
/* and the bytes its pod keys hashed and its long names compared: _v2_work_stats (tests) */
static _Thread_local uint64_t v2_last_key_bytes, v2_last_cmp_bytes;
static _Thread_local int v2_last_ranked;

static inline uint64_t
v2_hash(const V2 *v, const uint8_t *s, size_t n)
{
    return v->keyed ? siphash13(v2_sip_k0, v2_sip_k1, s, n) : hash_bytes(s, n, v->seed);
}

static inline const Str *
v2_str(const V2 *v, size_t ix)
{
    size_t nsym = v->syms.len;
    return ix < nsym ? &((const Str *)v->syms.data)[ix]
                     : &((const Str *)v->added.data)[ix - nsym];
}

/* (Re)build the index at `cap` slots: every symbol at its first occurrence, then every
 * string added. Over the probe budget (fast hash only) it starts again keyed: the keyed
 * build has no budget, so this ends. 0: out of memory. */
static int
v2_fill(Req *r, V2 *v, size_t cap)
{
    int32_t *idx = malloc(cap * sizeof(int32_t));
    if (idx == NULL) {
        r->arena.failed = 1;
        return 0;
    }
    free(v->index);
    v->index = idx;
    v->icap = cap;
    size_t mask = cap - 1, nsym = v->syms.len, total = nsym + v->added.len;
again:
    memset(idx, 0xff, cap * sizeof(int32_t));
    for (size_t k = 0; k < total; k++) {
        const Str *x = v2_str(v, k);
        size_t i = (size_t)v2_hash(v, x->s, x->n) & mask;
        uint64_t steps = 0;
        int dup = 0;
        while (idx[i] >= 0) {
            const Str *y = v2_str(v, (size_t)idx[i]);
            /* (an added string is in no symbol and added once) */
            if (k < nsym && y->n == x->n && memcmp(y->s, x->s, x->n) == 0) {
                dup = 1; /* the first occurrence wins */
                break;
            }
            i = (i + 1) & mask;
            steps++;
        }
        if (!dup)
            idx[i] = (int32_t)k;
        v->ops++;
        v->probes += steps;
        if (V2_OVER_BUDGET(v)) {
            v->keyed = 1;
            goto again;
        }
    }
    return 1;
}

/* The ref of string s (h: hash_bytes(s, n, v->seed)) in this request: its first
 * occurrence, or appended. */
static int64_t
v2_ref(Req *r, V2 *v, const uint8_t *s, size_t n, uint64_t h)
{
    if (v->keyed)
        h = v2_hash(v, s, n);
    size_t mask = v->icap - 1;
    size_t i = (size_t)h & mask;
    uint64_t steps = 0;
    for (;;) {
        int32_t ix = v->index[i];
        if (ix < 0)
            break;
        const Str *x = v2_str(v, (size_t)ix);
        if (x->n == n && memcmp(x->s, s, n) == 0) {
            v->ops++;
            v->probes += steps;
            if (V2_OVER_BUDGET(v) && !v2_fill(r, v, v->icap))
                return -1; /* (found: the rebuild changes no ref) */
            return ix;
        }
        i = (i + 1) & mask;
        steps++;
    }
    v->ops++;
    v->probes += steps;
    /* append: the index was sized for every symbol plus what stamps can add; past half
     * full it grows (and is rebuilt keyed if this went over the budget) */
    size_t nsym = v->syms.len;
    int grow = (nsym + v->added.len + 1) * 2 > v->icap;
    if (grow || V2_OVER_BUDGET(v)) {
        if (!v2_fill(r, v, grow ? v->icap * 2 : v->icap))
            return -1;
        mask = v->icap - 1;
        i = (size_t)(v->keyed ? v2_hash(v, s, n) : h) & mask;
        while (v->index[i] >= 0) {
            i = (i + 1) & mask;
            v->probes++;
        }
    }
    Str *a = vec_push(&v->added, 1);
    if (a == NULL)
        return -1;
    a->s = s;
    a->n = n;
    int64_t ref = (int64_t)(nsym + v->added.len - 1);
    if (ref > INT32_MAX) {
        INVALID(&r->err, "symbols table too large");
        return -1;
    }
    v->index[i] = (int32_t)ref;
    return ref;
}

static int
v2_build_index(Req *r, V2 *v)
{
    size_t nsym = v->syms.len;
    size_t cap = 64;
    while (cap < (nsym + 16) * 2)
        cap *= 2;
    if (nsym > INT32_MAX) {
        INVALID(&r->err, "symbols table too large");
        return 0;
    }
    v->seed = r->table->v2_seed;
    if (!v2_fill(r, v, cap))
        return 0;
    if (nsym == 0) {
        /* a table that is to hold anything starts with "" */
        if (v2_ref(r, v, (const uint8_t *)"", 0, hash_bytes((const uint8_t *)"", 0, v->seed)) < 0)
            return 0;
    }
    return 1;
}

/* The refs (name, value per label) of an entry's stamp in this request, memoized. */
static const uint32_t *
v2_stamp_refs(Req *r, V2 *v, const Entry *en)
{
    if (v->mlen * 2 + 2 > v->mcap) {
        size_t cap = v->mcap ? v->mcap * 2 : 64;
        const Entry **keys = calloc(cap, sizeof(Entry *));
        size_t *vals = malloc(cap * sizeof(size_t));
        if (keys == NULL || vals == NULL) {
            free(keys);
            free(vals);
            r->arena.failed = 1;
            return NULL;
        }
        for (size_t k = 0; k < v->mcap; k++) {
            if (v->memo_key[k] == NULL)
                continue;
            size_t j = ((uintptr_t)v->memo_key[k] >> 4) * 0x9E3779B97F4A7C15ULL >> 20 & (cap - 1);
            while (keys[j] != NULL)
                j = (j + 1) & (cap - 1);
            keys[j] = v->memo_key[k];
            vals[j] = v->memo_val[k];
        }
        free(v->memo_key);
        free(v->memo_val);
        v->memo_key = keys;
        v->memo_val = vals;
        v->mcap = cap;
    }
    size_t mask = v->mcap - 1;
    size_t j = ((uintptr_t)en >> 4) * 0x9E3779B97F4A7C15ULL >> 20 & mask;
    while (v->memo_key[j] != NULL) {
        if (v->memo_key[j] == en)
            return (uint32_t *)v->refpool.data + v->memo_val[j];
        j = (j + 1) & mask;
    }
    size_t off = v->refpool.len;
    if (vec_push(&v->refpool, 2 * (size_t)en->nlabels) == NULL)
        return NULL;
    const StampLabel *sl = ENTRY_LABELS(en);
    for (uint32_t i = 0; i < en->nlabels; i++) {
        int64_t a = v2_ref(r, v, en->data + sl[i].name_off, sl[i].name_len, sl[i].name_hash);
        int64_t b = a < 0 ? -1
                          : v2_ref(r, v, en->data + sl[i].value_off, sl[i].value_len,
                                   sl[i].value_hash);
        if (b < 0)
            return NULL;
        uint32_t *pool = (uint32_t *)v->refpool.data + off;
        pool[2 * i] = (uint32_t)a;
        pool[2 * i + 1] = (uint32_t)b;
    }
    v->memo_key[j] = en;
    v->memo_val[j] = off;
    v->mlen++;
    return (uint32_t *)v->refpool.data + off;
}

static int
decode_packed(Req *r, V2 *v, const uint8_t *raw, size_t p, size_t end)
{
    while (p < end) {
        uint64_t x;
        if (!rd_varint(raw, end, &p, &x)) {
            INVALID(&r->err, "packed varints run past their field");
            return 0;
        }
        uint32_t *slot = vec_push(&v->refs, 1);
        if (slot == NULL)
            return 0;
        *slot = x > UINT32_MAX ? UINT32_MAX : (uint32_t)x;
        v->refmax = x > v->refmax ? x : v->refmax;
    }
    return 1;
}

/* Emit a stamped 2.0 series: its new labels_refs (kept refs as they were, stamp labels
 * by the request's refs of their strings) first, then every other field as it was. */
static void
emit_series_v2(Req *r, V2 *v, size_t start, size_t s, size_t q, const Lab *m, size_t mn,
               const uint32_t *sr, size_t refs_end, int simple, int *inserted)
{
    const uint8_t *raw = r->raw;
    size_t plen = 0;
    for (size_t i = 0; i < mn; i++) {
        uint32_t a = m[i].r0, b = m[i].r1;
        if (a == STAMP_REF) {
            a = sr[2 * m[i].stamp_ix];
            b = sr[2 * m[i].stamp_ix + 1];
        }
        plen += varint_len(a) + varint_len(b);
    }
    size_t other = 0;
    if (simple)
        other = q - refs_end;
    else
        for (size_t p = s; p < q;) {
            Field f;
            rd_field(raw, p, q, &f, &r->err); /* read before: cannot fail */
            if (f.number != 1)
                other += f.end - p;
            p = f.end;
        }
    size_t body = 1 + varint_len(plen) + plen + other;
    uint8_t *buf = arena_alloc(&r->arena, 11 + 11 + plen);
    if (buf == NULL)
        return;
    size_t k = 0;
    buf[k++] = 0x2A;
    k += put_varint(buf + k, body);
    buf[k++] = 0x0A;
    k += put_varint(buf + k, plen);
    for (size_t i = 0; i < mn; i++) {
        uint32_t a = m[i].r0, b = m[i].r1;
        if (a == STAMP_REF) {
            a = sr[2 * m[i].stamp_ix];
            b = sr[2 * m[i].stamp_ix + 1];
        }
        k += put_varint(buf + k, a);
        k += put_varint(buf + k, b);
    }
    size_t at = v->has_symbols ? v->symbols_end : 0;
    if (!*inserted && at <= start) {
        emit_input(r, at);
        emit(r, NULL, 0); /* the symbols placeholder */
        *inserted = 1;
    }
    emit_input(r, start);
    emit(r, buf, k);
    if (simple)
        emit(r, raw + refs_end, q - refs_end);
    else
        for (size_t p = s; p < q;) {
            Field f;
            rd_field(raw, p, q, &f, &r->err);
            if (f.number != 1)
                emit(r, raw + p, f.end - p);
            p = f.end;
        }
    r->copy_from = q;
}

static void
series_v2(Req *r, V2 *v, size_t start, size_t s, size_t q, int *inserted)
{
    const uint8_t *raw = r->raw;
    Err *e = &r->err;
    r->series++;
    r->series_id++;
    v->refs.len = 0;
    v->refmax = 0;
    /* simple: at most one labels_refs field, and it comes first (then the other fields
     * are the one span [refs_end, q)) */
    int simple = 1, seen_refs = 0;
    size_t refs_end = s;
    size_t p = s;
    while (p < q) {
        Field f;
        if (!rd_field(raw, p, q, &f, e))
            return;
        if (f.number == 1) {
            if (!seen_refs && p == s)
                refs_end = f.end;
            else
                simple = 0;
            seen_refs = 1;
            if (f.wt == 2) {
                if (!decode_packed(r, v, raw, f.ps, f.end))
                    return;
            }
            else if (f.wt == 0) {
                uint64_t x = 0;
                size_t pp = f.ps;
                rd_varint(raw, f.end, &pp, &x);
                uint32_t *slot = vec_push(&v->refs, 1);
                if (slot == NULL)
                    return;
                *slot = x > UINT32_MAX ? UINT32_MAX : (uint32_t)x;
                v->refmax = x > v->refmax ? x : v->refmax;
            }
            else {
                INVALID(e, "labels_refs with a wrong wire type");
                return;
            }
        }
        else if (f.number >= 2 && f.number <= 5) {
            if (f.wt != 2) {
                INVALID(e, "series data field with a wrong wire type");
                return;
            }
            int ok;
            if (f.number == 2) {
                r->samples++;
                ok = check_sample(raw, f.ps, f.end, 3, e);
            }
            else if (f.number == 3) {
                r->histograms++;
                ok = check_histogram(raw, f.ps, f.end, 17, e);
            }
            else if (f.number == 4) {
                r->exemplars++;
                ok = check_exemplar_v2(raw, f.ps, f.end, v->syms.len, e);
            }
            else
                ok = check_metadata_v2(raw, f.ps, f.end, v->syms.len, e);
            if (!ok)
                return;
        }
        p = f.end;
    }
    size_t nrefs = v->refs.len;
    uint32_t *refs = v->refs.data;
    size_t nsym = v->syms.len;
    if (nrefs & 1) {
        INVALID(e, "labels_refs has an odd number of entries");
        return;
    }
    if (nrefs && v->refmax >= nsym) {
        /* the largest, as the reference names it (and the exemplar check) */
        INVALID(e, "symbol reference %llu past the table of %zu",
                (unsigned long long)v->refmax, nsym);
        return;
    }
    const Str *syms = v->syms.data;
    const int16_t *slots = v->slots.data;
    const Plan *pl = r->plan;
    r->labs.len = 0;
    size_t n = nrefs / 2;
    Lab *labs = vec_push(&r->labs, n);
    if (labs == NULL && n)
        return;
    int any_stamped = 0, sorted;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = refs[2 * i], b = refs[2 * i + 1];
        Lab *lab = &labs[i];
        lab->name = syms[a].s;
        lab->nlen = (uint32_t)syms[a].n;
        lab->value = syms[b].s;
        lab->vlen = (uint32_t)syms[b].n;
        lab->r0 = a;
        lab->r1 = b;
        int slot = slots[a];
        lab->slot = slot;
        if (slot >= 0) {
            r->seen[slot] = r->series_id;
            r->vals[slot].s = lab->value;
            r->vals[slot].n = lab->vlen;
            r->vrefs[slot] = b;
            any_stamped |= pl->flags[slot] & FLAG_STAMPED;
        }
    }
    if (!check_names(r, labs, n, &sorted, v)) {
        name_series(e, r->series - 1, labs, n);
        return;
    }
    int reason;
    const Entry *en = decide(r, v, &reason);
    if (r->arena.failed)
        return;
    if (e->kind)
        return;
    if (en != NULL && pl->max_labels && n + en->nlabels > pl->max_labels
        && stamp_over_limit(r, labs, n, en)) {
        en = NULL; /* forwarded unstamped, the sender's karta_* dropped all the same */
        reason = REASON_LABEL_LIMIT;
    }
    tally(r, en ? -1 : reason);
    if (en == NULL || en->nlabels == 0) {
        /* not stamped: under drop_sent the sender's karta_* labels go (their refs; the
         * table keeps its strings); `keep` (NULL, reason -1) lets them pass */
        size_t k = n;
        if (pl->drop_sent && !(en == NULL && reason == -1)) {
            k = kept_labels(r, labs, n);
            if (k == (size_t)-1)
                return;
            if (k != n && empty_after_drop(pl, labs, n)) {
                err_set(e, "invalid_labels", NO_LABELS_LEFT);
                name_series(e, r->series - 1, labs, n);
                return;
            }
            r->stripped += k != n;
        }
        if (sorted && k == n)
            return;
        const Lab *m = sorted_labels(r, labs, n, k);
        if (m != NULL)
            emit_series_v2(r, v, start, s, q, m, k, NULL, refs_end, simple, inserted);
        return;
    }
    const uint32_t *sr;
    size_t at = stamp_position(labs, n, en, sorted && !any_stamped);
    if (at != NO_POSITION && pl->drop_sent && karta_around(labs, n, at, en))
        at = NO_POSITION; /* a sender's karta_* label to drop: the merge does it */
    if (at != NO_POSITION) {
        if ((v->index == NULL && !v2_build_index(r, v)) || (sr = v2_stamp_refs(r, v, en)) == NULL)
            return;
        /* the usual case: the stamp's labels go in as one block at `at` */
        Lab *m = vec_push(&r->merged, 0); /* reuse merged's storage */
        r->merged.len = 0;
        m = vec_push(&r->merged, n + en->nlabels);
        if (m == NULL)
            return;
        memcpy(m, labs, at * sizeof(Lab));
        for (uint32_t i = 0; i < en->nlabels; i++) {
            m[at + i].r0 = m[at + i].r1 = STAMP_REF;
            m[at + i].stamp_ix = i;
        }
        memcpy(m + at + en->nlabels, labs + at, (n - at) * sizeof(Lab));
        emit_series_v2(r, v, start, s, q, m, n + en->nlabels, sr, refs_end, simple, inserted);
        return;
    }
    int lost;
    if (!merge_stamp(r, r->labs.data, n, en, &lost))
        return;
    Lab *m = r->merged.data;
    size_t mn = r->merged.len;
    labs = r->labs.data;
    if (mn == n) {
        int same = 1;
        for (size_t i = 0; i < n && same; i++)
            /* (a kept label is labs[i] itself: its value is not compared again; a stamp's
             * costs at most its own bytes) */
            same = lab_cmp(r, &m[i], &labs[i]) == 0 &&
                   ((m[i].value == labs[i].value && m[i].vlen == labs[i].vlen) ||
                    str_cmp(m[i].value, m[i].vlen, labs[i].value, labs[i].vlen) == 0);
        if (same)
            return;
    }
    r->stripped += (uint64_t)lost;
    if ((v->index == NULL && !v2_build_index(r, v)) || (sr = v2_stamp_refs(r, v, en)) == NULL)
        return;
    emit_series_v2(r, v, start, s, q, r->merged.data, mn, sr, refs_end, simple, inserted);
}

static void
walk_v2(Req *r, V2 *v, size_t n)
{
    r->v2 = v;
    if (!v2_scan(r, v, n) || oom(r))
        return;
    int inserted = 0;
    size_t *series = v->series.data;
    for (size_t i = 0; i < v->series.len / 3 && !r->err.kind; i++) {
        series_v2(r, v, series[3 * i], series[3 * i + 1], series[3 * i + 2], &inserted);
        if (oom(r) || over_limit(r, series[3 * i + 2], n))
            return;
    }
    if (r->err.kind || r->spans.len == 0)
        return;
    if (!inserted) {
        emit_input(r, v->has_symbols ? v->symbols_end : 0);
        emit(r, NULL, 0);
    }
    /* fill the placeholder with the appended symbols */
    size_t len = 0;
    Str *added = v->added.data;
    for (size_t i = 0; i < v->added.len; i++)
        len += 1 + varint_len(added[i].n) + added[i].n;
    uint8_t *buf = arena_alloc(&r->arena, len ? len : 1);
    if (buf == NULL)
        return;
    size_t k = 0;
    for (size_t i = 0; i < v->added.len; i++) {
        buf[k++] = 0x22;
        k += put_varint(buf + k, added[i].n);
        memcpy(buf + k, added[i].s, added[i].n);
        k += added[i].n;
    }
    Span *spans = r->spans.data;
    for (size_t i = 0; i < r->spans.len; i++)
        if (spans[i].p == NULL) {
            spans[i].p = buf;
            spans[i].n = k;
            r->out_len += k;
        }
}

/* ------------------------------------------------------------------------------------ */
/* the entry points                                                                     */

/* The output of a walk: a bytes object of the spans (GIL held; r->ts saved state is
 * restored and saved again around the allocation). With `block` (the sender's snappy block,
 * decoding to raw at offset `base`), the output is a snappy block made from that block
 * (_snappy_edit.c) and *encoded is set; when that cannot be done, the plain bytes. Runs
 * with the table's read lock held: spans may point into entries. */
static PyObject *
splice_output(Req *r, const Py_buffer *block, size_t base, size_t n, int *encoded)
{
    *encoded = 0;
    PyObject *body = NULL;
    if (block != NULL) {
        size_t cap = snappy_edit_bound(r->out_len);
        PyEval_RestoreThread(r->ts);
        body = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        r->ts = PyEval_SaveThread();
        if (body == NULL)
            return NULL;
        size_t w = snappy_edit(block->buf, (size_t)block->len, base, r->raw, n, r->spans.data,
                               r->spans.len, r->out_len, (uint8_t *)PyBytes_AS_STRING(body),
                               cap);
        PyEval_RestoreThread(r->ts);
        if (w == 0)
            Py_CLEAR(body);
        else if (_PyBytes_Resize(&body, (Py_ssize_t)w) == 0)
            *encoded = 1;
        else
            PyErr_Clear(); /* body is NULL: the plain bytes below */
        r->ts = PyEval_SaveThread();
        if (body != NULL)
            return body;
    }
    /* the output object needs the GIL; the copy does not */
    PyEval_RestoreThread(r->ts);
    body = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)r->out_len);
    r->ts = PyEval_SaveThread();
    if (body != NULL) {
        uint8_t *o = (uint8_t *)PyBytes_AS_STRING(body);
        Span *sp = r->spans.data;
        for (size_t i = 0; i < r->spans.len; i++) {
            memcpy(o, sp[i].p, sp[i].n);
            o += sp[i].n;
        }
    }
    return body;
}

/* The snappy preamble's decoded length, or (size_t)-1. */
static size_t
snappy_declared(const Py_buffer *block)
{
    size_t head;
    int64_t n = snappy_block_length(block->buf, (size_t)block->len, &head);
    return n < 0 ? (size_t)-1 : (size_t)n;
}

static PyObject *
splice(PyObject *args, int version)
{
    PyObject *rawo, *blocko = Py_None, *grow = Py_None;
    Py_ssize_t base_arg = 0, limit = -1;
    Plan *pl;
    PodTable *t;
    if (!PyArg_ParseTuple(args, "OO!O!|OnnO", &rawo, &PlanType, &pl, &PodTableType, &t, &blocko,
                          &base_arg, &limit, &grow))
        return NULL;
    if (grow != Py_None && !PyCallable_Check(grow)) {
        PyErr_SetString(PyExc_TypeError, "grow must be callable or None");
        return NULL;
    }
    if (base_arg < 0) {
        PyErr_SetString(PyExc_ValueError, "base must not be negative");
        return NULL;
    }
    Py_buffer view, block;
    if (PyObject_GetBuffer(rawo, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    int with_block = blocko != Py_None;
    if (with_block && PyObject_GetBuffer(blocko, &block, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    size_t base = (size_t)base_arg;
    Req r;
    V2 v;
    memset(&v, 0, sizeof v);
    vec_init(&v.syms, sizeof(Str));
    vec_init(&v.slots, sizeof(int16_t));
    vec_init(&v.series, sizeof(size_t));
    vec_init(&v.added, sizeof(Str));
    vec_init(&v.refpool, sizeof(uint32_t));
    vec_init(&v.refs, sizeof(uint32_t));
    vec_init(&v.newrefs, sizeof(uint32_t));
    req_init(&r, pl, t, view.buf);
    if (limit >= 0) {
        r.limit = (size_t)limit;
        r.grow = grow == Py_None ? NULL : grow;
    }
    size_t n = (size_t)view.len;
    PyObject *body = NULL;
    int encoded = 0;
    /* the sender's block itself goes out when nothing changed and it is all of it */
    int whole = with_block && base == 0 && snappy_declared(&block) == n &&
                PyBytes_CheckExact(blocko);

    r.ts = PyEval_SaveThread();
    pthread_rwlock_rdlock(&t->lock);
    if (version == 1)
        walk_v1(&r, n);
    else
        walk_v2(&r, &v, n);
    oom(&r);
    if (!r.err.kind && (r.spans.len || (with_block && !whole))) {
        emit_input(&r, n);
        if (!oom(&r))
            body = splice_output(&r, with_block ? &block : NULL, base, n, &encoded);
    }
    pthread_rwlock_unlock(&t->lock);
    PyEval_RestoreThread(r.ts);
    v2_last_ops = v.ops;
    v2_last_probes = v.probes;
    v2_last_keyed = v.keyed;
    v2_last_key_bytes = v.key_bytes;
    v2_last_cmp_bytes = v.cmp_bytes;
    v2_last_ranked = v.rank != NULL;

    PyObject *result = NULL;
    if (r.err.kind == OVER_LIMIT) {
        Py_XDECREF(body);
        result = PyLong_FromSize_t(r.need);
        goto done;
    }
    if (r.err.kind) {
        Py_XDECREF(body);
        if (!r.err.python)
            err_raise(&r.err);
        else if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "an unless matcher failed");
        goto done;
    }
    if (r.spans.len && body == NULL) {
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        goto done; /* MemoryError set */
    }
    if (body == NULL) {
        if (whole) {
            body = Py_NewRef(blocko);
            encoded = 1;
        } else if (PyBytes_CheckExact(rawo))
            body = Py_NewRef(rawo);
        else if ((body = PyBytes_FromStringAndSize(view.buf, view.len)) == NULL)
            goto done;
    }
    PyObject *reasons = PyDict_New();
    if (reasons == NULL) {
        Py_DECREF(body);
        goto done;
    }
    for (size_t i = 0; i < r.ntally; i++) {
        if (!r.tally[i])
            continue;
        PyObject *cnt = PyLong_FromUnsignedLongLong(r.tally[i]);
        if (cnt == NULL || PyDict_SetItem(reasons, PyList_GET_ITEM(t->reasons, i), cnt) < 0) {
            Py_XDECREF(cnt);
            Py_DECREF(reasons);
            Py_DECREF(body);
            goto done;
        }
        Py_DECREF(cnt);
    }
    PyObject *limited = r.limited_labels
                            ? Py_BuildValue("(y#nn)", (const char *)r.limited_name,
                                            (Py_ssize_t)r.limited_nlen,
                                            (Py_ssize_t)r.limited_labels,
                                            (Py_ssize_t)pl->max_labels)
                            : Py_NewRef(Py_None);
    if (limited == NULL) {
        Py_DECREF(reasons);
        Py_DECREF(body);
        goto done;
    }
    PyObject *other = r.other_cluster != NULL
                          ? PyBytes_FromStringAndSize((const char *)r.other_cluster,
                                                      (Py_ssize_t)r.other_cluster_n)
                          : Py_NewRef(Py_None);
    if (other == NULL) {
        Py_DECREF(limited);
        Py_DECREF(reasons);
        Py_DECREF(body);
        goto done;
    }
    result = Py_BuildValue("(NKKKKKNKONnN)", body, (unsigned long long)r.series,
                           (unsigned long long)r.samples, (unsigned long long)r.histograms,
                           (unsigned long long)r.exemplars, (unsigned long long)r.attributed, reasons,
                           (unsigned long long)r.stripped, encoded ? Py_True : Py_False,
                           limited, (Py_ssize_t)(v.keyed ? v.syms.len : 0), other);
done:
    req_free(&r);
    v2_free(&v);
    if (with_block)
        PyBuffer_Release(&block);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
splice_v1_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    return splice(args, 1);
}

static PyObject *
splice_v2_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    return splice(args, 2);
}

/* Where an RW 1.0 request can be cut into `pieces` parts that are spliced apart: the end of
 * the first top-level field at or past each k / pieces of the body (k = 1 .. pieces - 1),
 * never the body's end. The splice has no request-level state in RW 1.0, so splicing the
 * parts and concatenating them is splicing the whole (docs/wire.md). Framing is read with
 * the splice's rules; a field it cannot read means no cut at all (the whole request then
 * gets the splice's error). Mirrors splice_v1.split_points. */
static PyObject *
split_v1_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *rawo;
    Py_ssize_t pieces;
    if (!PyArg_ParseTuple(args, "On:split_v1", &rawo, &pieces))
        return NULL;
    if (pieces < 1) {
        PyErr_SetString(PyExc_ValueError, "pieces must be at least 1");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(rawo, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *cuts = PyList_New(0);
    if (cuts == NULL)
        goto done;
    const uint8_t *raw = view.buf;
    size_t n = (size_t)view.len, pos = 0, k = 1, parts = (size_t)pieces;
    Err e;
    memset(&e, 0, sizeof e);
    while (pos < n && k < parts) {
        Field f;
        if (!rd_field(raw, pos, n, &f, &e)) {
            Py_SETREF(cuts, PyList_New(0));
            break;
        }
        pos = f.end;
        if (pos < n && pos >= n * k / parts) {
            PyObject *o = PyLong_FromSize_t(pos);
            if (o == NULL || PyList_Append(cuts, o) < 0) {
                Py_XDECREF(o);
                Py_CLEAR(cuts);
                break;
            }
            Py_DECREF(o);
            k++;
        }
    }
done:
    PyBuffer_Release(&view);
    return cuts;
}

/* The end of every top-level field of a request, as native uint32 in one bytes object: 4 bytes
 * a field where a list of ints costs ~40 (a request cut in parts after a 413 has one field a
 * series, 620k of them in a 31 MiB body: proxy.wire.halves). With count_only, how many fields
 * there are, nothing allocated (what the caller charges before asking for the ends). None when
 * a field cannot be read (the caller reads it again to say why); ValueError for a body of
 * 4 GiB or more. */
static PyObject *
field_ends_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    PyObject *rawo;
    int count_only = 0;
    if (!PyArg_ParseTuple(args, "O|p:field_ends", &rawo, &count_only))
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(rawo, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    const uint8_t *raw = view.buf;
    size_t n = (size_t)view.len, pos = 0, count = 0;
    if (n > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "a body of 4 GiB or more");
        goto done;
    }
    Err e;
    memset(&e, 0, sizeof e);
    while (pos < n) {
        Field f;
        if (!rd_field(raw, pos, n, &f, &e)) {
            out = Py_NewRef(Py_None);
            goto done;
        }
        pos = f.end;
        count++;
    }
    if (count_only) {
        out = PyLong_FromSize_t(count);
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(count * sizeof(uint32_t)));
    if (out == NULL)
        goto done;
    char *dst = PyBytes_AS_STRING(out);
    pos = 0;
    for (size_t i = 0; i < count; i++) {
        Field f;
        rd_field(raw, pos, n, &f, &e); /* read once already */
        pos = f.end;
        uint32_t end = (uint32_t)pos;
        memcpy(dst + i * sizeof end, &end, sizeof end);
    }
done:
    PyBuffer_Release(&view);
    return out;
}

/* RW 2.0 -> 1.0 (_convert.c), with the GIL released. size -1: the size the request
 * converts to (an int; nothing of it allocated), or None when the request holds something
 * left to the Python reference (proxy/wire/convert.py: anything malformed, the reference
 * raises its error). With the size a counting call answered: the converted bytes,
 * allocated once at that size (None as before; ValueError for any other size). form
 * (convert_v2_form): the count as (size, histograms, samples), the V1Form's. */
static PyObject *
convert_v2_impl(PyObject *args, int form)
{
    PyObject *rawo;
    Py_ssize_t size = -1;
    if (form) {
        if (!PyArg_ParseTuple(args, "O:convert_v2_form", &rawo))
            return NULL;
    }
    else if (!PyArg_ParseTuple(args, "O|n:convert_v2", &rawo, &size))
        return NULL;
    if (size < -1) {
        PyErr_SetString(PyExc_ValueError, "size must be -1 or at least 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(rawo, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *out = NULL;
    const uint8_t *raw = view.buf;
    size_t n = (size_t)view.len, got = 0;
    ConvertInfo info;
    memset(&info, 0, sizeof info);
    ConvertStatus st;
    if (size < 0) {
        Py_BEGIN_ALLOW_THREADS
        st = convert_v2_to_v1(raw, n, NULL, 0, &got, &info);
        Py_END_ALLOW_THREADS
        if (st == CONVERT_OK)
            out = form ? Py_BuildValue("(nKK)", (Py_ssize_t)got,
                                       (unsigned long long)info.histograms,
                                       (unsigned long long)info.samples)
                       : PyLong_FromSize_t(got);
    }
    else {
        out = PyBytes_FromStringAndSize(NULL, size);
        if (out == NULL)
            goto done;
        uint8_t *dst = (uint8_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        st = convert_v2_to_v1(raw, n, dst, (size_t)size, &got, &info);
        Py_END_ALLOW_THREADS
        if (st != CONVERT_OK)
            Py_CLEAR(out);
    }
    if (st == CONVERT_FALLBACK)
        out = Py_NewRef(Py_None);
    else if (st == CONVERT_NOMEM)
        PyErr_NoMemory();
    else if (st == CONVERT_MISMATCH)
        PyErr_Format(PyExc_ValueError, "convert_v2: the request converts to %zu bytes, not %zd",
                     got, size);
done:
    PyBuffer_Release(&view);
    return out;
}

static PyObject *
convert_v2_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    return convert_v2_impl(args, 0);
}

static PyObject *
convert_v2_form_py(PyObject *Py_UNUSED(m), PyObject *args)
{
    return convert_v2_impl(args, 1);
}

/* Tests only: convert.format_le as _convert.c writes it. */
static PyObject *
format_le_py(PyObject *Py_UNUSED(m), PyObject *arg)
{
    double b = PyFloat_AsDouble(arg);
    if (b == -1.0 && PyErr_Occurred())
        return NULL;
    char buf[32];
    size_t k = convert_format_le(b, buf);
    return PyBytes_FromStringAndSize(buf, (Py_ssize_t)k);
}

static PyObject *
set_error_class(PyObject *Py_UNUSED(m), PyObject *cls)
{
    if (!PyType_Check(cls) || !PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_Exception)) {
        PyErr_SetString(PyExc_TypeError, "an exception class is needed");
        return NULL;
    }
    Py_XSETREF(DecodeErrorType, Py_NewRef(cls));
    Py_RETURN_NONE;
}

/* Tests only: the RW 2.0 index seed of the tables made from now on (None: a new random
 * one); answers the previous one. A table keeps the seed it was made with. */
static PyObject *
set_v2_seed(PyObject *Py_UNUSED(m), PyObject *arg)
{
    uint64_t old = v2_seed;
    if (arg == Py_None) {
        if (getrandom(&v2_seed, sizeof v2_seed, 0) != (ssize_t)sizeof v2_seed)
            return PyErr_SetFromErrno(PyExc_OSError);
    }
    else {
        unsigned long long x = PyLong_AsUnsignedLongLongMask(arg);
        if (x == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        v2_seed = (uint64_t)x;
    }
    return PyLong_FromUnsignedLongLong(old);
}

/* Tests only: the RW 2.0 symbol index work of this thread's last splice. */
static PyObject *
v2_index_stats(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(arg))
{
    return Py_BuildValue("(KKO)", (unsigned long long)v2_last_ops,
                         (unsigned long long)v2_last_probes, v2_last_keyed ? Py_True : Py_False);
}

/* Tests only: the bytes this thread's last RW 2.0 splice hashed for pod keys and compared
 * in long label names, and whether it ranked its symbols; and the bytes of metadata
 * strings this thread's last conversion hashed and compared. Work counted, not timed. */
static PyObject *
v2_work_stats(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(arg))
{
    return Py_BuildValue("(KKO)", (unsigned long long)v2_last_key_bytes,
                         (unsigned long long)v2_last_cmp_bytes,
                         v2_last_ranked ? Py_True : Py_False);
}

static PyObject *
convert_stats_py(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(arg))
{
    return PyLong_FromUnsignedLongLong((unsigned long long)convert_last_meta_bytes());
}

static PyMethodDef module_methods[] = {
    {"splice_v1", splice_v1_py, METH_VARARGS,
     "splice_v1(raw, plan, table[, block, base, limit, grow]) -> (body, series, samples, "
     "histograms, exemplars, attributed, {reason: count}, stripped, encoded, limited): "
     "limited, the first series the stamp would have pushed past the plan's max_labels, "
     "as (__name__, labels with the stamp, max_labels), or None; with block (a "
     "snappy block decoding to raw at offset base), body is the output as a snappy block when "
     "encoded; with limit >= 0, the bytes the splice may hold beside raw: past it grow(need) "
     "is asked for a new limit (need: the estimate for the whole request), and when it gives "
     "none above what is held, the answer is need (an int) instead of the tuple"},
    {"splice_v2", splice_v2_py, METH_VARARGS,
     "splice_v2(raw, plan, table[, block, base, limit, grow]): as splice_v1, RW 2.0"},
    {"split_v1", split_v1_py, METH_VARARGS,
     "split_v1(raw, pieces) -> [offsets where the RW 1.0 request can be cut into pieces]"},
    {"field_ends", field_ends_py, METH_VARARGS,
     "field_ends(raw, count_only=False) -> the end of every top-level field as native "
     "uint32 bytes (the count with count_only), or None when one cannot be read"},
    {"convert_v2", convert_v2_py, METH_VARARGS,
     "convert_v2(raw, size=-1) -> with size -1, the size of the RW 2.0 request raw as RW "
     "1.0 (None: left to the Python reference); with that size, the RW 1.0 bytes (or None)"},
    {"convert_v2_form", convert_v2_form_py, METH_VARARGS,
     "convert_v2_form(raw) -> (size, histograms, samples): convert_v2's size and how the "
     "conversion changes the counts (convert.V1Form: custom-bucket histograms and the "
     "staleness markers that end them become classic series), or None: left to the Python reference"},
    {"_format_le", format_le_py, METH_O,
     "_format_le(bound) -> convert.format_le(bound) as the native conversion writes it: "
     "tests only"},
    {"_set_v2_seed", set_v2_seed, METH_O,
     "_set_v2_seed(seed or None) -> the previous: tests only, the RW 2.0 index seed of the "
     "tables made from now on"},
    {"_v2_index_stats", v2_index_stats, METH_NOARGS,
     "_v2_index_stats() -> (ops, probes, keyed): tests only, the RW 2.0 symbol index's "
     "inserts and lookups, their probe steps past the first, and whether it was rebuilt "
     "keyed, in this thread's last splice"},
    {"_v2_work_stats", v2_work_stats, METH_NOARGS,
     "_v2_work_stats() -> (key_bytes, cmp_bytes, ranked): tests only, the bytes of namespace "
     "and pod symbols hashed for pod keys and of long label names compared (ranking "
     "included) in this thread's last RW 2.0 splice, and whether it ranked its symbols"},
    {"_convert_stats", convert_stats_py, METH_NOARGS,
     "_convert_stats() -> bytes of metadata strings hashed and compared in this thread's "
     "last convert_v2 call: tests only"},
    {"set_error_class", set_error_class, METH_O,
     "the exception raised for bad input: cls(kind, status, message)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_splice", "The native remote-write splice (see _splice.c).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__splice(void)
{
    /* the hash seeds a sender must not know: the conversion's metadata set, the RW 2.0
     * symbol index and its keyed fallback, the pod tables' keys */
    uint64_t seed[5];
    uint64_t weak = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)&seed;
    if (getrandom(seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed)
        for (int i = 0; i < 5; i++) /* no entropy yet: the time, ASLR's address, clock() */
            seed[i] = hash_bytes((const uint8_t *)&i, sizeof i, weak ^ (uint64_t)clock());
    convert_seed(seed[0]);
    v2_seed = seed[1];
    v2_sip_k0 = seed[2];
    v2_sip_k1 = seed[3];
    table_seed = seed[4];
    if (PyType_Ready(&PodTableType) < 0 || PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "PodTable", (PyObject *)&PodTableType) < 0 ||
        PyModule_AddObjectRef(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
