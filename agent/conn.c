/* Connections: frame parsing, stream bookkeeping, request dispatch and buffered output. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "agent.h"

struct conn *g_conns;
static uint8_t g_scratch_conn[4096];

void serial_lost(void);           /* main.c: the device is gone, reopen it */
void serial_hangup(struct conn *c); /* main.c: resume reading this conn later */
void conn_kick(struct conn *c);

const char *errno_code(int e)
{
	switch (e) {
	case ENOENT: return "not_found";
	case EEXIST: return "exists";
	case ENOTDIR: return "not_a_directory";
	case EISDIR: return "is_a_directory";
	case EACCES:
	case EPERM: return "permission_denied";
	case EFBIG: return "too_large";
	default: return "io_error";
	}
}

struct conn *conn_new(int fd, int is_serial)
{
	struct conn *c = xmalloc(sizeof *c);
	memset(c, 0, sizeof *c);
	src_init(&c->s, fd, SK_CONN, c);
	c->authed = g_token == NULL;
	c->is_serial = (uint8_t)is_serial;
	c->next = g_conns;
	g_conns = c;
	src_want(&c->s, EPOLLIN);
	return c;
}

/* ---------- output ---------- */

int conn_out_full(struct conn *c)
{
	if (c->out.len >= OUT_HIGH) {
		c->paused_out = 1;
		return 1;
	}
	return 0;
}

uint8_t *conn_frame_begin(struct conn *c, size_t maxpay)
{
	buf_reserve(&c->out, FRAME_HDR + maxpay);
	return buf_tail(&c->out) + FRAME_HDR;
}

void conn_frame_commit(struct conn *c, int type, uint32_t sid, size_t paylen)
{
	uint8_t *h = buf_tail(&c->out);
	put_u32(h, (uint32_t)(paylen + 5));
	h[4] = (uint8_t)type;
	put_u32(h + 5, sid);
	c->out.len += FRAME_HDR + paylen;
}

void conn_send(struct conn *c, int type, uint32_t sid, const void *p, size_t n)
{
	uint8_t *d = conn_frame_begin(c, n);
	if (n)
		memcpy(d, p, n);
	conn_frame_commit(c, type, sid, n);
}

size_t conn_json_begin(struct conn *c, struct jw *w, int type)
{
	(void)type;
	size_t pos = c->out.len;
	buf_reserve(&c->out, FRAME_HDR);
	c->out.len += FRAME_HDR;
	jw_init(w, &c->out);
	jw_obj(w);
	return pos;
}

void conn_json_end(struct conn *c, struct jw *w, size_t pos, int type, uint32_t sid)
{
	jw_obj_end(w);
	size_t paylen = c->out.len - pos - FRAME_HDR;
	if (paylen > MAX_PAYLOAD) {
		c->out.len = pos;
		conn_send_err(c, sid, "too_large", "response exceeds the 1 MiB frame limit", 0);
		return;
	}
	uint8_t *h = buf_data(&c->out) + pos;
	put_u32(h, (uint32_t)(paylen + 5));
	h[4] = (uint8_t)type;
	put_u32(h + 5, sid);
}

void conn_send_err(struct conn *c, uint32_t sid, const char *code, const char *msg, int err)
{
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_ERR);
	jw_key(&w, "code");
	jw_cstr(&w, code);
	jw_key(&w, "message");
	jw_cstr(&w, msg);
	if (err) {
		jw_key(&w, "errno");
		jw_int(&w, err);
	}
	conn_json_end(c, &w, pos, F_ERR, sid);
}

void conn_send_errno(struct conn *c, uint32_t sid, const char *what, int err)
{
	char msg[600];
	snprintf(msg, sizeof msg, "%.500s: %s", what, strerror(err));
	conn_send_err(c, sid, errno_code(err), msg, err);
}

void conn_send_empty_resp(struct conn *c, uint32_t sid) { conn_send(c, F_RESP, sid, "{}", 2); }

/* ---------- streams ---------- */

struct stream *stream_add(struct conn *c, uint32_t id, int kind, void *obj)
{
	struct stream *st = xmalloc(sizeof *st);
	st->id = id;
	st->kind = (uint8_t)kind;
	st->conn = c;
	st->obj = obj;
	st->next = c->streams;
	c->streams = st;
	return st;
}

static struct stream *stream_find(struct conn *c, uint32_t id)
{
	for (struct stream *st = c->streams; st; st = st->next)
		if (st->id == id)
			return st;
	return NULL;
}

void stream_end(struct stream *st)
{
	for (struct stream **pp = &st->conn->streams; *pp; pp = &(*pp)->next) {
		if (*pp == st) {
			*pp = st->next;
			break;
		}
	}
	free(st);
}

/* ---------- flow control ---------- */

static int conn_can_read(struct conn *c)
{
	return !c->dead && !c->hung && !c->closing && c->in_block == 0 && c->out.len < OUT_HARD;
}

void conn_update(struct conn *c)
{
	if (c->dead)
		return;
	if (c->hung) {
		src_want(&c->s, 0);
		return;
	}
	uint32_t ev = 0;
	if (conn_can_read(c))
		ev |= EPOLLIN;
	if (c->out.len)
		ev |= EPOLLOUT;
	if (!ev) {
		/* Keep watching for hangup while input is paused and nothing is queued. */
		ev = EPOLLRDHUP;
	}
	src_want(&c->s, ev);
	if (conn_can_read(c) && c->in.len >= 4 &&
	    c->in.len >= (size_t)get_u32(buf_data(&c->in)) + 4)
		conn_kick(c); /* a frame was already buffered while we were paused */
}

/* The client is gone: what its streams started keeps running, unattended. */
static void conn_detach_streams(struct conn *c)
{
	struct stream *st, *nx;
	for (st = c->streams; st; st = nx) {
		nx = st->next;
		switch (st->kind) {
		case ST_EXEC: exec_detach(st); break;
		case ST_SHELL_RUN: shell_detach(st); break;
		case ST_UPLOAD: upload_abort(st); break;
		case ST_DOWNLOAD: download_abort(st); break;
		case ST_TCP: tcp_detach(st); break;
		case ST_WATCH: watch_detach(st); break;
		}
		free(st);
	}
	c->streams = NULL;
}

/* A serial line is never closed for a hangup or a protocol error: closing a virtio-serial
 * port discards what the host sends meanwhile (its next hello). The logical connection ends;
 * the device stays open and is read again after a pause (the hangup is level-triggered). */
static void serial_reset(struct conn *c)
{
	conn_detach_streams(c);
	buf_free(&c->in);
	buf_free(&c->out);
	c->authed = g_token == NULL;
	c->closing = 0;
	c->paused_out = 0;
	c->in_block = 0;
	/* Bytes still unread belong to the connection that ended: drop them. */
	for (int i = 0; i < 64; i++) {
		ssize_t n = read(c->s.fd, g_scratch_conn, sizeof g_scratch_conn);
		if (n <= 0 && !(n < 0 && errno == EINTR))
			break;
	}
	c->hung = 1;
	src_want(&c->s, 0);
	serial_hangup(c);
}

void conn_close(struct conn *c)
{
	if (c->dead)
		return;
	if (c->is_serial && !c->broken) {
		serial_reset(c);
		return;
	}
	c->dead = 1;
	conn_detach_streams(c);
	src_close(&c->s);
	for (struct conn **pp = &g_conns; *pp; pp = &(*pp)->next) {
		if (*pp == c) {
			*pp = c->next;
			break;
		}
	}
	buf_free(&c->in);
	buf_free(&c->out);
	if (c->is_serial)
		serial_lost();
	defer_free(c);
}

void conn_flush(struct conn *c)
{
	if (c->dead)
		return;
	while (c->out.len) {
		ssize_t n;
		if (c->is_serial)
			n = write(c->s.fd, buf_data(&c->out), c->out.len);
		else
			n = send(c->s.fd, buf_data(&c->out), c->out.len, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (n > 0) {
			buf_consume(&c->out, (size_t)n);
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		if (n < 0 && errno != EPIPE && errno != ECONNRESET)
			c->broken = 1;
		conn_close(c);
		return;
	}
	if (c->closing && c->out.len == 0) {
		conn_close(c);
		return;
	}
	if (c->paused_out && c->out.len < OUT_LOW) {
		/* The client caught up: let every producer of this connection run again. */
		c->paused_out = 0;
		struct stream *st, *nx;
		for (st = c->streams; st; st = nx) {
			nx = st->next;
			switch (st->kind) {
			case ST_EXEC: exec_resume(st); break;
			case ST_SHELL_RUN: shell_resume(st); break;
			case ST_DOWNLOAD: download_pump(st); break;
			case ST_TCP: tcp_resume(st); break;
			}
		}
	}
	buf_trim(&c->out);
	conn_update(c);
}

/* ---------- requests ---------- */

static int token_equal(const char *a, size_t al, const char *b, size_t bl)
{
	/* Constant time in the secret's length: no early exit on the first difference. */
	unsigned char d = (unsigned char)(al != bl);
	for (size_t i = 0; i < bl; i++)
		d |= (unsigned char)(b[i] ^ (i < al ? a[i] : 0));
	return d == 0;
}

static void op_hello(struct conn *c, uint32_t sid, const struct jv *req)
{
	if (g_token) {
		const char *tok = "";
		size_t tl = 0;
		jv_str(req, "token", &tok, &tl);
		if (!token_equal(tok, tl, g_token, g_token_len)) {
			conn_send_err(c, sid, "unauthorized", "bad or missing token", 0);
			return;
		}
		c->authed = 1;
	}
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "version");
	jw_int(&w, PROTO_VERSION);
	jw_key(&w, "agent");
	jw_cstr(&w, AGENT_NAME);
	jw_key(&w, "pid");
	jw_int(&w, getpid());
	jw_key(&w, "uptime_ms");
	jw_int(&w, now_ms() - g_start_ms);
	conn_json_end(c, &w, pos, F_RESP, sid);
}

struct op {
	const char *name;
	void (*fn)(struct conn *, uint32_t, const struct jv *);
};

static const struct op OPS[] = {
	{"exec", op_exec},
	{"shell_run", op_shell_run},
	{"read_file", op_read_file},
	{"write_file", op_write_file},
	{"stat", op_stat},
	{"list_dir", op_list_dir},
	{"mkdir", op_mkdir},
	{"remove", op_remove},
	{"shell_open", op_shell_open},
	{"shell_close", op_shell_close},
	{"hello", op_hello},
	{"sync", op_sync},
	{"ps", op_ps},
	{"tcp_connect", op_tcp_connect},
	{"watch", op_watch},
};

static void handle_req(struct conn *c, uint32_t sid, const uint8_t *p, size_t n)
{
	if (sid == 0) {
		conn_send_err(c, 0, "bad_request", "stream 0 is reserved", 0);
		return;
	}
	if (stream_find(c, sid)) {
		conn_send_err(c, sid, "bad_request", "stream id is already in use", 0);
		return;
	}
	struct jarena a = {0};
	const char *err = NULL;
	struct jv *req = json_parse(&a, (const char *)p, n, &err);
	char msg[256];
	const char *op;
	size_t oplen;
	if (!req) {
		snprintf(msg, sizeof msg, "malformed JSON: %s", err);
		conn_send_err(c, sid, "bad_request", msg, 0);
	} else if (req->type != JV_OBJ || jv_str(req, "op", &op, &oplen) != 1) {
		conn_send_err(c, sid, "bad_request", "a request is a JSON object with a string \"op\"", 0);
	} else if (!c->authed && strcmp(op, "hello") != 0) {
		conn_send_err(c, sid, "unauthorized", "send hello with the token first", 0);
	} else {
		size_t i;
		for (i = 0; i < sizeof OPS / sizeof OPS[0]; i++) {
			if (strcmp(op, OPS[i].name) == 0) {
				OPS[i].fn(c, sid, req);
				break;
			}
		}
		if (i == sizeof OPS / sizeof OPS[0]) {
			snprintf(msg, sizeof msg, "unknown op: %.100s", op);
			conn_send_err(c, sid, "unknown_op", msg, 0);
		}
	}
	jarena_free(&a);
}

static void handle_frame(struct conn *c, int type, uint32_t sid, const uint8_t *p, size_t n)
{
	if (type == F_REQ) {
		handle_req(c, sid, p, n);
		return;
	}
	struct stream *st = stream_find(c, sid);
	if (!st)
		return; /* raced with the stream's end, or never existed: ignored by design */
	switch (type) {
	case F_STDIN:
	case F_STDIN_EOF:
	case F_SIGNAL:
	case F_RESIZE:
		if (st->kind == ST_EXEC)
			exec_frame(st, type, p, n);
		else if (st->kind == ST_SHELL_RUN)
			shell_frame(st, type, p, n);
		else if (st->kind == ST_TCP)
			tcp_frame(st, type, p, n);
		else if (st->kind == ST_WATCH)
			watch_frame(st, type, p, n);
		break;
	case F_DATA:
	case F_DATA_END:
		if (st->kind == ST_UPLOAD)
			upload_frame(st, type, p, n);
		break;
	default:
		break; /* unknown types are ignored: forward compatibility */
	}
}

/* Parse and handle every complete frame in the input buffer (while allowed). */
void conn_process(struct conn *c)
{
	while (conn_can_read(c) && c->in.len >= FRAME_HDR) {
		const uint8_t *d = buf_data(&c->in);
		uint32_t len = get_u32(d);
		if (len < 5 || len > MAX_PAYLOAD + 5) {
			char msg[128];
			snprintf(msg, sizeof msg, "bad frame length %u (5..%u)", len, MAX_PAYLOAD + 5);
			conn_send_err(c, 0, "bad_request", msg, 0);
			c->closing = 1;
			buf_free(&c->in);
			break;
		}
		if (c->in.len < (size_t)len + 4)
			break;
		handle_frame(c, d[4], get_u32(d + 5), d + FRAME_HDR, len - 5);
		if (c->dead)
			return;
		buf_consume(&c->in, (size_t)len + 4);
	}
	buf_trim(&c->in);
	conn_update(c);
}

static void conn_read(struct conn *c)
{
	for (int round = 0; round < 4 && conn_can_read(c); round++) {
		size_t want = 64 * 1024;
		if (c->in.len >= 4) {
			/* Read a large frame in as few syscalls as possible. */
			size_t need = (size_t)get_u32(buf_data(&c->in)) + 4;
			if (need > c->in.len && need - c->in.len > want && need <= MAX_PAYLOAD + FRAME_HDR)
				want = need - c->in.len;
		}
		buf_reserve(&c->in, want);
		ssize_t n = read(c->s.fd, buf_tail(&c->in), want);
		if (n > 0) {
			c->in.len += (size_t)n;
			conn_process(c);
			if (c->dead || (size_t)n < want)
				return;
			continue;
		}
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			return;
		if (n < 0 && errno != ECONNRESET)
			c->broken = 1; /* serial: EIO and the like mean the device itself failed */
		conn_close(c); /* EOF or error: the client is gone */
		return;
	}
}

void conn_on_event(struct conn *c, uint32_t ev)
{
	if (ev & EPOLLOUT)
		conn_flush(c);
	if (c->dead)
		return;
	if (ev & EPOLLIN) {
		conn_read(c);
	} else if (ev & (EPOLLHUP | EPOLLERR | EPOLLRDHUP)) {
		/* Hangup while we are not reading: nothing more can arrive or be delivered. */
		if (!conn_can_read(c) || (ev & (EPOLLHUP | EPOLLERR))) {
			if (ev & EPOLLERR)
				c->broken = 1;
			conn_close(c);
		}
	}
}
