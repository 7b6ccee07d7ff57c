/* Growable byte buffers and big-endian helpers used for frames and I/O queues. */
#ifndef SHOAL_BUF_H
#define SHOAL_BUF_H

#include <stddef.h>
#include <stdint.h>

/* Data lives in p[off .. off+len). Consuming from the front only moves `off`, so a
 * partially written buffer costs no memmove; space is compacted lazily on reserve. */
struct buf {
	uint8_t *p;
	size_t off, len, cap;
};

void *xmalloc(size_t n);
void *xrealloc(void *p, size_t n);
char *xstrdup(const char *s);

void buf_reserve(struct buf *b, size_t n); /* room for n more bytes at the tail */
void buf_append(struct buf *b, const void *d, size_t n);
void buf_putc(struct buf *b, uint8_t c);
void buf_puts(struct buf *b, const char *s);
void buf_consume(struct buf *b, size_t n);
void buf_free(struct buf *b);
/* Drop the allocation when empty and large, so idle connections stay small. */
void buf_trim(struct buf *b);

static inline uint8_t *buf_data(const struct buf *b) { return b->p + b->off; }
static inline uint8_t *buf_tail(const struct buf *b) { return b->p + b->off + b->len; }

static inline void put_u32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static inline uint32_t get_u32(const uint8_t *p)
{
	return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint16_t get_u16(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }

#endif
