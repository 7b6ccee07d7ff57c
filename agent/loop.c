/* Event-loop plumbing: epoll registration of sources, deferred frees, buffered sinks. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

int g_epfd = -1;

int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void logmsg(const char *fmt, ...)
{
	char b[512];
	int n = snprintf(b, sizeof b, "shoal-agent: ");
	va_list ap;
	va_start(ap, fmt);
	n += vsnprintf(b + n, sizeof b - (size_t)n - 1, fmt, ap);
	va_end(ap);
	if (n > (int)sizeof b - 2)
		n = (int)sizeof b - 2;
	b[n++] = '\n';
	if (write(2, b, (size_t)n) < 0) { /* stderr is the host's; nothing to do */ }
}

/* Objects owning a src are freed only after the current epoll batch: a later event in the
 * same batch may still point at them (their fd is -1 by then, so it is ignored). */
static void **g_defer;
static size_t g_ndefer, g_capdefer;

void defer_free(void *p)
{
	if (g_ndefer == g_capdefer) {
		g_capdefer = g_capdefer ? g_capdefer * 2 : 16;
		g_defer = xrealloc(g_defer, sizeof(void *) * g_capdefer);
	}
	g_defer[g_ndefer++] = p;
}

void run_deferred(void)
{
	for (size_t i = 0; i < g_ndefer; i++)
		free(g_defer[i]);
	g_ndefer = 0;
}

void src_init(struct src *s, int fd, int kind, void *owner)
{
	s->fd = fd;
	s->kind = (uint8_t)kind;
	s->registered = 0;
	s->events = 0;
	s->owner = owner;
}

void src_want(struct src *s, uint32_t events)
{
	if (s->fd < 0)
		return;
	if (!events) {
		if (s->registered) {
			epoll_ctl(g_epfd, EPOLL_CTL_DEL, s->fd, NULL);
			s->registered = 0;
		}
		s->events = 0;
		return;
	}
	if (s->registered && s->events == events)
		return;
	struct epoll_event ev = {.events = events, .data.ptr = s};
	if (epoll_ctl(g_epfd, s->registered ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, s->fd, &ev) < 0) {
		logmsg("epoll_ctl(fd %d): %s", s->fd, strerror(errno));
		return;
	}
	s->registered = 1;
	s->events = events;
}

void src_close(struct src *s)
{
	if (s->fd < 0)
		return;
	/* close() removes the fd from epoll unless a dup exists (the PTY master has one). */
	if (s->registered)
		epoll_ctl(g_epfd, EPOLL_CTL_DEL, s->fd, NULL);
	close(s->fd);
	s->fd = -1;
	s->registered = 0;
	s->events = 0;
}

/* ---------- sinks ---------- */

void sink_init(struct sink *k, int fd)
{
	memset(k, 0, sizeof *k);
	src_init(&k->s, fd, SK_SINK, k);
}

void sink_set_conn(struct sink *k, struct conn *c) { k->conn = c; }

static void sink_unblock(struct sink *k)
{
	if (k->blocking) {
		k->blocking = 0;
		if (k->conn && !k->conn->dead) {
			k->conn->in_block--;
			conn_update(k->conn);
		}
	}
}

void sink_close(struct sink *k)
{
	sink_unblock(k);
	src_close(&k->s);
	buf_free(&k->b);
	k->eof_pending = 0;
}

static void sink_do_eof(struct sink *k)
{
	k->eof_pending = 0;
	if (k->shut_wr && k->s.fd >= 0)
		shutdown(k->s.fd, SHUT_WR); /* the fd is a dup: closing it alone would send no FIN */
	if (k->eof_byte) {
		/* A PTY stays open (it is also the output); EOF is the VEOF character. */
		uint8_t c = k->eof_byte;
		sink_write(k, &c, 1);
		return;
	}
	sink_close(k);
}

/* Write as much as the fd takes now. */
static void sink_flush(struct sink *k)
{
	while (k->b.len) {
		ssize_t n = write(k->s.fd, buf_data(&k->b), k->b.len);
		if (n > 0) {
			buf_consume(&k->b, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		/* EPIPE: the reader is gone; what we hold is undeliverable. */
		sink_close(k);
		return;
	}
	if (k->b.len == 0) {
		src_want(&k->s, 0);
		buf_trim(&k->b);
		if (k->eof_pending) {
			sink_do_eof(k);
			return;
		}
	} else {
		src_want(&k->s, EPOLLOUT);
	}
	if (k->blocking && k->b.len < SINK_LOW)
		sink_unblock(k);
}

void sink_write(struct sink *k, const void *p, size_t n)
{
	if (k->s.fd < 0 || !n)
		return;
	buf_append(&k->b, p, n);
	sink_flush(k);
	if (k->s.fd >= 0 && k->b.len > SINK_HIGH && !k->blocking && k->conn) {
		k->blocking = 1;
		k->conn->in_block++;
		conn_update(k->conn);
	}
}

void sink_eof(struct sink *k)
{
	if (k->s.fd < 0)
		return;
	if (k->b.len)
		k->eof_pending = 1;
	else
		sink_do_eof(k);
}

void sink_on_writable(struct sink *k)
{
	if (k->s.fd >= 0)
		sink_flush(k);
}
