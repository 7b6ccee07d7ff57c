/* Shared core of shoal-agent: event-loop sources, connections, streams and frame output.
 * Everything runs on one thread; nothing here is locked. */
#ifndef SHOAL_AGENT_H
#define SHOAL_AGENT_H

#include <stdint.h>
#include <sys/types.h>

#include "buf.h"
#include "json.h"

#define AGENT_NAME "shoal-agent 0.1.0"
#define PROTO_VERSION 1

enum {
	F_REQ = 0x01,
	F_RESP = 0x02,
	F_ERR = 0x03,
	F_STDOUT = 0x10,
	F_STDERR = 0x11,
	F_STDIN = 0x12,
	F_STDIN_EOF = 0x13,
	F_SIGNAL = 0x14,
	F_RESIZE = 0x15,
	F_DATA = 0x16,
	F_DATA_END = 0x17,
	F_READY = 0x18,
	F_EVENT = 0x19,
};

#define FRAME_HDR 9u                /* u32 length, u8 type, u32 stream */
#define MAX_PAYLOAD (1u << 20)      /* protocol limit on one frame's payload */
#define CHUNK (256u * 1024)         /* largest output/data frame the agent sends */
#define OUT_HIGH (4u << 20)         /* stop reading producers for a connection above this */
#define OUT_LOW (1u << 20)          /* ... and resume them below this */
#define OUT_HARD (16u << 20)        /* stop reading requests from a client that does not read */
#define SINK_HIGH (4u << 20)        /* stdin buffered for a process: stop reading its client */
#define SINK_LOW (1u << 20)

enum src_kind {
	SK_DEAD = 0,
	SK_LISTEN,
	SK_CONN,
	SK_SIGNAL,
	SK_EXEC_OUT,
	SK_EXEC_ERR,
	SK_SINK,
	SK_SHELL_OUT,
	SK_SHELL_ERR,
	SK_SHELL_STATUS,
	SK_TCP,
	SK_WATCH,
};

/* One fd in the epoll set. A paused source is removed from epoll entirely, because
 * EPOLLHUP/EPOLLERR are reported even with an empty event mask (that would spin). */
struct src {
	int fd;
	uint8_t kind;
	uint8_t registered;
	uint32_t events;
	void *owner;
};

void src_init(struct src *s, int fd, int kind, void *owner);
void src_want(struct src *s, uint32_t events);
void src_close(struct src *s);

struct conn;

/* A buffered nonblocking writer into a pipe or PTY (a process's stdin, a shell's fd 3). */
struct sink {
	struct src s;
	struct buf b;
	uint8_t eof_pending;      /* close once the buffer is flushed */
	uint8_t eof_byte;         /* PTY: "EOF" is a ^D, not a close */
	uint8_t shut_wr;          /* a socket: "EOF" is shutdown(SHUT_WR) before the close */
	uint8_t blocking;         /* counted in conn->in_block */
	struct conn *conn;        /* whose input we stop reading while our buffer is too full */
};

void sink_init(struct sink *k, int fd);
void sink_write(struct sink *k, const void *p, size_t n);
void sink_eof(struct sink *k);
void sink_on_writable(struct sink *k);
void sink_close(struct sink *k);
void sink_set_conn(struct sink *k, struct conn *c);

enum stream_kind { ST_EXEC = 1, ST_SHELL_RUN, ST_UPLOAD, ST_DOWNLOAD, ST_TCP, ST_WATCH };

struct stream {
	uint32_t id;
	uint8_t kind;
	struct conn *conn;
	struct stream *next;
	void *obj;
};

struct conn {
	struct src s;
	struct conn *next;
	struct buf in, out;
	uint8_t authed;
	uint8_t closing;       /* protocol error: flush what we have, then close */
	uint8_t is_serial;
	uint8_t paused_out;    /* some producer waits for `out` to drain below OUT_LOW */
	uint8_t dead;
	uint8_t hung;          /* serial: the host hung up; reading resumes after a pause */
	uint8_t broken;        /* serial: the device failed (EIO...): close and reopen it */
	int in_block;          /* sinks over SINK_HIGH: stop reading frames */
	struct stream *streams;
};

/* ---- globals (main.c) ---- */
extern int g_epfd;
extern int64_t g_start_ms;
extern const char *g_token;
extern size_t g_token_len;
extern struct conn *g_conns;

int64_t now_ms(void);
void defer_free(void *p);
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* ---- conn.c ---- */
struct conn *conn_new(int fd, int is_serial);
void conn_on_event(struct conn *c, uint32_t ev);
void conn_flush(struct conn *c);
void conn_close(struct conn *c);
void conn_update(struct conn *c);
int conn_out_full(struct conn *c);            /* above OUT_HIGH: caller pauses and we resume it */
uint8_t *conn_frame_begin(struct conn *c, size_t maxpay);
void conn_frame_commit(struct conn *c, int type, uint32_t sid, size_t paylen);
void conn_send(struct conn *c, int type, uint32_t sid, const void *p, size_t n);
void conn_send_err(struct conn *c, uint32_t sid, const char *code, const char *msg, int err);
void conn_send_errno(struct conn *c, uint32_t sid, const char *what, int err);
void conn_send_empty_resp(struct conn *c, uint32_t sid);
/* JSON frames: begin writes a header placeholder and opens an object; end patches it. */
size_t conn_json_begin(struct conn *c, struct jw *w, int type);
void conn_json_end(struct conn *c, struct jw *w, size_t pos, int type, uint32_t sid);
struct stream *stream_add(struct conn *c, uint32_t id, int kind, void *obj);
void stream_end(struct stream *st);
const char *errno_code(int e);

/* ---- exec.c ---- */
void op_exec(struct conn *c, uint32_t sid, const struct jv *req);
void exec_on_event(struct src *s, uint32_t ev);
int exec_reaped(pid_t pid, int status);
void exec_frame(struct stream *st, int type, const uint8_t *p, size_t n);
void exec_detach(struct stream *st);
void exec_resume(struct stream *st);
int64_t exec_timers(int64_t now);            /* runs due timers, returns next deadline or -1 */
void exec_kill_all(void);

/* ---- shell.c ---- */
void op_shell_open(struct conn *c, uint32_t sid, const struct jv *req);
void op_shell_run(struct conn *c, uint32_t sid, const struct jv *req);
void op_shell_close(struct conn *c, uint32_t sid, const struct jv *req);
void shell_on_event(struct src *s, uint32_t ev);
int shell_reaped(pid_t pid, int status);
void shell_frame(struct stream *st, int type, const uint8_t *p, size_t n);
void shell_detach(struct stream *st);
void shell_resume(struct stream *st);
int64_t shell_timers(int64_t now);
void shell_kill_all(void);

/* ---- files.c ---- */
void op_read_file(struct conn *c, uint32_t sid, const struct jv *req);
void op_write_file(struct conn *c, uint32_t sid, const struct jv *req);
void op_list_dir(struct conn *c, uint32_t sid, const struct jv *req);
void op_stat(struct conn *c, uint32_t sid, const struct jv *req);
void op_mkdir(struct conn *c, uint32_t sid, const struct jv *req);
void op_remove(struct conn *c, uint32_t sid, const struct jv *req);
void op_sync(struct conn *c, uint32_t sid, const struct jv *req);
void op_ps(struct conn *c, uint32_t sid, const struct jv *req);
void upload_frame(struct stream *st, int type, const uint8_t *p, size_t n);
void upload_abort(struct stream *st);
void download_pump(struct stream *st);
void download_abort(struct stream *st);

/* ---- tcp.c ---- */
void op_tcp_connect(struct conn *c, uint32_t sid, const struct jv *req);
void tcp_on_event(struct src *s, uint32_t ev);
void tcp_frame(struct stream *st, int type, const uint8_t *p, size_t n);
void tcp_detach(struct stream *st);
void tcp_resume(struct stream *st);

/* ---- watch.c ---- */
void op_watch(struct conn *c, uint32_t sid, const struct jv *req);
void watch_on_event(struct src *s, uint32_t ev);
void watch_frame(struct stream *st, int type, const uint8_t *p, size_t n);
void watch_detach(struct stream *st);

#endif
