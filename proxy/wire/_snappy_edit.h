/*
 * Snappy in the compressed domain: an edited copy of a snappy block, made from the block
 * itself and the edits, without compressing anything again (proxy/wire/_snappy_edit.c).
 */
#ifndef KARTA_SNAPPY_EDIT_H
#define KARTA_SNAPPY_EDIT_H

#include <stddef.h>
#include <stdint.h>

/* One piece of an output in order: bytes of the decoded input (p inside raw) or new bytes
 * (p anywhere else). The splice's span list, as it is. */
typedef struct {
    const uint8_t *p;
    size_t n;
} EditSpan;

/* The decoded length a snappy block declares (its uint32 varint preamble), with *head set
 * to the preamble's size; -1 when the preamble is malformed. */
int64_t snappy_block_length(const uint8_t *block, size_t block_len, size_t *head);

/* The most bytes snappy_edit may write for an output of out_len bytes. */
size_t snappy_edit_bound(size_t out_len);

/* Writes into out (out_cap bytes) one snappy block (length preamble, then elements) that
 * decodes to the concatenation of spans[0 .. nspans), out_len bytes in all.
 *
 * block (block_len bytes) is the sender's snappy block; raw (raw_len bytes) is the part of
 * its decoded bytes starting at decoded offset `base` (the whole of it: base 0, raw_len
 * the declared length). A span inside raw is taken from the block's own elements: its
 * literals stay literals, its copies stay copies (their offsets moved by what the edits
 * inserted or removed between source and destination, or cut where the source lies in
 * bytes the output does not carry). New bytes go out as literals, or as a copy of the same
 * bytes written earlier in this output (a pod's stamp, the second time).
 *
 * Returns the bytes written, or 0 when the block is not what it must be (its elements do
 * not decode to at least base + raw_len bytes, an offset outside its output) or out_cap
 * is too small; the caller then compresses the output itself. Never reads outside block,
 * raw, the spans or out. Plain C: called with the GIL released. */
size_t snappy_edit(const uint8_t *block, size_t block_len, size_t base, const uint8_t *raw,
                   size_t raw_len, const EditSpan *spans, size_t nspans, size_t out_len,
                   uint8_t *out, size_t out_cap);

#endif
