/*
 * Protobuf wire primitives of the native code (_splice.c, _convert.c): one copy, as
 * proxy/wire/primitives.py is the Python code's. Plain C, no Python API, no error text:
 * a field that cannot be read says why as a WireFail, and each caller words it.
 */
#ifndef KARTA_WIRE_H
#define KARTA_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* A varint at *pos (< end); returns 0 on a truncated or over-long one. At most 10 bytes,
 * the 10th carrying only the top bit, as protobuf readers require. */
static inline int
rd_varint(const uint8_t *buf, size_t end, size_t *pos, uint64_t *out)
{
    size_t p = *pos;
    if (p < end && buf[p] < 0x80) {
        *out = buf[p];
        *pos = p + 1;
        return 1;
    }
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (p >= end)
            return 0;
        uint8_t b = buf[p++];
        if (shift == 63 && b > 1)
            return 0;
        v |= (uint64_t)(b & 0x7F) << shift;
        if (b < 0x80) {
            *out = v;
            *pos = p;
            return 1;
        }
    }
    return 0;
}

typedef struct {
    uint64_t number;
    int wt;
    size_t start; /* the field's first byte */
    size_t ps;    /* payload start (after the length for wire type 2) */
    size_t end;   /* after the field */
} Field;

/* Why a field could not be read (wire_field). */
typedef enum {
    WIRE_OK = 0,
    WIRE_VARINT,    /* truncated or over-long varint */
    WIRE_NUMBER_0,  /* field number 0 */
    WIRE_NUMBER,    /* field number past 2^29 - 1 */
    WIRE_PAST_END,  /* runs past the end of its message */
    WIRE_TYPE,      /* unsupported wire type (3, 4, 6, 7) */
} WireFail;

/* One field at pos, inside [.., end): primitives.read_field's rules. f->number and f->wt
 * are set once the tag is read, for the caller's message. */
static inline WireFail
wire_field(const uint8_t *buf, size_t pos, size_t end, Field *f)
{
    uint64_t key, ln;
    size_t p = pos;
    if (!rd_varint(buf, end, &p, &key))
        return WIRE_VARINT;
    f->start = pos;
    f->number = key >> 3;
    f->wt = (int)(key & 7);
    if (f->number == 0)
        return WIRE_NUMBER_0;
    if (f->number > ((1u << 29) - 1))
        return WIRE_NUMBER;
    switch (f->wt) {
    case 2:
        if (!rd_varint(buf, end, &p, &ln))
            return WIRE_VARINT;
        if (ln > end - p)
            return WIRE_PAST_END;
        f->ps = p;
        f->end = p + (size_t)ln;
        return WIRE_OK;
    case 0:
        f->ps = p;
        if (!rd_varint(buf, end, &p, &ln))
            return WIRE_VARINT;
        f->end = p;
        return WIRE_OK;
    case 1:
    case 5: {
        size_t w = f->wt == 1 ? 8 : 4;
        if (w > end - p)
            return WIRE_PAST_END;
        f->ps = p;
        f->end = p + w;
        return WIRE_OK;
    }
    default:
        return WIRE_TYPE;
    }
}

static inline size_t
varint_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline size_t
put_varint(uint8_t *out, uint64_t v)
{
    size_t n = 0;
    while (v >= 0x80) {
        out[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    out[n++] = (uint8_t)v;
    return n;
}

/* Strict UTF-8, as Python's decoder: no overlongs, no surrogates, nothing past U+10FFFF. */
static inline int
utf8_ok(const uint8_t *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        /* eight ASCII bytes at a time */
        while (i + 8 <= n) {
            uint64_t w;
            memcpy(&w, s + i, 8);
            if (w & 0x8080808080808080ULL)
                break;
            i += 8;
        }
        if (i >= n)
            break;
        uint8_t c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        if (c >= 0xC2 && c <= 0xDF) {
            if (i + 1 >= n || (s[i + 1] & 0xC0) != 0x80)
                return 0;
            i += 2;
        }
        else if (c >= 0xE0 && c <= 0xEF) {
            if (i + 2 >= n)
                return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80)
                return 0;
            if (c == 0xE0 && c1 < 0xA0)
                return 0; /* overlong */
            if (c == 0xED && c1 > 0x9F)
                return 0; /* surrogate */
            i += 3;
        }
        else if (c >= 0xF0 && c <= 0xF4) {
            if (i + 3 >= n)
                return 0;
            uint8_t c1 = s[i + 1], c2 = s[i + 2], c3 = s[i + 3];
            if ((c1 & 0xC0) != 0x80 || (c2 & 0xC0) != 0x80 || (c3 & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && c1 < 0x90)
                return 0; /* overlong */
            if (c == 0xF4 && c1 > 0x8F)
                return 0; /* past U+10FFFF */
            i += 4;
        }
        else
            return 0;
    }
    return 1;
}

/* wire type of each known field of the messages a series carries (1, 2, ...; -1: any) */
static const int8_t SAMPLE_WT[] = {1, 0, 0};  /* value, timestamp, (2.0) start_timestamp */
static const int8_t EXEMPLAR_WT[] = {-1, 1, 0};        /* labels read apart, value, ts */
static const int8_t METADATA_V2_WT[] = {0, -1, 0, 0};  /* type, -, help_ref, unit_ref */

/* A Histogram's fields 1-17 (primitives.HISTOGRAM_FIELDS): a wire type, or H_SPANS (a
 * BucketSpan message: two varints), H_VARINTS / H_DOUBLES (one per field, or packed). */
#define H_SPANS 8
#define H_VARINTS 9
#define H_DOUBLES 10
static const int8_t HISTOGRAM_WT[] = {0, 1, 1, 0, 1, 0, 1, H_SPANS, H_VARINTS, H_DOUBLES,
                                      H_SPANS, H_VARINTS, H_DOUBLES, 0, 0, H_DOUBLES, 0};
static const int8_t SPAN_WT[] = {0, 0};

#endif
