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
 *   - every series becomes one RW 1.0 TimeSeries: its labels_refs (packed or not) resolved
 *     to Label fields as encode_label_v1 writes them (an empty value left out), then its
 *     samples (start_timestamp, field 3, dropped), its exemplars (labels resolved, the other
 *     fields' bytes as they were), its histograms (start_timestamp, field 17, dropped): the
 *     1.0 field order; created_timestamp and unknown fields go nowhere;
 *   - series metadata becomes one 1.0 MetricMetadata per family (convert.family_name: the
 *     suffix of a histogram, gaugehistogram or summary series stripped), deduplicated on
 *     its contents in first-seen order, after the series. Each symbol a metadata names is
 *     hashed and compared once per request (intern), not once per series naming it.
 *
 * What is left to the reference (CONVERT_FALLBACK): a histogram with custom buckets
 * (schema -53: it becomes classic series) or whose sum is the stale NaN (a staleness
 * marker: convert.py has rules of its own for both), and anything the reference would
 * refuse (every check of splice_v2.scan_v2 / split_series_v2 is made here too, and a
 * request failing one falls back so the reference raises its own error).
 *
 * One walk for the size and the bytes: the Writer counts when it has no buffer. A series'
 * TimeSeries length is its body counted first (the same code, a counting Writer), so the
 * size pass and the conversion cannot drift. Sizes are size_t with every addition checked:
 * one that does not fit falls back (the reference then computes it with Python ints).
 *
 * The wire primitives are _wire.h's, shared with _splice.c; this file has no Python API
 * and no state of the splice.
 */

#include "_convert.h"
#include "_wire.h"

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
/* zigzag(-53): the schema of custom buckets */
#define CUSTOM_BUCKETS_ZIGZAG 105u

/* An RW 2.0 Histogram: check_histogram(17)'s checks; *special set when convert.py has
 * rules of its own for it (its last schema -53, or its last sum the stale NaN, as
 * custom_buckets and stale_marker read them). */
static int
check_histogram(const uint8_t *raw, size_t p, size_t end, int *special)
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
    *special = schema == CUSTOM_BUCKETS_ZIGZAG || sum == STALE_NAN_BITS;
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

/* A series' TimeSeries payload: labels, samples, exemplars, histograms. */
static int
emit_body(Ctx *c, Writer *w, size_t s, size_t q)
{
    const uint8_t *raw = c->raw;
    emit_labels(w, c->syms.data, c->refs.data, c->refs.len);
    static const uint64_t ORDER[] = {2, 4, 3};
    for (int k = 0; k < 3; k++) {
        for (size_t p = s; p < q;) {
            Field f;
            rd_field(raw, p, q, &f);
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
    c->refs.len = 0;
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
            int ok, special = 0;
            if (f.wt != 2)
                return CONVERT_FALLBACK;
            if (f.number == 2)
                ok = check_fields(raw, f.ps, f.end, SAMPLE_WT, 3);
            else if (f.number == 3)
                ok = check_histogram(raw, f.ps, f.end, &special);
            else if (f.number == 4)
                ok = check_exemplar(raw, f.ps, f.end, nsym);
            else {
                ok = check_metadata(raw, f.ps, f.end, nsym);
                has_meta = 1;
            }
            if (!ok || special)
                return CONVERT_FALLBACK;
        }
        p = f.end;
    }
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
    return CONVERT_OK;
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
convert_v2_to_v1(const uint8_t *raw, size_t n, uint8_t *out, size_t out_cap, size_t *size)
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
    if (st != CONVERT_OK)
        return st;
    if (out == NULL) {
        if (w.over)
            return CONVERT_FALLBACK; /* past a size_t: the reference's Python ints */
        *size = w.len;
        return CONVERT_OK;
    }
    *size = w.len;
    return w.over || w.len != out_cap ? CONVERT_MISMATCH : CONVERT_OK;
}
