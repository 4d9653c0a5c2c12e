/*
 * RW 2.0 -> 1.0 natively: a remote-write 2.0 Request as the equivalent 1.0 WriteRequest
 * (proxy/wire/_convert.c), byte for byte what proxy/wire/convert.py's v2_to_v1 makes.
 * Plain C, no Python API: called with the GIL released.
 */
#ifndef KARTA_CONVERT_H
#define KARTA_CONVERT_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    CONVERT_OK = 0,
    /* the request holds something left to the Python reference: anything malformed (the
     * reference then raises its own error: a custom-bucket histogram's bucket past its
     * bounds too), or a custom-bucket histogram whose running delta sum or span offsets
     * leave an int64 (the reference's Python ints take them); also a size that does not
     * fit a size_t */
    CONVERT_FALLBACK = 1,
    CONVERT_NOMEM = 2,
    /* out_cap is not the size the request converts to (the caller's error) */
    CONVERT_MISMATCH = 3,
} ConvertStatus;

/* What a conversion tells beside its size or bytes: how it changes a request's counts
 * (convert.V1Form). Each custom-bucket histogram (schema -53) becomes classic series, one
 * histogram fewer and one sample more per bucket (its bounds and +Inf) plus its _sum and
 * _count; so does a staleness marker that ends such series (its bounds its own or the
 * data's before it); a marker alone in its series becomes a float stale marker, a
 * histogram fewer and a sample more. */
typedef struct {
    uint64_t histograms; /* fewer */
    uint64_t samples;    /* more */
} ConvertInfo;

/* Converts raw (n bytes, an RW 2.0 Request) to RW 1.0.
 *
 * out NULL: counts only; *size is set to the converted size (what the conversion will
 * hold, known before a byte of it is allocated). out not NULL: writes the conversion into
 * out, which must be exactly out_cap bytes, the size a counting call answered; anything
 * else is CONVERT_MISMATCH and out holds garbage. info (may be NULL) is filled on
 * CONVERT_OK. Both modes are one walk of the request (a writer that only counts when it
 * has no buffer), so the size and the bytes cannot disagree.
 *
 * Never reads outside raw[0 .. n) nor writes outside out[0 .. out_cap); every allocation
 * is freed before return. */
ConvertStatus convert_v2_to_v1(const uint8_t *raw, size_t n, uint8_t *out, size_t out_cap,
                               size_t *size, ConvertInfo *info);

/* Seeds the hash of the metadata set (once, at import, before any conversion): its keys
 * are a sender's strings, and with a hash known in advance a request of colliding ones
 * would make the set quadratic. */
void convert_seed(uint64_t seed);

/* convert.format_le(b): a bucket bound as Go's strconv.FormatFloat(b, 'g', -1, 64)
 * writes it, into out (32 bytes at least); its length. Exposed for the tests. */
size_t convert_format_le(double b, char *out);

/* Tests only: the bytes of metadata strings (names, help, units) this thread's last
 * conversion hashed and compared; each distinct symbol's are counted O(1) times. */
uint64_t convert_last_meta_bytes(void);

#endif
