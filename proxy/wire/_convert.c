/*
 * RW 2.0 -> 1.0 natively (see _convert.h).
 *
 * Why: a 1.0-only upstream (Prometheus before 3.0, VictoriaMetrics) gets every RW 2.0
 * request converted. In Python (proxy/wire/convert.py: v1_form, then v2_to_v1) that cost
 * ~180 ms of CPU for a 2,000-series request, ~100x the native splice of the same request.
 *
 * What: exactly what convert.py's reference does for the requests it handles here (that
 * module is the oracle; tests/wire/test_convert_native.py holds the two byte-equal on
 * random requests, and the bounded fuzz run of tests/wire/fuzz_native.py looks for
 * crashes, also under ASan/UBSan):
 *
 *   - every series becomes one RW 1.0 TimeSeries (but one of nothing but custom-bucket
 *     histograms, below): its labels_refs (packed or not) resolved
 *     to Label fields as encode_label_v1 writes them (an empty value left out), then its
 *     samples (start_timestamp, field 3, dropped), its exemplars (labels resolved, the other
 *     fields' bytes as they were), its histograms (start_timestamp, field 17, dropped): the
 *     1.0 field order; created_timestamp and unknown fields go nowhere;
 *   - series metadata becomes one 1.0 MetricMetadata per family (convert.family_name: the
 *     suffix of a histogram, gaugehistogram or summary series stripped), deduplicated on
 *     its contents in first-seen order, after the series. Each symbol a metadata names is
 *     hashed and compared once per request (intern), not once per series naming it;
 *   - a histogram with custom buckets (schema -53) becomes
 *     the classic series (convert.custom_buckets, classic_series): <name>_bucket{le=...}
 *     per bound and +Inf (cumulative counts), <name>_sum, <name>_count, each one
 *     TimeSeries of one sample after the series (which is sent only when something but
 *     such histograms is left), the labels sorted as Python's stable sorted() by name
 *     bytes, le as format_le writes it (Go's shortest 'g'); the counts' change
 *     (ConvertInfo: a histogram fewer, a sample more per bucket, _sum and _count) as
 *     convert.v1_form's. The size pass adds up lengths (O(1) a bucket); only the write
 *     sorts and writes the labels;
 *   - a histogram whose sum is the stale NaN (a staleness marker) goes where
 *     convert._series_v1 puts it: of schema -53, a classic entry at its place, every
 *     value the stale NaN, its bounds its own or (none) the entry's before it in the
 *     series; of another schema, once the series is read (place_marks): a histogram
 *     after the series' others when it has an exponential histogram that is no marker,
 *     else a classic entry at the end with the last entry's bounds when it has
 *     custom-bucket ones, else a float stale marker after the series' samples. The size
 *     pass sizes a borrowing marker's buckets once per bounds and timestamp length, so
 *     markers that borrow a long list of bounds cost O(1) each there.
 *
 * What is left to the reference (CONVERT_FALLBACK): a custom-bucket
 * histogram with a bucket past its bounds (the reference raises protobuf_invalid) or
 * whose running delta sum or span index leaves an int64 (the reference's ints do not
 * overflow), and anything the reference would refuse (every check of
 * splice_v2.scan_v2 / split_series_v2 is made here too, and a request failing one falls
 * back so the reference raises its own error).
 *
 * One walk for the size and the bytes: the Writer counts when it has no buffer. A series'
 * TimeSeries length is its body counted first (the same code, a counting Writer), so the
 * size pass and the conversion cannot drift; a classic series' length is computed from
 * the lengths it adds up (the same in both passes), and a write that does not end at
 * exactly the size counted is CONVERT_MISMATCH. Sizes are size_t with every addition checked:
 * one that does not fit falls back (the reference then computes it with Python ints).
 *
 * The wire primitives are _wire.h's, shared with _splice.c; this file has no Python API
 * and no state of the splice.
 */

#include "_convert.h"
#include "_wire.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------ */
/* wire primitives: _wire.h's (rd_varint, wire_field, utf8_ok, the wire-type tables)       */

/* One field at pos inside [.., end), yes or no: the reference raises its own error. */
static inline int
rd_field(const uint8_t *buf, size_t pos, size_t end, Field *f)
{
    f->wt = 0;
    f->number = 0;
    f->ps = f->end = pos; /* set on success; for gcc, which cannot see that through */
    return wire_field(buf, pos, end, f) == WIRE_OK;
}

static inline uint64_t
le64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

/* ------------------------------------------------------------------------------------ */
/* the checks the reference makes (primitives.check_*), each a yes or no                 */


static int
check_fields(const uint8_t *raw, size_t p, size_t end, const int8_t *wts, uint64_t nk)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f))
            return 0;
        if (f.number <= nk && wts[f.number - 1] >= 0 && f.wt != wts[f.number - 1])
            return 0;
        p = f.end;
    }
    return 1;
}

/* The stale NaN: a histogram whose sum is it is a staleness marker. */
#define STALE_NAN_BITS 0x7FF0000000000002ULL
/* a bucket whose counts add up to NaN: this NaN, whatever the counts' payloads (which
 * operand's payload a sum of two NaNs keeps is the compiler's choice); convert.py's */
#define QUIET_NAN_BITS 0x7FF8000000000000ULL
/* zigzag(-53): the schema of custom buckets */
#define CUSTOM_BUCKETS_ZIGZAG 105u

/* What check_histogram found of a histogram convert.py has rules of its own for, as
 * custom_buckets and stale_marker read it: its last schema -53 (HIST_CUSTOM: classic
 * series), its last sum the stale NaN (HIST_STALE: a staleness marker, whatever the
 * schema; series() places it). */
#define HIST_CUSTOM 1
#define HIST_STALE 2

/* An RW 2.0 Histogram: check_histogram(17)'s checks; *kind its HIST_* flags. */
static int
check_histogram(const uint8_t *raw, size_t p, size_t end, int *kind_out)
{
    uint64_t schema = 0, sum = 0;
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f))
            return 0;
        int kind = f.number <= 17 ? HISTOGRAM_WT[f.number - 1] : -1;
        if (kind == H_SPANS) {
            if (f.wt != 2 || !check_fields(raw, f.ps, f.end, SPAN_WT, 2))
                return 0;
        }
        else if (kind == H_VARINTS || kind == H_DOUBLES) {
            if (f.wt == 2) {
                if (kind == H_DOUBLES && (f.end - f.ps) % 8)
                    return 0;
                for (size_t pp = f.ps; kind == H_VARINTS && pp < f.end;) {
                    uint64_t x;
                    if (!rd_varint(raw, f.end, &pp, &x))
                        return 0;
                }
            }
            else if (f.wt != (kind == H_VARINTS ? 0 : 1))
                return 0;
        }
        else if (kind != -1 && f.wt != kind)
            return 0;
        if (f.number == 4) { /* schema (wire type 0, checked) */
            size_t pp = f.ps;
            rd_varint(raw, f.end, &pp, &schema); /* read by rd_field: cannot fail */
        }
        else if (f.number == 3) /* sum (fixed64, checked) */
            sum = le64(raw + f.ps);
        p = f.end;
    }
    *kind_out = (schema == CUSTOM_BUCKETS_ZIGZAG ? HIST_CUSTOM : 0) |
                (sum == STALE_NAN_BITS ? HIST_STALE : 0);
    return 1;
}

/* An RW 2.0 Exemplar: framing; its label refs an even number, inside the table. */
static int
check_exemplar(const uint8_t *raw, size_t p, size_t end, size_t nsym)
{
    size_t count = 0;
    uint64_t top = 0;
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f))
            return 0;
        if (f.number == 1) {
            if (f.wt != 2 && f.wt != 0)
                return 0;
            for (size_t pp = f.ps; pp < f.end;) {
                uint64_t x;
                if (!rd_varint(raw, f.end, &pp, &x))
                    return 0;
                count++;
                top = x > top ? x : top;
            }
        }
        else if (f.number <= 3 && f.wt != EXEMPLAR_WT[f.number - 1])
            return 0;
        p = f.end;
    }
    return !(count & 1) && !(count && top >= nsym);
}

/* An RW 2.0 Metadata: framing; help_ref and unit_ref inside the table. */
static int
check_metadata(const uint8_t *raw, size_t p, size_t end, size_t nsym)
{
    while (p < end) {
        Field f;
        if (!rd_field(raw, p, end, &f))
            return 0;
        if (f.number <= 4 && METADATA_V2_WT[f.number - 1] >= 0 &&
            f.wt != METADATA_V2_WT[f.number - 1])
            return 0;
        if (f.number == 3 || f.number == 4) {
            uint64_t x = 0;
            size_t pp = f.ps;
            rd_varint(raw, f.end, &pp, &x);
            if (x >= nsym)
                return 0;
        }
        p = f.end;
    }
    return 1;
}

/* ------------------------------------------------------------------------------------ */
/* the writer: counts when it has no buffer                                              */

typedef struct {
    uint8_t *buf; /* NULL: count only */
    size_t cap;
    size_t len;
    int over; /* counting: the size overflowed a size_t; writing: past cap */
} Writer;

static inline void
w_put(Writer *w, const uint8_t *p, size_t k)
{
    if (w->over)
        return;
    if (w->buf == NULL) {
        if (k > SIZE_MAX - w->len)
            w->over = 1;
        else
            w->len += k;
        return;
    }
    if (k > w->cap - w->len) {
        w->over = 1;
        return;
    }
    if (k)
        memcpy(w->buf + w->len, p, k);
    w->len += k;
}

static inline void
w_byte(Writer *w, uint8_t b)
{
    w_put(w, &b, 1);
}

static inline void
w_varint(Writer *w, uint64_t v)
{
    uint8_t tmp[10];
    size_t k = 0;
    while (v >= 0x80) {
        tmp[k++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    tmp[k++] = (uint8_t)v;
    w_put(w, tmp, k);
}

/* a length-delimited field's tag and length (field numbers below 16: one tag byte) */
static inline void
w_head(Writer *w, unsigned number, size_t len)
{
    w_byte(w, (uint8_t)(number << 3 | 2));
    w_varint(w, len);
}

/* ------------------------------------------------------------------------------------ */
/* growable arrays                                                                       */

typedef struct {
    const uint8_t *s;
    size_t n;
} Str;

typedef struct {
    void *data;
    size_t len, cap, item;
} Vec;

/* a field's payload */
typedef struct {
    size_t ps, end;
} Span;

/* One histogram that becomes classic series (convert._SeriesV1.classic): its payload
 * (its timestamp, and its bounds unless it borrows them) and how it goes. */
#define CL_STALE 1u  /* a staleness marker: every value the stale NaN, no counts read */
#define CL_BORROW 2u /* a marker that takes the bounds of the entry before it */
typedef struct {
    size_t ps, end;
    unsigned flags;
} Classic;

/* What a series' histogram staleness markers of a schema but -53 (c->marks) become
 * (convert._series_v1): with an exponential histogram in the series, histograms after
 * its others (MARK_HISTOGRAM); with custom-bucket ones, the end of their classic series
 * (MARK_CLASSIC, entries of c->nhcb); else float stale markers (MARK_FLOAT). */
enum { MARK_NONE, MARK_HISTOGRAM, MARK_CLASSIC, MARK_FLOAT };

/* A label of the series, for sorting: name, value, and its place (the sort is stable). */
typedef struct {
    Str name, value;
    size_t at;
} Sorted;

/* Room for one more item; NULL when out of memory. */
static void *
vec_push(Vec *v)
{
    if (v->len == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 16;
        if (cap > SIZE_MAX / v->item)
            return NULL;
        void *d = realloc(v->data, cap * v->item);
        if (d == NULL)
            return NULL;
        v->data = d;
        v->cap = cap;
    }
    return (char *)v->data + v->item * v->len++;
}

/* ------------------------------------------------------------------------------------ */
/* metadata, one per family                                                              */

typedef struct {
    Str name, help, unit;
    uint64_t type;
    uint32_t name_id, help_id, unit_id; /* the strings' ids (intern) */
    uint64_t hash;
} Meta;

/* One distinct string of the request's metadata (a family name, a help, a unit) */
typedef struct {
    Str s;
    uint64_t hash;
} Interned;

typedef struct {
    const uint8_t *raw;
    size_t n;
    Vec syms;  /* Str */
    Vec refs;  /* uint64_t: the series' label refs */
    Vec xrefs; /* uint64_t: an exemplar's label refs */
    Vec metas; /* Meta, first-seen order */
    size_t *index; /* open addressing: 1 + the Meta's position, 0 empty */
    size_t icap;
    /* Every series' metadata names strings by ref, and any number of series may name one
     * long help symbol: hashing and comparing the strings per series cost N x L (N series
     * of one 16 KiB help: ~250 ms per decoded MB, twice, for the size and the bytes). So a
     * string is interned once per ref (its content hashed and compared once: an id shared
     * by every ref of equal content, which duplicate symbols and the family names of
     * m_bucket / m_count are), and the set of metadata is keyed on (type, ids): O(1) a
     * series. Per symbol, 1 + the id of its string (sid) and of its family name with the
     * suffix stripped (fid, types 3-5); 0 not yet. Made at the first metadata. */
    uint32_t *sid, *fid;
    Vec strs;        /* Interned, by id */
    size_t *sindex;  /* open addressing over strs: 1 + id, 0 empty */
    size_t scap;
    uint64_t meta_bytes; /* bytes of metadata strings hashed and compared (tests) */
    int nomem;
    /* custom-bucket histograms (classic series): the current series' (Classic: its
     * custom-bucket histograms in field order, the first nloop; then, MARK_CLASSIC, an
     * entry per marker of c->marks), the scratch of one's bucket counts (double), of the
     * bounds a marker borrows (uint64_t: their bits) and of the series' labels sorted
     * (Sorted), the formatted bounds (LeCache, made at the first), and how the request's
     * counts change */
    Vec nhcb;
    size_t nloop;
    Vec bucket;
    Vec bounds;
    Vec sorted;
    struct LeEntry *le_cache;
    ConvertInfo info;
    /* the current series' staleness markers of a schema but -53 (Span, field order) and
     * what they become (MARK_*) */
    Vec marks;
    int mark_mode;
} Ctx;

static inline uint64_t
mix(uint64_t h, uint64_t w)
{
    h = (h ^ w) * 0x9E3779B97F4A7C15ULL;
    return h ^ (h >> 29);
}

/* the metadata set's hash seed (convert_seed): a sender cannot aim at collisions */
static uint64_t meta_seed = 0x5EED;

void
convert_seed(uint64_t seed)
{
    meta_seed = seed;
}

static uint64_t
hash_str(uint64_t h, Str s)
{
    h = mix(h, s.n);
    size_t i = 0;
    for (; i + 8 <= s.n; i += 8) {
        uint64_t w;
        memcpy(&w, s.s + i, 8);
        h = mix(h, w);
    }
    uint64_t w = 0;
    for (size_t k = 0; i + k < s.n; k++)
        w |= (uint64_t)s.s[i + k] << (8 * k);
    return mix(h, w);
}

static inline int
str_eq(Str a, Str b)
{
    return a.n == b.n && (a.n == 0 || memcmp(a.s, b.s, a.n) == 0);
}

/* the bytes the last conversion in this thread hashed and compared in metadata strings */
static _Thread_local uint64_t last_meta_bytes;

uint64_t
convert_last_meta_bytes(void)
{
    return last_meta_bytes;
}

/* A new open-addressing index of `cap` slots (a power of two) over `n` items of `stride`
 * bytes, each with its uint64_t hash at `hash_off`: a slot holds an item's position + 1,
 * 0 when empty; NULL when out of memory. Both of the conversion's tables grow by it. */
static size_t *
index_over(const void *items, size_t n, size_t stride, size_t hash_off, size_t cap)
{
    if (cap > SIZE_MAX / sizeof(size_t))
        return NULL;
    size_t *idx = calloc(cap, sizeof(size_t));
    if (idx == NULL)
        return NULL;
    const char *p = items;
    for (size_t k = 0; k < n; k++) {
        uint64_t h;
        memcpy(&h, p + k * stride + hash_off, sizeof h);
        size_t j = (size_t)h & (cap - 1);
        while (idx[j])
            j = (j + 1) & (cap - 1);
        idx[j] = k + 1;
    }
    return idx;
}

/* The id of string s (first seen: a new one), by its content; UINT32_MAX when out of
 * memory. Called once per (symbol, stripped or not): the only place metadata strings are
 * hashed or compared. */
static uint32_t
intern(Ctx *c, Str s)
{
    if ((c->strs.len + 1) * 2 > c->scap) {
        size_t cap = c->scap ? c->scap * 2 : 64;
        size_t *idx = index_over(c->strs.data, c->strs.len, sizeof(Interned),
                                 offsetof(Interned, hash), cap);
        if (idx == NULL)
            return UINT32_MAX;
        free(c->sindex);
        c->sindex = idx;
        c->scap = cap;
    }
    uint64_t h = hash_str(meta_seed, s);
    c->meta_bytes += s.n;
    const Interned *xs = c->strs.data;
    size_t j = (size_t)h & (c->scap - 1);
    while (c->sindex[j]) {
        const Interned *x = &xs[c->sindex[j] - 1];
        if (x->hash == h && x->s.n == s.n) {
            c->meta_bytes += s.n;
            if (str_eq(x->s, s))
                return (uint32_t)(c->sindex[j] - 1);
        }
        j = (j + 1) & (c->scap - 1);
    }
    if (c->strs.len >= UINT32_MAX)
        return UINT32_MAX;
    Interned *x = vec_push(&c->strs);
    if (x == NULL)
        return UINT32_MAX;
    x->s = s;
    x->hash = h;
    c->sindex[j] = c->strs.len;
    return (uint32_t)(c->strs.len - 1);
}

/* The id of symbol ref's string, or (stripped) of the family name family_name made of
 * it (`s`, a prefix of the symbol), memoized per symbol; UINT32_MAX: out of memory. */
static uint32_t
sym_id(Ctx *c, uint64_t ref, int stripped, Str s)
{
    uint32_t *memo = stripped ? c->fid : c->sid;
    if (memo[ref] == 0) {
        uint32_t id = intern(c, s);
        if (id == UINT32_MAX)
            return id;
        memo[ref] = id + 1;
    }
    return memo[ref] - 1;
}

static int
meta_grow(Ctx *c)
{
    size_t cap = c->icap ? c->icap * 2 : 64;
    size_t *idx = index_over(c->metas.data, c->metas.len, sizeof(Meta), offsetof(Meta, hash),
                             cap);
    if (idx == NULL)
        return 0;
    free(c->index);
    c->index = idx;
    c->icap = cap;
    return 1;
}

/* Add (name, type, help, unit) unless it is there already (the strings' ids: equal ids,
 * equal contents); 0 when out of memory. */
static int
meta_add(Ctx *c, Str name, uint32_t name_id, uint64_t type, Str help, uint32_t help_id,
         Str unit, uint32_t unit_id)
{
    if ((c->metas.len + 1) * 2 > c->icap && !meta_grow(c))
        return 0;
    uint64_t h = mix(mix(mix(mix(meta_seed, type), name_id), help_id), unit_id);
    Meta *ms = c->metas.data;
    size_t j = (size_t)h & (c->icap - 1);
    while (c->index[j]) {
        const Meta *m = &ms[c->index[j] - 1];
        if (m->hash == h && m->type == type && m->name_id == name_id &&
            m->help_id == help_id && m->unit_id == unit_id)
            return 1;
        j = (j + 1) & (c->icap - 1);
    }
    Meta *m = vec_push(&c->metas);
    if (m == NULL)
        return 0;
    m->name = name;
    m->help = help;
    m->unit = unit;
    m->type = type;
    m->name_id = name_id;
    m->help_id = help_id;
    m->unit_id = unit_id;
    m->hash = h;
    c->index[j] = c->metas.len;
    return 1;
}

/* convert.family_name: the family a series' name belongs to (the suffix of a histogram,
 * gaugehistogram or summary series stripped, the first that matches in this order). */
static Str
family_name(Str name, uint64_t type)
{
    static const char *const SUFFIXES[] = {"_bucket", "_count", "_sum", "_gcount", "_gsum",
                                           "_created"};
    if (type == 3 || type == 4 || type == 5) {
        for (size_t i = 0; i < sizeof SUFFIXES / sizeof SUFFIXES[0]; i++) {
            size_t k = strlen(SUFFIXES[i]);
            if (name.n >= k && memcmp(name.s + name.n - k, SUFFIXES[i], k) == 0) {
                name.n -= k;
                break;
            }
        }
    }
    return name;
}

/* An RW 1.0 MetricMetadata's payload (convert._metadata_v1): type when set, the family
 * name, help and unit when not empty. */
static void
meta_payload(Writer *w, const Meta *m)
{
    if (m->type) {
        w_byte(w, 0x08);
        w_varint(w, m->type);
    }
    w_head(w, 2, m->name.n);
    w_put(w, m->name.s, m->name.n);
    if (m->help.n) {
        w_head(w, 4, m->help.n);
        w_put(w, m->help.s, m->help.n);
    }
    if (m->unit.n) {
        w_head(w, 5, m->unit.n);
        w_put(w, m->unit.s, m->unit.n);
    }
}

static void
emit_meta(Writer *w, const Meta *m)
{
    Writer cw = {0};
    meta_payload(&cw, m); /* three symbols and a varint: no overflow */
    w_head(w, 3, cw.len);
    meta_payload(w, m);
}

/* ------------------------------------------------------------------------------------ */
/* a series                                                                              */

/* Label fields of refs (pairs of name, value; checked inside the table), as
 * primitives.encode_label_v1 writes them: an empty value left out. */
static void
emit_labels(Writer *w, const Str *syms, const uint64_t *refs, size_t nrefs)
{
    for (size_t i = 0; i + 1 < nrefs; i += 2) {
        Str a = syms[refs[i]], b = syms[refs[i + 1]];
        /* two symbols of the request: no overflow (each is at most PY_SSIZE_T_MAX) */
        size_t inner = 1 + varint_len(a.n) + a.n + (b.n ? 1 + varint_len(b.n) + b.n : 0);
        w_head(w, 1, inner);
        w_head(w, 1, a.n);
        w_put(w, a.s, a.n);
        if (b.n) {
            w_head(w, 2, b.n);
            w_put(w, b.s, b.n);
        }
    }
}

/* A message's fields minus those numbered `skip`, bytes as they were, as field `number`
 * (convert._copy_fields in a len_field). Framing checked before. */
static void
emit_copy(Writer *w, const uint8_t *raw, size_t p, size_t end, unsigned number,
          uint64_t skip)
{
    size_t size = end - p;
    for (size_t q = p; q < end;) {
        Field f;
        size_t at = q;
        rd_field(raw, q, end, &f);
        if (f.number == skip)
            size -= f.end - at;
        q = f.end;
    }
    w_head(w, number, size);
    if (size == end - p) {
        w_put(w, raw + p, size);
        return;
    }
    for (size_t q = p; q < end;) {
        Field f;
        size_t at = q;
        rd_field(raw, q, end, &f);
        if (f.number != skip)
            w_put(w, raw + at, f.end - at);
        q = f.end;
    }
}

/* Refs of every field 1 of a message (packed or not), appended to v; 0: out of memory. */
static int
read_refs(Vec *v, const uint8_t *raw, size_t p, size_t end)
{
    while (p < end) {
        Field f;
        rd_field(raw, p, end, &f);
        if (f.number == 1)
            for (size_t pp = f.ps; pp < f.end;) {
                uint64_t x = 0;
                rd_varint(raw, f.end, &pp, &x);
                uint64_t *slot = vec_push(v);
                if (slot == NULL)
                    return 0;
                *slot = x;
            }
        p = f.end;
    }
    return 1;
}

/* An exemplar as an RW 1.0 one (field 3): labels resolved, the other fields as they were.
 * Its refs are in c->xrefs. */
static void
emit_exemplar(Ctx *c, Writer *w, size_t p, size_t end)
{
    const uint8_t *raw = c->raw;
    Writer cw = {0};
    emit_labels(&cw, c->syms.data, c->xrefs.data, c->xrefs.len);
    size_t rest = end - p;
    for (size_t q = p; q < end;) {
        Field f;
        size_t at = q;
        rd_field(raw, q, end, &f);
        if (f.number == 1)
            rest -= f.end - at;
        q = f.end;
    }
    if (cw.over || cw.len > SIZE_MAX - rest) {
        w->over = 1; /* past a size_t */
        return;
    }
    w_head(w, 3, cw.len + rest);
    emit_labels(w, c->syms.data, c->xrefs.data, c->xrefs.len);
    for (size_t q = p; q < end;) {
        Field f;
        size_t at = q;
        rd_field(raw, q, end, &f);
        if (f.number != 1)
            w_put(w, raw + at, f.end - at);
        q = f.end;
    }
}

/* A histogram's timestamp as custom_buckets and stale_marker read it (the last field
 * 15 of wire type 0; framing checked), as its uvarint: the reference writes it & 2^64-1. */
static uint64_t
hist_ts(const uint8_t *raw, size_t p, size_t end)
{
    uint64_t ts = 0;
    while (p < end) {
        Field f;
        rd_field(raw, p, end, &f);
        if (f.number == 15 && f.wt == 0) {
            size_t vp = f.ps;
            rd_varint(raw, f.end, &vp, &ts);
        }
        p = f.end;
    }
    return ts;
}

/* Whether a custom-bucket histogram has bounds (custom_values, field 16) of its own. */
static int
has_bounds(const uint8_t *raw, size_t p, size_t end)
{
    while (p < end) {
        Field f;
        rd_field(raw, p, end, &f);
        if (f.number == 16 && f.end > f.ps) /* a double, or a packed run of them */
            return 1;
        p = f.end;
    }
    return 0;
}

/* The stale NaN at ts as an RW 1.0 Sample field (convert._sample_v1 in a len_field). */
/* One RW 1.0 Sample (field 2 of a TimeSeries): the value's bits (double, field 1) and its
 * timestamp (field 2); the classic series and the staleness markers both write theirs so. */
static void
emit_sample(Writer *w, uint64_t value_bits, uint64_t ts)
{
    w_head(w, 2, 10 + varint_len(ts));
    uint8_t b[9];
    b[0] = 0x09;
    for (int k = 0; k < 8; k++)
        b[1 + k] = (uint8_t)(value_bits >> (8 * k));
    w_put(w, b, 9);
    w_byte(w, 0x10);
    w_varint(w, ts);
}

/* The current series' markers (c->marks) as its TimeSeries carries them: float stale
 * markers (MARK_FLOAT, after its samples) or histograms (MARK_HISTOGRAM, after its
 * others, start_timestamp dropped). */
__attribute__((noinline)) static void
emit_marks(Ctx *c, Writer *w)
{
    const Span *mk = c->marks.data;
    for (size_t i = 0; i < c->marks.len; i++) {
        if (c->mark_mode == MARK_FLOAT)
            emit_sample(w, STALE_NAN_BITS, hist_ts(c->raw, mk[i].ps, mk[i].end));
        else
            emit_copy(w, c->raw, mk[i].ps, mk[i].end, 4, 17);
    }
}

/* A series' TimeSeries payload: labels, samples (then its markers as float stale markers,
 * MARK_FLOAT), exemplars, histograms (but those of custom buckets, c->nhcb: they become
 * classic series; and its markers, c->marks: MARK_HISTOGRAM, after the others, as the
 * reference appends them). */
static int
emit_body(Ctx *c, Writer *w, size_t s, size_t q)
{
    const uint8_t *raw = c->raw;
    emit_labels(w, c->syms.data, c->refs.data, c->refs.len);
    static const uint64_t ORDER[] = {2, 4, 3};
    const Classic *nh = c->nhcb.data;
    const size_t nnh = c->nloop;
    const Span *mk = c->marks.data;
    const size_t nmk = c->marks.len;
    size_t next_nh = 0, next_mk = 0;
    for (int k = 0; k < 3; k++) {
        for (size_t p = s; p < q;) {
            Field f;
            rd_field(raw, p, q, &f);
            if (f.number == 3 && ORDER[k] == 3 &&
                ((next_nh < nnh && nh[next_nh].ps == f.ps) ||
                 (next_mk < nmk && mk[next_mk].ps == f.ps))) {
                if (next_nh < nnh && nh[next_nh].ps == f.ps)
                    next_nh++;
                else
                    next_mk++;
                p = f.end;
                continue;
            }
            if (f.number == ORDER[k]) {
                if (f.number == 2)
                    emit_copy(w, raw, f.ps, f.end, 2, 3);
                else if (f.number == 3)
                    emit_copy(w, raw, f.ps, f.end, 4, 17);
                else {
                    c->xrefs.len = 0;
                    if (!read_refs(&c->xrefs, raw, f.ps, f.end))
                        return 0;
                    emit_exemplar(c, w, f.ps, f.end);
                }
            }
            p = f.end;
        }
        if (nmk && ((k == 0 && c->mark_mode == MARK_FLOAT) ||
                    (k == 2 && c->mark_mode == MARK_HISTOGRAM)))
            emit_marks(c, w);
    }
    return 1;
}

/* the classic series of the current series' custom-bucket histograms (below: the code
 * of those histograms is kept after the conversion's common path) */
static ConvertStatus emit_classic(Ctx *c, Writer *w);

/* What the current series' markers of a schema but -53 (c->marks) become, as _series_v1
 * places them once the series is read (c->mark_mode); 0 when out of memory. */
__attribute__((noinline)) static int
place_marks(Ctx *c, int exponential)
{
    if (exponential) {
        c->mark_mode = MARK_HISTOGRAM;
        return 1;
    }
    if (c->nloop == 0) { /* a histogram fewer, a sample more, each */
        c->mark_mode = MARK_FLOAT;
        c->info.histograms += c->marks.len;
        c->info.samples += c->marks.len;
        return 1;
    }
    c->mark_mode = MARK_CLASSIC; /* each with the bounds of the last entry */
    const Span *mk = c->marks.data;
    for (size_t i = 0; i < c->marks.len; i++) {
        Classic *cl = vec_push(&c->nhcb);
        if (cl == NULL)
            return 0;
        cl->ps = mk[i].ps;
        cl->end = mk[i].end;
        cl->flags = CL_STALE | CL_BORROW;
    }
    return 1;
}

/* The checks of split_series_v2 (and what custom_buckets / stale_marker look for), the
 * series' refs in c->refs, its metadata added; then the TimeSeries. */
static ConvertStatus
series(Ctx *c, Writer *w, size_t s, size_t q)
{
    const uint8_t *raw = c->raw;
    size_t nsym = c->syms.len;
    int has_meta = 0;
    int carried = 0; /* a sample, an exemplar or a histogram that goes as one */
    int exponential = 0; /* a histogram that goes as one (not a marker) */
    c->refs.len = 0;
    c->nhcb.len = 0;
    c->marks.len = 0;
    for (size_t p = s; p < q;) {
        Field f;
        if (!rd_field(raw, p, q, &f))
            return CONVERT_FALLBACK;
        if (f.number == 1) {
            if (f.wt != 0 && f.wt != 2)
                return CONVERT_FALLBACK;
            for (size_t pp = f.ps; pp < f.end;) {
                uint64_t x;
                if (!rd_varint(raw, f.end, &pp, &x))
                    return CONVERT_FALLBACK;
                uint64_t *slot = vec_push(&c->refs);
                if (slot == NULL)
                    return CONVERT_NOMEM;
                *slot = x;
            }
        }
        else if (f.number >= 2 && f.number <= 5) {
            int ok, kind = 0;
            if (f.wt != 2)
                return CONVERT_FALLBACK;
            if (f.number == 2)
                ok = check_fields(raw, f.ps, f.end, SAMPLE_WT, 3);
            else if (f.number == 3)
                ok = check_histogram(raw, f.ps, f.end, &kind);
            else if (f.number == 4)
                ok = check_exemplar(raw, f.ps, f.end, nsym);
            else {
                ok = check_metadata(raw, f.ps, f.end, nsym);
                has_meta = 1;
            }
            if (!ok)
                return CONVERT_FALLBACK;
            if (kind & HIST_CUSTOM) {
                /* a custom-bucket marker with no bounds of its own takes those of the
                 * entry before it (the bounds it ends), if any */
                unsigned flags = !(kind & HIST_STALE) ? 0u
                                 : c->nhcb.len && !has_bounds(raw, f.ps, f.end)
                                     ? CL_STALE | CL_BORROW
                                     : CL_STALE;
                Classic *cl = vec_push(&c->nhcb);
                if (cl == NULL)
                    return CONVERT_NOMEM;
                cl->ps = f.ps;
                cl->end = f.end;
                cl->flags = flags;
            }
            else if (kind & HIST_STALE) { /* its fate is the series' (below) */
                Span *sp = vec_push(&c->marks);
                if (sp == NULL)
                    return CONVERT_NOMEM;
                sp->ps = f.ps;
                sp->end = f.end;
            }
            else if (f.number != 5) {
                carried = 1;
                exponential |= f.number == 3;
            }
        }
        p = f.end;
    }
    c->nloop = c->nhcb.len;
    c->mark_mode = MARK_NONE;
    if (c->marks.len && !place_marks(c, exponential))
        return CONVERT_NOMEM;
    const uint64_t *refs = c->refs.data;
    if (c->refs.len & 1)
        return CONVERT_FALLBACK;
    for (size_t i = 0; i < c->refs.len; i++)
        if (refs[i] >= nsym)
            return CONVERT_FALLBACK;
    if (has_meta) {
        /* help_ref and unit_ref default to 0: the reference refuses any metadata when
         * the table is empty */
        if (nsym == 0)
            return CONVERT_FALLBACK;
        const Str *syms = c->syms.data;
        Str metric = {(const uint8_t *)"", 0};
        uint64_t metric_ref = 0;
        for (size_t i = 0; i < c->refs.len; i += 2) {
            Str n = syms[refs[i]];
            if (n.n == 8 && memcmp(n.s, "__name__", 8) == 0) {
                metric = syms[refs[i + 1]];
                metric_ref = refs[i + 1];
                break;
            }
        }
        if (c->sid == NULL) {
            c->sid = calloc(nsym, sizeof(uint32_t));
            c->fid = calloc(nsym, sizeof(uint32_t));
            if (c->sid == NULL || c->fid == NULL)
                return CONVERT_NOMEM;
        }
        for (size_t p = s; p < q;) {
            Field f;
            rd_field(raw, p, q, &f);
            if (f.number == 5) {
                uint64_t type = 0, help = 0, unit = 0;
                for (size_t pp = f.ps; pp < f.end;) {
                    Field g;
                    rd_field(raw, pp, f.end, &g);
                    if (g.wt == 0) {
                        uint64_t v = 0;
                        size_t vp = g.ps;
                        rd_varint(raw, g.end, &vp, &v);
                        if (g.number == 1)
                            type = v;
                        else if (g.number == 3)
                            help = v;
                        else if (g.number == 4)
                            unit = v;
                    }
                    pp = g.end;
                }
                Str name = family_name(metric, type);
                /* a ref to another "" than symbol 0 says nothing either */
                if (name.n && (type || syms[help].n || syms[unit].n)) {
                    uint32_t ni = sym_id(c, metric_ref, name.n != metric.n, name);
                    uint32_t hi = sym_id(c, help, 0, syms[help]);
                    uint32_t ui = sym_id(c, unit, 0, syms[unit]);
                    if (ni == UINT32_MAX || hi == UINT32_MAX || ui == UINT32_MAX ||
                        !meta_add(c, name, ni, type, syms[help], hi, syms[unit], ui))
                        return CONVERT_NOMEM;
                }
            }
            p = f.end;
        }
    }
    /* _SeriesV1.sent: a series left with nothing but custom-bucket histograms (and the
     * markers that end their classic series) is not sent itself */
    if (carried || c->nloop == 0) {
        Writer cw = {0};
        if (!emit_body(c, &cw, s, q))
            return CONVERT_NOMEM;
        if (cw.over)
            return CONVERT_FALLBACK;
        w_head(w, 1, cw.len);
        if (w->buf != NULL) {
            if (!emit_body(c, w, s, q))
                return CONVERT_NOMEM;
        }
        else if (cw.len > SIZE_MAX - w->len)
            w->over = 1;
        else
            w->len += cw.len; /* counting: the body's size, known */
    }
    return c->nhcb.len ? emit_classic(c, w) : CONVERT_OK;
}

/* ------------------------------------------------------------------------------------ */
/* the request                                                                           */

static ConvertStatus
walk(Ctx *c, Writer *w)
{
    const uint8_t *raw = c->raw;
    size_t n = c->n;
    /* splice_v2.scan_v2: framing, no RW 1.0 fields, symbols UTF-8 and first empty */
    for (size_t pos = 0; pos < n;) {
        Field f;
        if (!rd_field(raw, pos, n, &f))
            return CONVERT_FALLBACK;
        if ((f.number == 1 || f.number == 3) && f.wt == 2)
            return CONVERT_FALLBACK;
        if (f.number == 4) {
            if (f.wt != 2 || !utf8_ok(raw + f.ps, f.end - f.ps))
                return CONVERT_FALLBACK;
            Str *sym = vec_push(&c->syms);
            if (sym == NULL)
                return CONVERT_NOMEM;
            sym->s = raw + f.ps;
            sym->n = f.end - f.ps;
        }
        else if (f.number == 5 && f.wt != 2)
            return CONVERT_FALLBACK;
        pos = f.end;
    }
    if (c->syms.len && ((Str *)c->syms.data)[0].n != 0)
        return CONVERT_FALLBACK;
    for (size_t pos = 0; pos < n;) {
        Field f;
        rd_field(raw, pos, n, &f);
        if (f.number == 5) {
            ConvertStatus st = series(c, w, f.ps, f.end);
            if (st != CONVERT_OK)
                return st;
        }
        pos = f.end;
    }
    const Meta *ms = c->metas.data;
    for (size_t k = 0; k < c->metas.len; k++)
        emit_meta(w, &ms[k]);
    return CONVERT_OK;
}

ConvertStatus
convert_v2_to_v1(const uint8_t *raw, size_t n, uint8_t *out, size_t out_cap, size_t *size,
                 ConvertInfo *info)
{
    Ctx c;
    memset(&c, 0, sizeof c);
    c.raw = raw;
    c.n = n;
    c.syms.item = sizeof(Str);
    c.refs.item = sizeof(uint64_t);
    c.xrefs.item = sizeof(uint64_t);
    c.metas.item = sizeof(Meta);
    c.strs.item = sizeof(Interned);
    c.nhcb.item = sizeof(Classic);
    c.bucket.item = sizeof(double);
    c.bounds.item = sizeof(uint64_t);
    c.sorted.item = sizeof(Sorted);
    c.marks.item = sizeof(Span);
    Writer w = {out, out == NULL ? 0 : out_cap, 0, 0};
    ConvertStatus st = walk(&c, &w);
    last_meta_bytes = c.meta_bytes;
    free(c.sid);
    free(c.fid);
    free(c.strs.data);
    free(c.sindex);
    free(c.syms.data);
    free(c.refs.data);
    free(c.xrefs.data);
    free(c.metas.data);
    free(c.index);
    free(c.nhcb.data);
    free(c.bucket.data);
    free(c.bounds.data);
    free(c.sorted.data);
    free(c.marks.data);
    free(c.le_cache);
    if (st == CONVERT_OK) {
        *size = w.len;
        if (out == NULL)
            st = w.over ? CONVERT_FALLBACK /* past a size_t: the reference's Python ints */
                        : CONVERT_OK;
        else
            st = w.over || w.len != out_cap ? CONVERT_MISMATCH : CONVERT_OK;
    }
    if (st == CONVERT_OK && info != NULL) {
        info->histograms = c.info.histograms;
        info->samples = c.info.samples;
    }
    return st;
}

/* ------------------------------------------------------------------------------------ */
/* custom-bucket histograms: classic series (convert.custom_buckets, classic_series)      */

/* format_le: a bound as Go's strconv.FormatFloat(b, 'g', -1, 64) writes it (convert.py's
 * format_le, from Python's repr: the shortest digits that read back as the double, the
 * nearest such), without the GIL: glibc's printf rounds exactly, strtod reads exactly.
 *
 * Which digits: for a normal double, any decimal of at most 15 significant digits that
 * reads back as it lies within half a unit of the 15th digit (a double's half ulp is
 * under 1.2e-16 of it), so the nearest 15-digit decimal is that decimal padded with
 * zeros: when it reads back, its digits without the trailing zeros are the shortest, and
 * the only one that short. Else 16 digits, else 17 (always enough). A double whose
 * interval is not symmetric (a power of two: the ulp below it is half the one above)
 * may read back from a decimal one unit of the last digit above the nearest, not from
 * the nearest: that one is tried too. A subnormal (fewer bits: many short decimals read
 * back) takes the fewest digits whose nearest decimal reads back, by bisection (the
 * nearest p+1-digit decimal is never farther than the nearest p-digit one, and its
 * interval is symmetric, so reading back is monotone in p). */

/* The nearest decimal of p significant digits to x (> 0, finite): its digits (p of them,
 * out) and the decimal exponent of the first. */
static int
nearest_digits(double x, int p, char *out, int *exp10)
{
    char buf[64];
    int k = snprintf(buf, sizeof buf, "%.*e", p - 1, x);
    if (k <= 0 || k >= (int)sizeof buf)
        return 0;
    int nd = 0, i = 0;
    for (; i < k && buf[i] != 'e'; i++)
        if (buf[i] >= '0' && buf[i] <= '9')
            out[nd++] = buf[i]; /* the decimal point, whatever the locale's, skipped */
    if (i >= k || nd != p)
        return 0;
    *exp10 = atoi(buf + i + 1);
    return 1;
}

/* Whether the decimal digits d[0..nd) x 10^(exp10 - nd + 1) reads back as x: written
 * without a decimal point, so no locale's point matters. */
static int
reads_back(double x, const char *d, int nd, int exp10)
{
    char buf[64];
    memcpy(buf, d, (size_t)nd);
    snprintf(buf + nd, sizeof buf - (size_t)nd, "e%d", exp10 - nd + 1);
    return strtod(buf, NULL) == x;
}

/* d (nd digits, exponent *exp10) one unit of its last digit up (a carry out of the first
 * digit: 10...0, the exponent one more). */
static void
digits_up(char *d, int nd, int *exp10)
{
    int i = nd - 1;
    while (i >= 0 && d[i] == '9')
        d[i--] = '0';
    if (i >= 0)
        d[i]++;
    else {
        d[0] = '1';
        (*exp10)++;
    }
}

/* The shortest digits of x (> 0, finite) that read back, nearest first; their count. */
static int
shortest_digits(double x, char *d, int *exp10)
{
    int normal = x >= 2.2250738585072014e-308;
    if (nearest_digits(x, 15, d, exp10) && reads_back(x, d, 15, *exp10)) {
        if (normal) {
            int nd = 15;
            while (nd > 1 && d[nd - 1] == '0')
                nd--;
            return nd;
        }
        int lo = 1, hi = 15; /* hi reads back */
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            char t[20];
            int e;
            if (nearest_digits(x, mid, t, &e) && reads_back(x, t, mid, e))
                hi = mid;
            else
                lo = mid + 1;
        }
        nearest_digits(x, hi, d, exp10);
        int nd = hi;
        while (nd > 1 && d[nd - 1] == '0')
            nd--;
        return nd;
    }
    for (int p = 16; p <= 17; p++) {
        if (!nearest_digits(x, p, d, exp10))
            break;
        if (reads_back(x, d, p, *exp10))
            return p;
        char up[20];
        int e = *exp10;
        memcpy(up, d, (size_t)p);
        digits_up(up, p, &e);
        if (reads_back(x, up, p, e)) {
            memcpy(d, up, (size_t)p);
            *exp10 = e;
            return p;
        }
    }
    /* not reached: 17 digits read back (snprintf itself failing: the 17 of %.16e) */
    return nearest_digits(x, 17, d, exp10) ? 17 : 0;
}

/* format_le(b) into out (at least LE_MAX bytes); its length. */
#define LE_MAX 32
static size_t
format_le(double b, char *out)
{
    if (isinf(b)) {
        memcpy(out, b > 0 ? "+Inf" : "-Inf", 4);
        return 4;
    }
    if (isnan(b)) {
        memcpy(out, "NaN", 3);
        return 3;
    }
    size_t n = 0;
    if (signbit(b)) {
        out[n++] = '-';
        b = -b;
    }
    if (b == 0) {
        out[n++] = '0';
        return n;
    }
    char d[20];
    int e10 = 0;
    int nd = shortest_digits(b, d, &e10);
    if (nd <= 0) { /* snprintf failed: not seen; "0" keeps the bytes bounded */
        out[n++] = '0';
        return n;
    }
    int point = e10 + 1;
    if (e10 < -4 || e10 >= 6) {
        out[n++] = d[0];
        if (nd > 1) {
            out[n++] = '.';
            memcpy(out + n, d + 1, (size_t)nd - 1);
            n += (size_t)nd - 1;
        }
        out[n++] = 'e';
        out[n++] = e10 < 0 ? '-' : '+';
        int a = e10 < 0 ? -e10 : e10;
        if (a >= 100)
            out[n++] = (char)('0' + a / 100);
        out[n++] = (char)('0' + a / 10 % 10);
        out[n++] = (char)('0' + a % 10);
    }
    else if (point <= 0) {
        out[n++] = '0';
        out[n++] = '.';
        for (int i = 0; i < -point; i++)
            out[n++] = '0';
        memcpy(out + n, d, (size_t)nd);
        n += (size_t)nd;
    }
    else if (point >= nd) {
        memcpy(out + n, d, (size_t)nd);
        n += (size_t)nd;
        for (int i = nd; i < point; i++)
            out[n++] = '0';
    }
    else {
        memcpy(out + n, d, (size_t)point);
        n += (size_t)point;
        out[n++] = '.';
        memcpy(out + n, d + point, (size_t)(nd - point));
        n += (size_t)(nd - point);
    }
    return n;
}

size_t
convert_format_le(double b, char *out)
{
    return format_le(b, out);
}

/* Formatted bounds by their bits, direct-mapped: the histograms of a family share their
 * bounds, so each is formatted about once a request (and a request of distinct ones costs
 * a formatting each, a bounded constant). */
#define LE_CACHE 1024
struct LeEntry {
    uint64_t bits;
    uint8_t len; /* 0: empty */
    char s[LE_MAX - 1];
};

/* The bound of these bits formatted (its bytes at *s, its length); 0 when out of memory. */
static size_t
le_of(Ctx *c, uint64_t bits, const char **s)
{
    if (c->le_cache == NULL) {
        c->le_cache = calloc(LE_CACHE, sizeof(struct LeEntry));
        if (c->le_cache == NULL)
            return 0;
    }
    struct LeEntry *e = &c->le_cache[(bits * 0x9E3779B97F4A7C15ULL) >> 54];
    if (e->len == 0 || e->bits != bits) {
        double b;
        char tmp[LE_MAX];
        memcpy(&b, &bits, 8);
        size_t n = format_le(b, tmp);
        memcpy(e->s, tmp, n); /* at most 24 */
        e->len = (uint8_t)n;
        e->bits = bits;
    }
    *s = e->s;
    return e->len;
}

/* The values of one repeated field of a histogram (number: 12, varints; 13 or 16,
 * doubles), each field packed or not, in order: read one by one, nothing allocated. */
typedef struct {
    const uint8_t *raw;
    size_t p, end; /* the histogram's fields still to look at */
    size_t vp, vend; /* the values left of the current field */
    uint64_t number;
} Values;

static void
values_start(Values *v, const uint8_t *raw, size_t p, size_t end, uint64_t number)
{
    v->raw = raw;
    v->p = p;
    v->end = end;
    v->vp = v->vend = 0;
    v->number = number;
}

/* The next value (its bits: a double's, or a varint); 0 when there is none. Framing and
 * packed lengths were checked (check_histogram). */
static int
values_next(Values *v, uint64_t *x)
{
    while (v->vp >= v->vend) {
        if (v->p >= v->end)
            return 0;
        Field f;
        rd_field(v->raw, v->p, v->end, &f);
        v->p = f.end;
        if (f.number == v->number) {
            v->vp = f.ps; /* packed or one value: the payload holds the values */
            v->vend = f.end;
        }
    }
    if (v->number == 12) {
        rd_varint(v->raw, v->vend, &v->vp, x);
        return 1;
    }
    *x = le64(v->raw + v->vp);
    v->vp += 8;
    return 1;
}

/* A custom-bucket histogram as custom_buckets reads it: its count, sum (the bits of the
 * doubles), timestamp, and how many bounds, deltas and float counts it has. */
typedef struct {
    uint64_t count_bits, sum_bits, ts;
    size_t nbounds, ndeltas, nfloats;
} Nhcb;

/* How many values field f (of number 12, 13 or 16) holds: packed doubles 8 bytes each,
 * packed varints one per byte below 0x80 (checked whole), else one. */
static size_t
values_in(const uint8_t *raw, const Field *f)
{
    if (f->wt != 2)
        return 1;
    if (f->number != 12)
        return (f->end - f->ps) / 8;
    size_t n = 0;
    for (size_t i = f->ps; i < f->end; i++)
        n += raw[i] < 0x80;
    return n;
}

static void
nhcb_read(const uint8_t *raw, size_t p, size_t end, Nhcb *h)
{
    memset(h, 0, sizeof *h);
    while (p < end) {
        Field f;
        rd_field(raw, p, end, &f);
        uint64_t v = 0;
        size_t vp = f.ps;
        if (f.number == 1 && f.wt == 0) { /* count_int: float(uvarint) */
            rd_varint(raw, f.end, &vp, &v);
            double d = (double)v;
            memcpy(&h->count_bits, &d, 8);
        }
        else if (f.number == 2 && f.wt == 1)
            h->count_bits = le64(raw + f.ps);
        else if (f.number == 3 && f.wt == 1)
            h->sum_bits = le64(raw + f.ps);
        else if (f.number == 15 && f.wt == 0) {
            rd_varint(raw, f.end, &vp, &v);
            h->ts = v;
        }
        else if (f.number == 12)
            h->ndeltas += values_in(raw, &f);
        else if (f.number == 13)
            h->nfloats += values_in(raw, &f);
        else if (f.number == 16)
            h->nbounds += values_in(raw, &f);
        p = f.end;
    }
}

static inline int64_t
unzigzag(uint64_t v)
{
    return (int64_t)(v >> 1) ^ -(int64_t)(v & 1);
}

/* custom_buckets' counts by bucket (nbounds + 1 of them, in c->bucket): the deltas'
 * running sums (when it has any) or the float counts, placed by the positive spans (the
 * first offset absolute, the others gaps; a span's buckets stop when the values do).
 * CONVERT_FALLBACK for a bucket past the bounds (the reference raises protobuf_invalid)
 * and for a running sum or an index past an int64 (the reference's ints are unbounded).
 * O(spans + values + bounds). */
static ConvertStatus
nhcb_counts(Ctx *c, size_t p, size_t end, const Nhcb *h)
{
    const uint8_t *raw = c->raw;
    size_t nb = h->nbounds + 1; /* nbounds < the request's bytes: no overflow */
    if (nb > c->bucket.cap) {
        if (nb > SIZE_MAX / sizeof(double))
            return CONVERT_NOMEM;
        double *d = realloc(c->bucket.data, nb * sizeof(double));
        if (d == NULL)
            return CONVERT_NOMEM;
        c->bucket.data = d;
        c->bucket.cap = nb;
    }
    double *counts = c->bucket.data;
    for (size_t i = 0; i < nb; i++)
        counts[i] = 0.0;
    int deltas = h->ndeltas > 0;
    size_t nvalues = deltas ? h->ndeltas : h->nfloats;
    Values vals;
    values_start(&vals, raw, p, end, deltas ? 12 : 13);
    int64_t running = 0, idx = 0;
    size_t taken = 0;
    int first = 1;
    while (p < end) {
        Field f;
        rd_field(raw, p, end, &f);
        p = f.end;
        if (f.number != 11) /* positive_spans (wire type 2, checked) */
            continue;
        uint64_t offset = 0, length = 0;
        for (size_t a = f.ps; a < f.end;) {
            Field g;
            rd_field(raw, a, f.end, &g);
            if (g.wt == 0 && (g.number == 1 || g.number == 2)) {
                size_t vp = g.ps;
                rd_varint(raw, g.end, &vp, g.number == 1 ? &offset : &length);
            }
            a = g.end;
        }
        int64_t off = unzigzag(offset);
        if (first)
            idx = off;
        else if (__builtin_add_overflow(idx, off, &idx))
            return CONVERT_FALLBACK;
        first = 0;
        for (uint64_t k = 0; k < length && taken < nvalues; k++) {
            if (idx < 0 || (uint64_t)idx >= nb)
                return CONVERT_FALLBACK; /* past the bounds: protobuf_invalid */
            uint64_t x = 0;
            values_next(&vals, &x);
            double v;
            if (deltas) {
                if (__builtin_add_overflow(running, unzigzag(x), &running))
                    return CONVERT_FALLBACK;
                v = (double)running;
            }
            else
                memcpy(&v, &x, 8);
            counts[idx] += v;
            taken++;
            idx++;
        }
    }
    return CONVERT_OK;
}

/* One label, as encode_label_v1 writes it, of a value in two pieces (a name and its
 * suffix; b2 may be empty): an empty value left out. */
static void
emit_label2(Writer *w, Str n, const uint8_t *v1, size_t n1, const uint8_t *v2, size_t n2)
{
    size_t vn = n1 + n2;
    size_t inner = 1 + varint_len(n.n) + n.n + (vn ? 1 + varint_len(vn) + vn : 0);
    w_head(w, 1, inner);
    w_head(w, 1, n.n);
    w_put(w, n.s, n.n);
    if (vn) {
        w_head(w, 2, vn);
        w_put(w, v1, n1);
        w_put(w, v2, n2);
    }
}

/* Bytes of a length-delimited field of a number below 16 holding `payload` bytes (small
 * payloads: the callers' sums are checked against overflow first). */
static inline size_t
field_size(size_t payload)
{
    return 1 + varint_len(payload) + payload;
}

static inline size_t
label_size(size_t name, size_t value)
{
    return field_size(field_size(name) + (value ? field_size(value) : 0));
}

static int
sorted_cmp(const void *pa, const void *pb)
{
    const Sorted *a = pa, *b = pb;
    size_t m = a->name.n < b->name.n ? a->name.n : b->name.n;
    int r = m ? memcmp(a->name.s, b->name.s, m) : 0;
    if (r)
        return r;
    if (a->name.n != b->name.n)
        return a->name.n < b->name.n ? -1 : 1;
    return a->at < b->at ? -1 : a->at > b->at;
}

static const uint8_t NAME_LABEL[] = "__name__";
static const uint8_t LE_LABEL[] = "le";

/* A series' labels as its classic series carry them (classic_series): its __name__ (the
 * last), the others but le, their bytes counted, and (writing) sorted by name with the
 * places __name__ and le go in. */
typedef struct {
    Str name;
    size_t rest_size;   /* the other labels' bytes */
    size_t nrest;       /* how many (sorted in c->sorted when writing) */
    size_t name_at, le_at; /* how many of them sort before __name__, before le */
} ClassicLabels;

static inline int
str_is(Str s, const uint8_t *lit, size_t n)
{
    return s.n == n && memcmp(s.s, lit, n) == 0;
}

static ConvertStatus
classic_labels(Ctx *c, int writing, ClassicLabels *cl)
{
    const Str *syms = c->syms.data;
    const uint64_t *refs = c->refs.data;
    memset(cl, 0, sizeof *cl);
    cl->name.s = NAME_LABEL; /* any pointer: empty */
    c->sorted.len = 0;
    for (size_t i = 0; i + 1 < c->refs.len; i += 2) {
        Str n = syms[refs[i]], v = syms[refs[i + 1]];
        if (str_is(n, NAME_LABEL, 8)) {
            cl->name = v;
            continue;
        }
        if (str_is(n, LE_LABEL, 2))
            continue;
        if (__builtin_add_overflow(cl->rest_size, label_size(n.n, v.n), &cl->rest_size))
            return CONVERT_FALLBACK;
        cl->nrest++;
        if (writing) {
            Sorted *s = vec_push(&c->sorted);
            if (s == NULL)
                return CONVERT_NOMEM;
            s->name = n;
            s->value = v;
            s->at = i;
        }
    }
    /* a classic series' payload is the rest, two labels of the name (plus a suffix) and
     * a bound, and a sample: no sum past this overflows */
    if (cl->rest_size > SIZE_MAX / 4 || cl->name.n > SIZE_MAX / 4 - cl->rest_size)
        return CONVERT_FALLBACK;
    if (writing) {
        Sorted *ss = c->sorted.data;
        if (cl->nrest > 1)
            qsort(ss, cl->nrest, sizeof(Sorted), sorted_cmp);
        Str nm = {NAME_LABEL, 8}, le = {LE_LABEL, 2};
        Sorted key = {nm, nm, (size_t)-1};
        /* __name__ goes before the first label of a greater name (none is equal), le
         * after those of a smaller one: each the count of labels sorting before it */
        while (cl->name_at < cl->nrest && sorted_cmp(&ss[cl->name_at], &key) < 0)
            cl->name_at++;
        key.name = le;
        cl->le_at = cl->name_at;
        while (cl->le_at < cl->nrest && sorted_cmp(&ss[cl->le_at], &key) < 0)
            cl->le_at++;
    }
    return CONVERT_OK;
}

/* One classic series: a TimeSeries of the labels (name + suffix, le when a bucket) and
 * one sample (value bits, timestamp). */
static void
emit_classic_one(Ctx *c, Writer *w, const ClassicLabels *cl, const char *sfx, size_t nsfx,
                 const char *le, size_t nle, uint64_t value_bits, uint64_t ts)
{
    size_t sample = 10 + varint_len(ts);
    size_t payload = cl->rest_size + label_size(8, cl->name.n + nsfx) +
                     (le ? label_size(2, nle) : 0) + field_size(sample);
    if (w->buf == NULL) {
        size_t k = field_size(payload);
        if (w->over || k > SIZE_MAX - w->len)
            w->over = 1;
        else
            w->len += k;
        return;
    }
    w_head(w, 1, payload);
    const Sorted *ss = c->sorted.data;
    Str nm = {NAME_LABEL, 8}, lel = {LE_LABEL, 2};
    for (size_t i = 0; i <= cl->nrest; i++) {
        if (i == cl->name_at)
            emit_label2(w, nm, cl->name.s, cl->name.n, (const uint8_t *)sfx, nsfx);
        if (le && i == cl->le_at)
            emit_label2(w, lel, (const uint8_t *)le, nle, NULL, 0);
        if (i < cl->nrest)
            emit_label2(w, ss[i].name, ss[i].value.s, ss[i].value.n, NULL, 0);
    }
    emit_sample(w, value_bits, ts);
}

/* The bits of a histogram's bounds (field 16, in order) into c->bounds, for the markers
 * after it that borrow them; 0 when out of memory. */
static int
keep_bounds(Ctx *c, size_t p, size_t end, size_t nbounds)
{
    if (nbounds > c->bounds.cap) {
        if (nbounds > SIZE_MAX / sizeof(uint64_t))
            return 0;
        uint64_t *d = realloc(c->bounds.data, nbounds * sizeof(uint64_t));
        if (d == NULL)
            return 0;
        c->bounds.data = d;
        c->bounds.cap = nbounds;
    }
    uint64_t *bits = c->bounds.data;
    Values v;
    values_start(&v, c->raw, p, end, 16);
    for (size_t i = 0; i < nbounds; i++)
        values_next(&v, &bits[i]);
    c->bounds.len = nbounds;
    return 1;
}

/* The classic series of the current series' custom-bucket histograms and the markers
 * that end them (c->nhcb), in order: per entry <name>_bucket{le=...} per bound and +Inf
 * (cumulative counts), <name>_sum, <name>_count; the counts' change added up. A marker
 * (CL_STALE) has the stale NaN for every value, its own timestamp, and its own bounds or
 * (CL_BORROW: convert._series_v1's replace(out.classic[-1], ...)) the entry's before it.
 * Counting, a borrowing marker's buckets are sized once per bounds and length of
 * timestamp (memo): each marker costs O(1), not O(bounds), so the size pass stays linear
 * in the request however many markers borrow one long list of bounds. */
__attribute__((noinline)) static ConvertStatus
emit_classic(Ctx *c, Writer *w)
{
    ClassicLabels cl;
    ConvertStatus st = classic_labels(c, w->buf != NULL, &cl);
    if (st != CONVERT_OK)
        return st;
    const Classic *hs = c->nhcb.data;
    const size_t nh = c->nhcb.len;
    size_t nb = 0;       /* the bounds of the entry before: what a borrower takes */
    size_t memo[11];     /* counting: a borrower's buckets' bytes, by its ts' varint length */
    uint8_t memo_ok[11]; /* 1: memo set; 2: it overflowed */
    memset(memo_ok, 0, sizeof memo_ok);
    for (size_t k = 0; k < nh; k++) {
        Nhcb h;
        nhcb_read(c->raw, hs[k].ps, hs[k].end, &h);
        const int stale = (hs[k].flags & CL_STALE) != 0;
        const int borrow = (hs[k].flags & CL_BORROW) != 0;
        if (!borrow) {
            nb = h.nbounds;
            memset(memo_ok, 0, sizeof memo_ok);
            if (!stale) { /* a marker's buckets, if any, say nothing: not read */
                st = nhcb_counts(c, hs[k].ps, hs[k].end, &h);
                if (st != CONVERT_OK)
                    return st;
            }
            if (k + 1 < nh && (hs[k + 1].flags & CL_BORROW) &&
                !keep_bounds(c, hs[k].ps, hs[k].end, nb))
                return CONVERT_NOMEM;
        }
        size_t tl = varint_len(h.ts);
        if (borrow && w->buf == NULL && memo_ok[tl]) {
            if (memo_ok[tl] == 2 || w->over || memo[tl] > SIZE_MAX - w->len)
                w->over = 1;
            else
                w->len += memo[tl];
        }
        else {
            const double *counts = c->bucket.data;
            const uint64_t *kept = c->bounds.data;
            Values bounds;
            values_start(&bounds, c->raw, hs[k].ps, hs[k].end, 16);
            /* counting a borrower: its buckets alone, to memo */
            Writer mw = {NULL, 0, 0, 0};
            Writer *bw = borrow && w->buf == NULL ? &mw : w;
            double cumulative = 0.0;
            for (size_t i = 0; i <= nb; i++) {
                const char *le = "+Inf";
                size_t nle = 4;
                if (i < nb) {
                    uint64_t bits = 0;
                    if (borrow)
                        bits = kept[i];
                    else
                        values_next(&bounds, &bits);
                    nle = le_of(c, bits, &le);
                    if (nle == 0)
                        return CONVERT_NOMEM;
                }
                uint64_t vb = STALE_NAN_BITS;
                if (!stale) {
                    cumulative += counts[i];
                    if (isnan(cumulative))
                        vb = QUIET_NAN_BITS;
                    else
                        memcpy(&vb, &cumulative, 8);
                }
                emit_classic_one(c, bw, &cl, "_bucket", 7, le, nle, vb, h.ts);
            }
            if (bw == &mw) {
                memo[tl] = mw.len;
                memo_ok[tl] = mw.over ? 2 : 1;
                if (mw.over || w->over || mw.len > SIZE_MAX - w->len)
                    w->over = 1;
                else
                    w->len += mw.len;
            }
        }
        emit_classic_one(c, w, &cl, "_sum", 4, NULL, 0, stale ? STALE_NAN_BITS : h.sum_bits,
                         h.ts);
        emit_classic_one(c, w, &cl, "_count", 6, NULL, 0,
                         stale ? STALE_NAN_BITS : h.count_bits, h.ts);
        c->info.histograms++;
        c->info.samples += (uint64_t)nb + 3;
    }
    return CONVERT_OK;
}
