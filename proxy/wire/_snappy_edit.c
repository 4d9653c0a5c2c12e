/*
 * Snappy in the compressed domain (see _snappy_edit.h).
 *
 * Why: a spliced request is the sender's request with a few bytes changed per series (a
 * new length, a stamp inserted, a sender's karta_* label dropped). Compressing it again
 * costs more than the splice itself (~1.3 ms of a 2,000-series request, against ~0.6 ms
 * for the splice), and finds little the sender's compressor had not already found. So
 * the output block is made from the sender's block: each of its elements that lands in
 * the output is written again as it was, a copy with its offset moved by what the edits
 * inserted or removed between its source and its destination. Nothing is searched for.
 *
 * A snappy block: a varint of the decoded length, then elements, each a literal (the
 * bytes follow) or a copy (length, offset back into what was decoded so far; copy-1: len
 * 4-11, offset < 2048; copy-2: len 1-64, offset < 65536; copy-4: len 1-64, offset < 2^32).
 *
 * The edits are the splice's spans (EditSpan): pieces of the decoded input in increasing
 * order (a range, "kept"), and new bytes between them. An input element covering a kept
 * range is cut to it; a copy's source is looked up among the kept ranges: where it lies in
 * one, the copy goes out with the distance between the two positions in the output; where
 * it lies in bytes the output does not carry (a series' old length, a dropped label, or
 * before this part of the block), those bytes go out as literals, read from the decoded
 * input. New bytes (a stamp) are remembered by their hash, so the same bytes again go out
 * as a copy of the first: a pod's stamp costs 3-5 bytes from its second series on; a
 * stamp not seen yet goes field by field, then name and value (new_bytes).
 *
 * Memory: the kept ranges (one per kept span), a 64-byte block index of them and a fixed
 * table of recent new bytes; freed before return. Nothing depends on the pod table.
 */

#include "_snappy_edit.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------ */
/* the input block's elements                                                           */

typedef struct {
    const uint8_t *c;
    size_t cn, cp;    /* the block, and the next element's tag */
    uint64_t declared;
    uint64_t pos, end; /* the current element's decoded bytes [pos, end) */
    uint64_t off;      /* its copy offset; 0: a literal */
} Reader;

static inline uint32_t
load32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* The next element; 0 at the end of the block or on anything malformed (*bad set). */
static inline int
rd_next(Reader *r, int *bad)
{
    static const uint32_t MASK[5] = {0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF};
    r->pos = r->end;
    size_t cp = r->cp;
    if (cp >= r->cn)
        return 0;
    const uint8_t *c = r->c;
    size_t left = r->cn - cp - 1;
    uint8_t tag = c[cp++];
    uint64_t len, off = 0;
    if ((tag & 3) == 0) {
        uint64_t x = tag >> 2;
        if (x >= 60) {
            size_t nb = (size_t)x - 59;
            if (left < nb)
                goto bad;
            x = 0;
            for (size_t i = 0; i < nb; i++)
                x |= (uint64_t)c[cp + i] << (8 * i);
            cp += nb;
            left -= nb;
        }
        len = x + 1;
        if (left < len)
            goto bad;
        cp += (size_t)len;
    } else {
        /* copy-1: 1 byte of offset (3 more bits in the tag), copy-2: 2, copy-4: 4 */
        size_t nb = (tag & 3) == 3 ? 4 : (tag & 3);
        if (left < nb)
            goto bad;
        uint32_t v = left >= 4 ? load32(c + cp) : (uint32_t)c[cp] |
                     (nb > 1 ? (uint32_t)c[cp + 1] << 8 : 0);
        v &= MASK[nb];
        if ((tag & 3) == 1) {
            len = 4 + ((tag >> 2) & 7);
            off = ((uint64_t)(tag >> 5) << 8) | v;
        } else {
            len = 1 + (tag >> 2);
            off = v;
        }
        cp += nb;
        if (off == 0 || off > r->pos)
            goto bad;
    }
    if (len > r->declared - r->pos)
        goto bad;
    r->cp = cp;
    r->end = r->pos + len;
    r->off = off;
    return 1;
bad:
    *bad = 1;
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* the output                                                                           */

/* 16 bytes (positions are below 2^32: snappy's limit), four to a cache line */
typedef struct {
    uint32_t in_start, in_end, out_start;
    uint32_t span; /* the span it comes from */
} Range;

/* new bytes written so far, by hash (a direct-mapped table: a collision forgets) */
#define SEEN_SLOTS 2048
/* the kept ranges' index: one entry per 64 bytes of the input */
#define INDEX_SHIFT 6
#define SEEN_MIN_BYTES 4

typedef struct {
    uint64_t h;
    const uint8_t *p;
    size_t n;
    uint64_t out;
} Seen;

typedef struct {
    uint8_t *p, *end;
    int failed;
    /* the tag byte of the literal run being written, or NULL */
    uint8_t *lit_tag;
    /* the kept ranges, the index of their blocks, and the input they come from */
    const Range *rg;
    size_t nr;
    const int32_t *idx;
    const uint8_t *raw;
    size_t raw_len;
    uint64_t base;
    Seen seen[SEEN_SLOTS];
} Writer;

/* Literal bytes: written in place behind a tag byte kept for the run they join (a run
 * over 60 bytes needs 1-4 more bytes of tag: moved up at its end, by flush). */
static inline void
lit(Writer *w, const uint8_t *p, size_t n)
{
    if (n == 0) /* an RW 2.0 symbols span with nothing appended */
        return;
    if ((size_t)(w->end - w->p) < n + 6) {
        w->failed = 1;
        return;
    }
    if (w->lit_tag == NULL)
        w->lit_tag = w->p++;
    memcpy(w->p, p, n);
    w->p += n;
}

/* n bytes of the decoded input at offset off (a literal of the sender's, or a piece of a
 * copy that has no source in the output): short ones as one 16-byte move where the input
 * and the output have the room (the bytes past n are overwritten by what follows). */
static inline void
lit_raw(Writer *w, size_t off, size_t n)
{
    if (n <= 16 && off + 16 <= w->raw_len && (size_t)(w->end - w->p) >= 16 + 6) {
        if (w->lit_tag == NULL)
            w->lit_tag = w->p++;
        memcpy(w->p, w->raw + off, 16);
        w->p += n;
        return;
    }
    lit(w, w->raw + off, n);
}

static inline void
flush(Writer *w)
{
    uint8_t *t = w->lit_tag;
    if (t == NULL)
        return;
    w->lit_tag = NULL;
    size_t n = (size_t)(w->p - t - 1); /* >= 1: a run starts with its bytes */
    size_t x = n - 1;
    if (x < 60) {
        *t = (uint8_t)(x << 2);
        return;
    }
    int nb = x < (1u << 8) ? 1 : x < (1u << 16) ? 2 : x < (1u << 24) ? 3 : 4;
    memmove(t + 1 + nb, t + 1, n); /* room was checked by lit */
    *t = (uint8_t)((59 + nb) << 2);
    for (int i = 0; i < nb; i++)
        t[1 + i] = (uint8_t)(x >> (8 * i));
    w->p += nb;
}

/* One copy element: 4 <= len <= 64, d < 2^32 (room for 5 bytes checked by the caller). */
static inline void
copy_one(Writer *w, uint64_t d, size_t len)
{
    uint8_t *o = w->p;
    if (len <= 11 && d < 2048) {
        o[0] = (uint8_t)(1 | ((len - 4) << 2) | ((d >> 8) << 5));
        o[1] = (uint8_t)d;
        w->p = o + 2;
    } else if (d < 65536) {
        o[0] = (uint8_t)(2 | ((len - 1) << 2));
        o[1] = (uint8_t)d;
        o[2] = (uint8_t)(d >> 8);
        w->p = o + 3;
    } else {
        o[0] = (uint8_t)(3 | ((len - 1) << 2));
        o[1] = (uint8_t)d;
        o[2] = (uint8_t)(d >> 8);
        o[3] = (uint8_t)(d >> 16);
        o[4] = (uint8_t)(d >> 24);
        w->p = o + 5;
    }
}

/* A copy of len >= 4 bytes from d back: elements of 64, then one of 60 where the rest
 * would be under 4, as snappy's own encoder cuts them. */
static void
copy(Writer *w, uint64_t d, size_t len)
{
    flush(w);
    if ((size_t)(w->end - w->p) < (len / 60 + 2) * 5) {
        w->failed = 1;
        return;
    }
    while (len >= 68) {
        copy_one(w, d, 64);
        len -= 64;
    }
    if (len > 64) {
        copy_one(w, d, 60);
        len -= 60;
    }
    copy_one(w, d, len);
}

/* The kept range holding input position x, or the last one before it; -1: x is before
 * every kept range. From the index of 64-byte blocks (kept ranges are longer than that,
 * nearly always: a step or two). */
static inline long
range_at(const Writer *w, uint64_t x)
{
    if (x < w->base)
        return -1;
    long j = w->idx[(x - w->base) >> INDEX_SHIFT];
    while ((size_t)(j + 1) < w->nr && w->rg[j + 1].in_start <= x)
        j++;
    return j;
}

/* The output's bytes [dst_out, dst_out + m), which are the input's [dst_in, dst_in + m),
 * equal to the input's [src, src + m): copies where the source is in the output too,
 * literals where it is not. */
static void
copy_piece(Writer *w, uint64_t src, uint64_t dst_in, size_t m, uint64_t dst_out)
{
    while (m && !w->failed) {
        long j = range_at(w, src);
        size_t take;
        if (j < 0 || src >= w->rg[j].in_end) {
            /* bytes the output does not carry: up to the next kept range, as literals */
            uint64_t next = w->rg[j + 1].in_start; /* a kept range: dst_in's, or before */
            take = next - src < m ? (size_t)(next - src) : m;
            lit_raw(w, (size_t)(dst_in - w->base), take);
        } else {
            const Range *g = &w->rg[j];
            take = g->in_end - src < m ? (size_t)(g->in_end - src) : m;
            uint64_t d = dst_out - (g->out_start + (src - g->in_start));
            if (take >= 4 && (d < 65536 || take >= 8) && d <= UINT32_MAX)
                copy(w, d, take);
            else
                lit_raw(w, (size_t)(dst_in - w->base), take);
        }
        src += take;
        dst_in += take;
        dst_out += take;
        m -= take;
    }
}

/* A hash of new bytes from their length and their first, middle and last 8 bytes only: a
 * table hit is checked byte for byte anyway, and two stamps, fields or values that differ
 * (a workload, a namespace such as team-app-env) differ in one of those nearly always. So
 * a lookup costs the same for any size. */
static inline uint64_t
hash_new(const uint8_t *s, size_t n)
{
    uint64_t a, b, m;
    if (n >= 8) {
        memcpy(&a, s, 8);
        memcpy(&m, s + n / 2 - 4, 8);
        memcpy(&b, s + n - 8, 8);
    } else {
        a = b = m = 0;
        for (size_t i = 0; i < n; i++)
            a |= (uint64_t)s[i] << (8 * i);
    }
    uint64_t h = (a ^ (0x9E3779B97F4A7C15ULL * n)) * 0xff51afd7ed558ccdULL;
    h = (h ^ (h >> 31) ^ m) * 0xc4ceb9fe1a85ec53ULL;
    h ^= (h >> 29) ^ b;
    /* murmur3's finalizer: every input bit reaches the low bits, the table's index */
    h = (h ^ (h >> 33)) * 0xff51afd7ed558ccdULL;
    h = (h ^ (h >> 33)) * 0xc4ceb9fe1a85ec53ULL;
    return h ^ (h >> 33);
}

/* How far back the same n bytes were written in this output (found by their hash), or 0;
 * either way they are remembered as written at out (the nearest: shorter offsets). */
static uint64_t
seen(Writer *w, const uint8_t *p, size_t n, uint64_t out)
{
    uint64_t h = hash_new(p, n);
    Seen *s = &w->seen[h & (SEEN_SLOTS - 1)];
    uint64_t d = 0;
    if (s->p != NULL && s->h == h && s->n == n && memcmp(s->p, p, n) == 0 &&
        out - s->out <= UINT32_MAX)
        d = out - s->out;
    else {
        s->h = h;
        s->p = p;
        s->n = n;
    }
    s->out = out;
    return d;
}

/* Bytes at output position out: a copy of the same bytes written before, or a literal. */
static void
dedupe(Writer *w, const uint8_t *p, size_t n, uint64_t out)
{
    uint64_t d = n >= SEEN_MIN_BYTES ? seen(w, p, n, out) : 0;
    if (d)
        copy(w, d, n);
    else
        lit(w, p, n);
}

/* The length of the RW 1.0 Label field at p (`0A len 0A nl name 12 vl value`, one-byte
 * name and value lengths), with *name_part the bytes `0A nl name 12` start at p + *head;
 * 0: not such a field. */
static size_t
label_field(const uint8_t *p, size_t n, size_t *head, size_t *vhead)
{
    if (n < 2 || p[0] != 0x0A)
        return 0;
    size_t len, h;
    if (p[1] < 0x80) {
        len = p[1];
        h = 2;
    } else if (n >= 3 && p[2] < 0x80) {
        len = (size_t)(p[1] & 0x7F) | (size_t)p[2] << 7;
        h = 3;
    } else
        return 0;
    if (len > n - h || len < 4 || p[h] != 0x0A || p[h + 1] >= 0x80)
        return 0;
    size_t nl = p[h + 1], v = h + 2 + nl; /* the value's tag */
    if (v + 2 > h + len || p[v] != 0x12 || p[v + 1] >= 0x80 || v + 2 + p[v + 1] != h + len)
        return 0;
    *head = h;
    *vhead = v + 1;
    return h + len;
}

/* New bytes at output position out. A stamp seen before in this output is one copy; else
 * its Label fields one by one: a field seen before is a copy, else its name (`0A nl name
 * 12`, the same for every pod) and its value (a namespace, a kind, a workload: shared by
 * a workload's pods) each are one where seen before. */
static void
new_bytes(Writer *w, const uint8_t *p, size_t n, uint64_t out)
{
    uint64_t d = n >= SEEN_MIN_BYTES ? seen(w, p, n, out) : 0;
    if (d) {
        copy(w, d, n);
        return;
    }
    size_t i = 0, head, vhead;
    while (i < n) {
        size_t f = label_field(p + i, n - i, &head, &vhead);
        if (f == 0) {
            lit(w, p + i, n - i);
            return;
        }
        /* (a span of one field was looked up whole already) */
        d = f < n ? seen(w, p + i, f, out + i) : 0;
        if (d)
            copy(w, d, f);
        else {
            lit(w, p + i, head);
            dedupe(w, p + i + head, vhead - head, out + i + head);
            lit(w, p + i + vhead, 1);
            dedupe(w, p + i + vhead + 1, f - vhead - 1, out + i + vhead + 1);
        }
        i += f;
    }
}

/* Elements of the block that lie whole inside kept range k (ending at b), from the reader's
 * current one (parsed, not yet written), written as they were, a copy's offset moved, for
 * as long as nothing is unusual: a literal over 64 bytes, a copy whose source is not in one
 * kept range or lands 64 KiB back or more, an element past b, the end of the block or a
 * malformed element. The reader is left on the first element not written (the general
 * path takes it from there); returns the input position reached (no progress when the
 * first element is unusual). */
static uint64_t
keep_run(Writer *w, Reader *rd, size_t k, uint64_t b)
{
    const Range *rg = w->rg;
    const int64_t delta_k = (int64_t)rg[k].out_start - (int64_t)rg[k].in_start;
    Reader r = *rd; /* a local copy: kept in registers across the output's byte stores */
    int bad = 0;    /* the general path finds a malformed element again, and says so */
    uint8_t *o = w->p;
    uint8_t *const limit = w->end - 80; /* room for one element and a literal tag */
    while (r.end <= b && o < limit) {
        size_t len = (size_t)(r.end - r.pos);
        if (r.off == 0) {
            if (len > 64)
                break;
            if (w->lit_tag == NULL)
                w->lit_tag = o++;
            const uint8_t *src = r.c + r.cp - len; /* a literal's bytes end where cp is */
            if (len <= 16 && r.cp - len + 16 <= r.cn)
                memcpy(o, src, 16); /* the bytes past len are overwritten after */
            else
                memcpy(o, src, len);
            o += len;
        } else {
            uint64_t s = r.pos - r.off;
            long j = s >= rg[k].in_start ? (long)k : range_at(w, s);
            if (j < 0 || s + len > rg[j].in_end || len < 4)
                break;
            uint64_t d = (uint64_t)((int64_t)r.off + delta_k -
                                    ((int64_t)rg[j].out_start - (int64_t)rg[j].in_start));
            if (d >= 65536)
                break;
            w->p = o;
            flush(w);
            copy_one(w, d, len);
            o = w->p;
        }
        if (!rd_next(&r, &bad))
            break;
    }
    w->p = o;
    *rd = r;
    return r.pos;
}

int64_t
snappy_block_length(const uint8_t *block, size_t block_len, size_t *head)
{
    uint64_t v = 0;
    for (size_t i = 0; i < 5 && i < block_len; i++) {
        v |= (uint64_t)(block[i] & 0x7F) << (7 * i);
        if (block[i] < 0x80) {
            *head = i + 1;
            return v > UINT32_MAX ? -1 : (int64_t)v;
        }
    }
    return -1;
}

size_t
snappy_edit_bound(size_t out_len)
{
    return 32 + out_len + out_len / 6;
}

size_t
snappy_edit(const uint8_t *block, size_t block_len, size_t base, const uint8_t *raw,
            size_t raw_len, const EditSpan *spans, size_t nspans, size_t out_len, uint8_t *out,
            size_t out_cap)
{
    /* the preamble: the decoded length */
    Reader rd;
    memset(&rd, 0, sizeof rd);
    rd.c = block;
    rd.cn = block_len;
    int64_t declared = snappy_block_length(block, block_len, &rd.cp);
    if (declared < 0 || (uint64_t)declared >= UINT32_MAX ||
        (uint64_t)declared < (uint64_t)base + raw_len || out_len >= UINT32_MAX ||
        nspans >= UINT32_MAX)
        return 0;
    rd.declared = (uint64_t)declared;

    /* the kept ranges: spans inside raw, in increasing order (any other is new bytes) */
    Range *rg = malloc((nspans + 1) * sizeof(Range));
    if (rg == NULL)
        return 0;
    size_t nr = 0;
    uint64_t kept_to = base, opos = 0;
    uintptr_t lo = (uintptr_t)raw, hi = lo + raw_len;
    for (size_t i = 0; i < nspans; i++) {
        uintptr_t p = (uintptr_t)spans[i].p;
        if (spans[i].n && p >= lo && p <= hi && spans[i].n <= hi - p &&
            base + (p - lo) >= kept_to) {
            rg[nr].in_start = (uint32_t)(base + (p - lo));
            rg[nr].in_end = (uint32_t)(rg[nr].in_start + spans[i].n);
            rg[nr].out_start = (uint32_t)opos;
            rg[nr].span = (uint32_t)i;
            kept_to = rg[nr].in_end;
            nr++;
        }
        opos += spans[i].n;
    }
    if (opos != out_len) {
        free(rg);
        return 0;
    }
    rg[nr].in_start = rg[nr].in_end = UINT32_MAX; /* a sentinel: "the next kept range" */
    rg[nr].span = UINT32_MAX;

    if (nr > INT32_MAX) {
        free(rg);
        return 0;
    }
    size_t nblocks = (raw_len >> INDEX_SHIFT) + 1;
    int32_t *idx = malloc(nblocks * sizeof(int32_t));
    Writer *w = calloc(1, sizeof(Writer));
    if (w == NULL || idx == NULL) {
        free(w);
        free(idx);
        free(rg);
        return 0;
    }
    for (size_t b = 0, j = 0; b < nblocks; b++) {
        uint64_t x = base + ((uint64_t)b << INDEX_SHIFT);
        while (j < nr && rg[j].in_start <= x)
            j++;
        idx[b] = (int32_t)j - 1;
    }
    w->idx = idx;
    w->p = out;
    w->end = out + out_cap;
    w->rg = rg;
    w->nr = nr;
    w->raw = raw;
    w->raw_len = raw_len;
    w->base = base;
    if (out_cap < 5) {
        w->failed = 1;
    } else {
        uint64_t v = out_len;
        while (v >= 0x80) {
            *w->p++ = (uint8_t)(v | 0x80);
            v >>= 7;
        }
        *w->p++ = (uint8_t)v;
    }

    int bad = 0;
    int have = rd_next(&rd, &bad);
    size_t k = 0;
    opos = 0;
    for (size_t i = 0; i < nspans && !w->failed && !bad; i++) {
        if (k < nr && rg[k].span == i) {
            uint64_t a = rg[k].in_start, b = rg[k].in_end;
            while (a < b && !w->failed) {
                while (have && rd.end <= a)
                    have = rd_next(&rd, &bad);
                if (!have) {
                    bad = 1;
                    break;
                }
                if (rd.pos == a && rd.end <= b) {
                    /* whole elements inside the kept range, the usual case */
                    uint64_t to = keep_run(w, &rd, k, b);
                    if (to > a) {
                        opos += to - a;
                        a = to;
                        continue;
                    }
                }
                size_t m = (size_t)((rd.end < b ? rd.end : b) - a);
                if (rd.off == 0)
                    lit_raw(w, (size_t)(a - base), m);
                else
                    copy_piece(w, a - rd.off, a, m, opos);
                a += m;
                opos += m;
            }
            k++;
        } else {
            new_bytes(w, spans[i].p, spans[i].n, opos);
            opos += spans[i].n;
        }
    }
    flush(w);
    size_t written = (w->failed || bad) ? 0 : (size_t)(w->p - out);
    free(w);
    free(idx);
    free(rg);
    return written;
}
