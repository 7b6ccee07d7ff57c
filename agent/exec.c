/* The exec operation: one process per stream, its output as frames, its exit as RESP. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "agent.h"
#include "spawn.h"

/* Once the main process has exited, how long we wait for its pipes to reach EOF. Past this,
 * a background process still holds them (`server &`) and the exec ends anyway. */
#define EXIT_GRACE_MS 100

extern uint8_t g_scratch[65536];

struct exec {
	struct exec *next;
	pid_t pid;
	struct src out, err;   /* stdout and stderr pipes; with a tty, out is the PTY master */
	struct sink in;        /* stdin pipe, or a dup of the PTY master */
	struct stream *st;     /* NULL once the client is gone or the exec has answered */
	int64_t start_ms, deadline, grace;
	uint64_t max_output, nout, nerr;
	int status;
	uint8_t exited, tty, timed_out, truncated, finished;
};

static struct exec *g_execs;

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void exec_free(struct exec *e)
{
	for (struct exec **pp = &g_execs; *pp; pp = &(*pp)->next) {
		if (*pp == e) {
			*pp = e->next;
			break;
		}
	}
	src_close(&e->out);
	src_close(&e->err);
	sink_close(&e->in);
	defer_free(e);
}

static void exec_result(struct exec *e, int *code, int *sig)
{
	*sig = 0;
	*code = 0;
	if (WIFEXITED(e->status)) {
		*code = WEXITSTATUS(e->status);
	} else if (WIFSIGNALED(e->status)) {
		*sig = WTERMSIG(e->status);
		*code = 128 + *sig;
	}
}

static void exec_finish(struct exec *e)
{
	e->finished = 1;
	if (e->st) {
		struct conn *c = e->st->conn;
		int code, sig;
		exec_result(e, &code, &sig);
		struct jw w;
		size_t pos = conn_json_begin(c, &w, F_RESP);
		jw_key(&w, "exit_code");
		jw_int(&w, code);
		jw_key(&w, "signal");
		jw_int(&w, sig);
		jw_key(&w, "timed_out");
		jw_bool(&w, e->timed_out);
		jw_key(&w, "truncated");
		jw_bool(&w, e->truncated);
		jw_key(&w, "duration_ms");
		jw_int(&w, now_ms() - e->start_ms);
		jw_key(&w, "pid");
		jw_int(&w, e->pid);
		conn_json_end(c, &w, pos, F_RESP, e->st->id);
		stream_end(e->st);
		e->st = NULL;
	}
	sink_close(&e->in);
	if (e->tty)
		src_close(&e->out); /* hang up the terminal: nothing can read it any more */
	if (e->out.fd < 0 && e->err.fd < 0) {
		exec_free(e);
		return;
	}
	/* Background processes still hold the pipes: drain them to nowhere until EOF. */
	if (e->out.fd >= 0)
		src_want(&e->out, EPOLLIN);
	if (e->err.fd >= 0)
		src_want(&e->err, EPOLLIN);
}

static void exec_check(struct exec *e)
{
	if (e->finished) {
		if (e->out.fd < 0 && e->err.fd < 0)
			exec_free(e);
		return;
	}
	if (e->exited && e->out.fd < 0 && e->err.fd < 0)
		exec_finish(e);
}

/* One read from an output pipe. Returns 1 if bytes came, 0 at EOF (the pipe is closed now),
 * -1 when nothing is available or the client's buffer is full (the pipe is paused). */
static int exec_read(struct exec *e, struct src *s, int type, int ignore_full)
{
	struct conn *c = e->st ? e->st->conn : NULL;
	uint64_t *count = type == F_STDOUT ? &e->nout : &e->nerr;
	int capped = e->max_output && *count >= e->max_output;
	if (c && !capped && !ignore_full && conn_out_full(c)) {
		src_want(s, 0); /* resumed by exec_resume when the client catches up */
		return -1;
	}
	/* Read into scratch, then copy what came: the connection's buffer grows only by real
	 * output (a pipe holds at most 64 KiB by default, so nothing is lost by the size). */
	ssize_t n = read(s->fd, g_scratch, sizeof g_scratch);
	if (n > 0) {
		if (c && !capped) {
			size_t take = (size_t)n;
			if (e->max_output && e->max_output - *count < take) {
				take = (size_t)(e->max_output - *count);
				e->truncated = 1;
			}
			conn_send(c, type, e->st->id, g_scratch, take);
			*count += take;
		} else if (capped) {
			e->truncated = 1;
		}
		return 1;
	}
	if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
		/* EOF; EIO on a PTY master means every slave fd is closed. */
		src_close(s);
		return 0;
	}
	return -1;
}

void exec_on_event(struct src *s, uint32_t ev)
{
	(void)ev;
	struct exec *e = s->owner;
	if (exec_read(e, s, s->kind == SK_EXEC_OUT ? F_STDOUT : F_STDERR, 0) == 0)
		exec_check(e);
}

/* At the end of the grace period: take what the pipes hold right now. Whatever the main
 * process wrote before exiting is in there, even if its readiness event has not been handled
 * yet (with hundreds of busy fds, epoll reports them over several iterations). */
static void exec_drain(struct exec *e)
{
	struct src *srcs[2] = {&e->out, &e->err};
	for (int i = 0; i < 2; i++) {
		size_t rounds = 0;
		while (srcs[i]->fd >= 0 && rounds++ < 64 &&
		       exec_read(e, srcs[i], i == 0 ? F_STDOUT : F_STDERR, 1) == 1) {
		}
	}
}

static struct exec *exec_find(pid_t pid)
{
	for (struct exec *e = g_execs; e; e = e->next)
		if (e->pid == pid && !e->exited)
			return e;
	return NULL;
}

int exec_reaped(pid_t pid, int status)
{
	struct exec *e = exec_find(pid);
	if (!e)
		return 0;
	e->exited = 1;
	e->status = status;
	e->grace = now_ms() + EXIT_GRACE_MS;
	exec_check(e);
	return 1;
}

static void exec_kill_tree(struct exec *e)
{
	struct tree_spec t = {.sid = e->pid, .root = e->pid, .exclude = 0, .min_start = 0};
	tree_kill(&t);
	kill(-e->pid, SIGKILL);
}

int64_t exec_timers(int64_t now)
{
	int64_t next = -1;
	struct exec *e, *nx;
	for (e = g_execs; e; e = nx) {
		nx = e->next;
		if (e->finished)
			continue;
		if (!e->exited && e->deadline && now >= e->deadline) {
			e->timed_out = 1;
			e->deadline = 0;
			exec_kill_tree(e);
		}
		if (e->exited && now >= e->grace) {
			int paused = e->st && ((e->out.fd >= 0 && !e->out.registered) ||
			                       (e->err.fd >= 0 && !e->err.registered));
			if (paused) {
				/* Output is still queued behind a slow client: wait for it. */
				e->grace = now + EXIT_GRACE_MS;
			} else {
				exec_drain(e);
				exec_finish(e);
				continue;
			}
		}
		int64_t d = e->exited ? e->grace : e->deadline;
		if (d > 0 && (next < 0 || d < next))
			next = d;
	}
	return next;
}

void exec_kill_all(void)
{
	for (struct exec *e = g_execs; e; e = e->next)
		if (!e->exited)
			exec_kill_tree(e);
}

void exec_frame(struct stream *st, int type, const uint8_t *p, size_t n)
{
	struct exec *e = st->obj;
	switch (type) {
	case F_STDIN:
		if (!e->in.eof_pending)
			sink_write(&e->in, p, n);
		break;
	case F_STDIN_EOF:
		sink_eof(&e->in);
		break;
	case F_SIGNAL: {
		if (n < 4)
			break;
		uint32_t sig = get_u32(p);
		if (sig < 1 || sig >= NSIG)
			break;
		pid_t pg = e->pid;
		if (e->tty && e->out.fd >= 0) {
			/* The foreground job of the terminal, e.g. what bash -i is running. */
			pid_t fg;
			if (ioctl(e->out.fd, TIOCGPGRP, &fg) == 0 && fg > 0)
				pg = fg;
		}
		kill(-pg, (int)sig);
		break;
	}
	case F_RESIZE:
		if (n >= 4 && e->tty && e->out.fd >= 0) {
			struct winsize ws = {.ws_row = get_u16(p), .ws_col = get_u16(p + 2)};
			ioctl(e->out.fd, TIOCSWINSZ, &ws);
		}
		break;
	}
}

void exec_detach(struct stream *st)
{
	struct exec *e = st->obj;
	e->st = NULL;
	/* Nobody can feed stdin any more; EOF is kinder than a reader blocked forever. */
	sink_close(&e->in);
	if (e->out.fd >= 0)
		src_want(&e->out, EPOLLIN);
	if (e->err.fd >= 0)
		src_want(&e->err, EPOLLIN);
}

void exec_resume(struct stream *st)
{
	struct exec *e = st->obj;
	if (e->out.fd >= 0)
		src_want(&e->out, EPOLLIN);
	if (e->err.fd >= 0)
		src_want(&e->err, EPOLLIN);
}

static int open_pty(int *master, int *slave, int rows, int cols)
{
	int m = posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
	if (m < 0)
		return -1;
	int unlock = 0;
	if (ioctl(m, TIOCSPTLCK, &unlock) < 0)
		goto fail;
	/* TIOCGPTPEER opens the slave without a path lookup in /dev/pts. */
	int s = ioctl(m, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
	if (s < 0) {
		char name[64];
		if (ptsname_r(m, name, sizeof name) != 0)
			goto fail;
		s = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
		if (s < 0)
			goto fail;
	}
	struct winsize ws = {.ws_row = (unsigned short)rows, .ws_col = (unsigned short)cols};
	ioctl(m, TIOCSWINSZ, &ws);
	*master = m;
	*slave = s;
	return 0;
fail: {
	int saved = errno;
	close(m);
	errno = saved;
	return -1;
}
}

static void close_fd(int *fd)
{
	if (*fd >= 0) {
		close(*fd);
		*fd = -1;
	}
}

void op_exec(struct conn *c, uint32_t sid, const struct jv *req)
{
	char msg[512];
	const char *code = "bad_request";
	struct jv *av = jv_get(req, "argv");
	if (!av || av->type != JV_ARR || av->len == 0) {
		conn_send_err(c, sid, "bad_request", "argv must be a non-empty list of strings", 0);
		return;
	}
	for (struct jv *a = av->u.kids; a; a = a->next) {
		if (a->type != JV_STR || memchr(a->u.s, 0, a->len)) {
			conn_send_err(c, sid, "bad_request", "argv must be a non-empty list of strings", 0);
			return;
		}
	}
	int64_t timeout_ms = 0, max_output = 1 << 20, rows = 24, cols = 80;
	int want_stdin = 0, tty = 0, detach = 0;
	if (jv_int(req, "timeout_ms", &timeout_ms) < 0 || jv_int(req, "max_output", &max_output) < 0 ||
	    jv_int(req, "rows", &rows) < 0 || jv_int(req, "cols", &cols) < 0 ||
	    jv_bool(req, "stdin", &want_stdin) < 0 || jv_bool(req, "tty", &tty) < 0 ||
	    jv_bool(req, "detach", &detach) < 0 || timeout_ms < 0 || max_output < 0 || rows < 0 ||
	    cols < 0 || rows > 65535 || cols > 65535) {
		conn_send_err(c, sid, "bad_request", "bad field type or value", 0);
		return;
	}
	struct spawn_opts opts;
	if (spawn_opts_parse(req, &opts, &code, msg, sizeof msg) < 0) {
		conn_send_err(c, sid, code, msg, 0);
		return;
	}
	char **argv = xmalloc(sizeof(char *) * (av->len + 1));
	size_t i = 0;
	for (struct jv *a = av->u.kids; a; a = a->next)
		argv[i++] = a->u.s;
	argv[i] = NULL;

	/* Our ends (p_*) and the child's ends (c_*). */
	int p_out = -1, p_err = -1, p_in = -1, c_out = -1, c_err = -1, c_in = -1, devnull = -1;
	int fds[2];
	int ctty = -1;
	const char *stage = NULL;
	if (detach) {
		devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
		if (devnull < 0)
			stage = "open /dev/null";
		c_in = c_out = c_err = devnull;
	} else if (tty) {
		if (open_pty(&p_out, &c_out, (int)rows, (int)cols) < 0) {
			stage = "openpty";
		} else {
			c_in = c_err = ctty = c_out;
			p_in = fcntl(p_out, F_DUPFD_CLOEXEC, 3);
			if (p_in < 0)
				stage = "dup";
		}
	} else {
		if (pipe2(fds, O_CLOEXEC) < 0) {
			stage = "pipe";
		} else {
			p_out = fds[0];
			c_out = fds[1];
			if (pipe2(fds, O_CLOEXEC) < 0) {
				stage = "pipe";
			} else {
				p_err = fds[0];
				c_err = fds[1];
				if (want_stdin) {
					if (pipe2(fds, O_CLOEXEC) < 0) {
						stage = "pipe";
					} else {
						c_in = fds[0];
						p_in = fds[1];
					}
				} else {
					devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
					if (devnull < 0)
						stage = "open /dev/null";
					c_in = devnull;
				}
			}
		}
	}
	pid_t pid = -1;
	struct spawn_req r = {.argv = argv, .opts = &opts, .nfds = 3, .ctty = ctty};
	if (!stage) {
		r.fds[0] = c_in;
		r.fds[1] = c_out;
		r.fds[2] = c_err;
		pid = spawn_process(&r);
	}
	int saved = errno;
	/* The child's ends belong to the child now. */
	if (tty) {
		close_fd(&c_out);
	} else {
		close_fd(&c_out);
		close_fd(&c_err);
		if (c_in != devnull)
			close_fd(&c_in);
	}
	close_fd(&devnull);
	free(argv);
	if (stage || pid < 0) {
		close_fd(&p_out);
		close_fd(&p_err);
		close_fd(&p_in);
		if (stage) {
			snprintf(msg, sizeof msg, "%s: %s", stage, strerror(saved));
			conn_send_err(c, sid, "spawn_failed", msg, saved);
		} else {
			spawn_error(&r, &code, msg, sizeof msg);
			conn_send_err(c, sid, code, msg, r.err_no);
		}
		spawn_opts_free(&opts);
		return;
	}
	spawn_opts_free(&opts);

	struct exec *e = xmalloc(sizeof *e);
	memset(e, 0, sizeof *e);
	e->pid = pid;
	e->start_ms = now_ms();
	e->deadline = timeout_ms ? e->start_ms + timeout_ms : 0;
	e->max_output = (uint64_t)max_output;
	e->tty = (uint8_t)tty;
	src_init(&e->out, -1, SK_EXEC_OUT, e);
	src_init(&e->err, -1, SK_EXEC_ERR, e);
	sink_init(&e->in, -1);
	e->next = g_execs;
	g_execs = e;
	if (detach) {
		/* Tracked only for its timeout and for shutdown; it answers right away. */
		e->finished = 0;
		struct jw w;
		size_t pos = conn_json_begin(c, &w, F_RESP);
		jw_key(&w, "pid");
		jw_int(&w, pid);
		conn_json_end(c, &w, pos, F_RESP, sid);
		return;
	}
	if (!tty)
		set_nonblock(p_out), set_nonblock(p_err);
	if (p_in >= 0 && !tty)
		set_nonblock(p_in);
	e->out.fd = p_out;
	e->err.fd = p_err;
	src_want(&e->out, EPOLLIN);
	if (p_err >= 0)
		src_want(&e->err, EPOLLIN);
	if (p_in >= 0) {
		sink_init(&e->in, p_in);
		e->in.eof_byte = tty ? 4 : 0; /* ^D: the terminal's VEOF */
	}
	e->st = stream_add(c, sid, ST_EXEC, e);
	sink_set_conn(&e->in, c);
}
