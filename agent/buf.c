#include "buf.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void oom(void)
{
	/* Nothing sensible to do: the sandbox's memory limit is exhausted. */
	static const char msg[] = "shoal-agent: out of memory\n";
	if (write(2, msg, sizeof msg - 1) < 0) { /* nothing */ }
	abort();
}

void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);
	if (!p)
		oom();
	return p;
}

void *xrealloc(void *p, size_t n)
{
	p = realloc(p, n ? n : 1);
	if (!p)
		oom();
	return p;
}

char *xstrdup(const char *s)
{
	size_t n = strlen(s) + 1;
	char *d = xmalloc(n);
	memcpy(d, s, n);
	return d;
}

void buf_reserve(struct buf *b, size_t n)
{
	if (b->cap - b->off - b->len >= n)
		return;
	if (b->off && b->cap - b->len >= n) {
		memmove(b->p, b->p + b->off, b->len);
		b->off = 0;
		return;
	}
	if (b->off) {
		memmove(b->p, b->p + b->off, b->len);
		b->off = 0;
	}
	size_t cap = b->cap ? b->cap : 256;
	while (cap - b->len < n)
		cap *= 2;
	b->p = xrealloc(b->p, cap);
	b->cap = cap;
}

void buf_append(struct buf *b, const void *d, size_t n)
{
	if (!n)
		return;
	buf_reserve(b, n);
	memcpy(buf_tail(b), d, n);
	b->len += n;
}

void buf_putc(struct buf *b, uint8_t c)
{
	if (b->cap - b->off - b->len < 1)
		buf_reserve(b, 1);
	b->p[b->off + b->len++] = c;
}

void buf_puts(struct buf *b, const char *s) { buf_append(b, s, strlen(s)); }

void buf_consume(struct buf *b, size_t n)
{
	if (n >= b->len) {
		b->off = 0;
		b->len = 0;
		return;
	}
	b->off += n;
	b->len -= n;
}

void buf_free(struct buf *b)
{
	free(b->p);
	b->p = NULL;
	b->off = b->len = b->cap = 0;
}

void buf_trim(struct buf *b)
{
	if (b->len == 0) {
		b->off = 0;
		if (b->cap > 64 * 1024)
			buf_free(b);
	}
}
