/* The tcp_connect operation: a byte relay between one stream and a TCP connection the agent opens to
 * a port on the sandbox's own loopback, so the host reaches servers inside a sandbox that has no
 * network (or is a VM) without opening one. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent.h"

extern uint8_t g_scratch[65536];

struct relay {
	struct src sock;        /* the connection: connect completion, then reading */
	struct sink out;        /* a dup of it: what the client sends, written as the socket takes it */
	struct buf early;       /* STDIN that came before the connection was up */
	struct stream *st;
	int port;
	int family;             /* AF_INET first, then AF_INET6 */
	uint8_t connected, early_eof;
	uint64_t nin, nout;
};

static void relay_free(struct relay *r)
{
	src_close(&r->sock);
	sink_close(&r->out);
	buf_free(&r->early);
	defer_free(r);
}

/* Answer and end the stream (RESP with the byte counts, or ERR), then free the relay. */
static void relay_end(struct relay *r, const char *code, const char *msg, int err)
{
	if (r->st) {
		struct conn *c = r->st->conn;
		if (code) {
			conn_send_err(c, r->st->id, code, msg, err);
		} else {
			struct jw w;
			size_t pos = conn_json_begin(c, &w, F_RESP);
			jw_key(&w, "sent");
			jw_int(&w, (int64_t)r->nin);
			jw_key(&w, "received");
			jw_int(&w, (int64_t)r->nout);
			conn_json_end(c, &w, pos, F_RESP, r->st->id);
		}
		stream_end(r->st);
		r->st = NULL;
	}
	relay_free(r);
}

/* Start a nonblocking connect to the loopback address of r->family. 0: connected or in progress. */
static int relay_dial(struct relay *r)
{
	src_close(&r->sock);
	int fd = socket(r->family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	int one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
	int rc;
	if (r->family == AF_INET) {
		struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)r->port)};
		a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
		rc = connect(fd, (struct sockaddr *)&a, sizeof a);
	} else {
		struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)r->port)};
		a.sin6_addr = in6addr_loopback;
		rc = connect(fd, (struct sockaddr *)&a, sizeof a);
	}
	if (rc < 0 && errno != EINPROGRESS) {
		int e = errno;
		close(fd);
		errno = e;
		return -1;
	}
	src_init(&r->sock, fd, SK_TCP, r);
	src_want(&r->sock, EPOLLOUT);
	return 0;
}

/* The connection is up: tell the client (READY), hand over what it sent early, start reading. */
static void relay_up(struct relay *r)
{
	r->connected = 1;
	int wfd = fcntl(r->sock.fd, F_DUPFD_CLOEXEC, 3);
	if (wfd < 0) {
		relay_end(r, "io_error", "dup of the connection failed", errno);
		return;
	}
	sink_init(&r->out, wfd);
	r->out.shut_wr = 1;
	sink_set_conn(&r->out, r->st->conn);
	struct conn *c = r->st->conn;
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_READY);
	jw_key(&w, "family");
	jw_cstr(&w, r->family == AF_INET ? "ipv4" : "ipv6");
	conn_json_end(c, &w, pos, F_READY, r->st->id);
	if (r->early.len) {
		r->nin += r->early.len;
		sink_write(&r->out, buf_data(&r->early), r->early.len);
		buf_free(&r->early);
	}
	if (r->early_eof)
		sink_eof(&r->out);
	src_want(&r->sock, EPOLLIN);
}

/* Refused (or unreachable) on one family: try the other one, else report nothing listening. */
static void relay_refused(struct relay *r, int err)
{
	if (r->family == AF_INET) {
		r->family = AF_INET6;
		if (relay_dial(r) == 0)
			return;
		err = errno == EAFNOSUPPORT ? err : errno;
	}
	char msg[160];
	snprintf(msg, sizeof msg, "nothing accepts connections on port %d inside the sandbox (127.0.0.1, ::1): %s",
	         r->port, strerror(err));
	relay_end(r, "connection_refused", msg, err);
}

void tcp_on_event(struct src *s, uint32_t ev)
{
	struct relay *r = s->owner;
	if (!r->connected) {
		int err = 0;
		socklen_t len = sizeof err;
		if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
			err = errno;
		if (err == 0 && !(ev & (EPOLLERR | EPOLLHUP)))
			relay_up(r);
		else
			relay_refused(r, err ? err : ECONNREFUSED);
		return;
	}
	struct conn *c = r->st ? r->st->conn : NULL;
	if (!c) {
		relay_free(r);
		return;
	}
	if (conn_out_full(c)) {
		src_want(s, 0); /* resumed by tcp_resume once the client catches up */
		return;
	}
	ssize_t n = read(s->fd, g_scratch, sizeof g_scratch);
	if (n > 0) {
		conn_send(c, F_STDOUT, r->st->id, g_scratch, (size_t)n);
		r->nout += (uint64_t)n;
		return;
	}
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n == 0) {
		relay_end(r, NULL, NULL, 0); /* the server closed: what it sent is all there is */
		return;
	}
	relay_end(r, "io_error", n < 0 && errno == ECONNRESET ? "the server reset the connection"
	                                                      : "reading from the connection failed", errno);
}

void tcp_frame(struct stream *st, int type, const uint8_t *p, size_t n)
{
	struct relay *r = st->obj;
	switch (type) {
	case F_STDIN:
		if (!r->connected) {
			if (!r->early_eof)
				buf_append(&r->early, p, n);
		} else if (!r->out.eof_pending && r->out.s.fd >= 0) {
			r->nin += n;
			sink_write(&r->out, p, n);
		}
		break;
	case F_STDIN_EOF:
		if (!r->connected)
			r->early_eof = 1;
		else
			sink_eof(&r->out);
		break;
	case F_SIGNAL:
		/* The client gives up on the connection: close it at once (RST, not a lingering FIN). */
		if (r->sock.fd >= 0) {
			struct linger lg = {.l_onoff = 1, .l_linger = 0};
			setsockopt(r->sock.fd, SOL_SOCKET, SO_LINGER, &lg, sizeof lg);
		}
		relay_end(r, NULL, NULL, 0);
		break;
	}
}

void tcp_detach(struct stream *st)
{
	struct relay *r = st->obj;
	r->st = NULL;
	relay_free(r); /* a relay means nothing without its client */
}

void tcp_resume(struct stream *st)
{
	struct relay *r = st->obj;
	if (r->connected && r->sock.fd >= 0)
		src_want(&r->sock, EPOLLIN);
}

void op_tcp_connect(struct conn *c, uint32_t sid, const struct jv *req)
{
	int64_t port = 0;
	if (jv_int(req, "port", &port) != 1 || port < 1 || port > 65535) {
		conn_send_err(c, sid, "bad_request", "port must be an integer between 1 and 65535", 0);
		return;
	}
	struct relay *r = xmalloc(sizeof *r);
	memset(r, 0, sizeof *r);
	r->port = (int)port;
	r->family = AF_INET;
	src_init(&r->sock, -1, SK_TCP, r);
	sink_init(&r->out, -1);
	r->st = stream_add(c, sid, ST_TCP, r);
	if (relay_dial(r) < 0) {
		int e = errno;
		if (e == ECONNREFUSED || e == ENETUNREACH || e == EADDRNOTAVAIL)
			relay_refused(r, e);
		else
			relay_end(r, "io_error", "cannot open a socket", e);
	}
}
