/* Persistent bash shells.
 *
 * fd 3 of bash holds the command text: a memfd (a regular file, so bash's `read` takes it
 * in 4 KiB blocks instead of one syscall per byte as on a pipe), or a pipe as a fallback.
 * fd 4 is a private socket: the agent sends "NONCE\0" to start a command, bash answers
 * "NONCE STATUS\n". Both fds are closed while the command runs and the nonce is random per
 * command, so nothing a command prints, on any fd, can end it early or fake its status. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/random.h>
#include <sys/wait.h>
#include <unistd.h>

#include "agent.h"
#include "spawn.h"

extern uint8_t g_scratch[65536];

/* After SIGINT, how long the command gets before SIGKILL; after that, before bash itself is
 * killed (a busy loop inside bash has no child process to signal). */
#define INT_GRACE_MS 1000
#define KILL_GRACE_MS 1000
/* Output still in the pipes when the status arrives is read before answering; bounded so a
 * background writer cannot hold the answer forever. */
#define FINAL_DRAIN_MAX (8u << 20)

static const char BOOTSTRAP[] =
	"shopt -s expand_aliases\n"
	"while IFS= builtin read -r -d '' -u 4 __shoal_nonce && "
	"IFS= builtin read -r -d '' -u 3 __shoal_cmd; do\n"
	"  builtin eval \"$__shoal_cmd\" 3<&- 4>&-\n"
	"  builtin printf '%s %d\\n' \"$__shoal_nonce\" \"$?\" >&4\n"
	"done\n";

struct shell {
	struct shell *next;
	char id[16];
	pid_t pid;
	struct src out, err, status;   /* status: our end of bash's fd 4 socket */
	struct sink bell;              /* a dup of the status socket, for writing nonces */
	struct sink cmdpipe;           /* fallback when memfd_create is unavailable */
	int memfd;                     /* the command text, shared with bash's fd 3 */
	uint8_t dead;        /* bash exited: unknown to lookups, freed once its pipes close */
	uint8_t closed;      /* shell_close: unknown to lookups */
	/* the running command */
	uint8_t running, timed_out, truncated, phase;
	struct stream *st;
	char nonce[33];
	int64_t start_ms, deadline, phase_at;
	unsigned long long start_tick;
	uint64_t max_output, nout, nerr;
	char sbuf[256];
	size_t slen;
};

static struct shell *g_shells;
static unsigned g_shell_seq;

static struct shell *shell_find(const char *id)
{
	for (struct shell *s = g_shells; s; s = s->next)
		if (!s->dead && !s->closed && strcmp(s->id, id) == 0)
			return s;
	return NULL;
}

static void shell_maybe_free(struct shell *sh)
{
	if (!sh->dead || sh->running || sh->out.fd >= 0 || sh->err.fd >= 0)
		return;
	for (struct shell **pp = &g_shells; *pp; pp = &(*pp)->next) {
		if (*pp == sh) {
			*pp = sh->next;
			break;
		}
	}
	src_close(&sh->status);
	sink_close(&sh->bell);
	sink_close(&sh->cmdpipe);
	if (sh->memfd >= 0)
		close(sh->memfd);
	defer_free(sh);
}

/* One read from an output pipe. Returns bytes read, 0 at EOF (pipe closed), -1 if nothing. */
static ssize_t shell_read(struct shell *sh, struct src *s, int type, int ignore_full)
{
	struct conn *c = sh->running && sh->st ? sh->st->conn : NULL;
	uint64_t *count = type == F_STDOUT ? &sh->nout : &sh->nerr;
	int capped = sh->max_output && *count >= sh->max_output;
	if (c && !capped && !ignore_full && conn_out_full(c)) {
		src_want(s, 0);
		return -1;
	}
	ssize_t n = read(s->fd, g_scratch, sizeof g_scratch);
	if (n > 0) {
		if (c && !capped) {
			size_t take = (size_t)n;
			if (sh->max_output && sh->max_output - *count < take) {
				take = (size_t)(sh->max_output - *count);
				sh->truncated = 1;
			}
			conn_send(c, type, sh->st->id, g_scratch, take);
			*count += take;
		} else if (capped && sh->running) {
			sh->truncated = 1;
		}
		return n;
	}
	if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
		src_close(s);
		return 0;
	}
	return -1;
}

static void shell_drain(struct shell *sh, struct src *s, int type)
{
	size_t total = 0;
	while (s->fd >= 0 && total < FINAL_DRAIN_MAX) {
		ssize_t n = shell_read(sh, s, type, 1);
		if (n <= 0)
			break;
		total += (size_t)n;
	}
}

static void shell_finish(struct shell *sh, int code, int alive)
{
	shell_drain(sh, &sh->out, F_STDOUT);
	shell_drain(sh, &sh->err, F_STDERR);
	if (sh->st) {
		struct conn *c = sh->st->conn;
		struct jw w;
		size_t pos = conn_json_begin(c, &w, F_RESP);
		jw_key(&w, "exit_code");
		jw_int(&w, code);
		jw_key(&w, "timed_out");
		jw_bool(&w, sh->timed_out);
		jw_key(&w, "truncated");
		jw_bool(&w, sh->truncated);
		jw_key(&w, "duration_ms");
		jw_int(&w, now_ms() - sh->start_ms);
		jw_key(&w, "alive");
		jw_bool(&w, alive);
		conn_json_end(c, &w, pos, F_RESP, sh->st->id);
		stream_end(sh->st);
		sh->st = NULL;
	}
	sh->running = 0;
	sh->deadline = 0;
	sh->phase = 0;
	sh->slen = 0;
	if (sh->memfd >= 0 && ftruncate(sh->memfd, 0) < 0) { /* only memory is at stake */ }
	/* Between commands, background output is read and dropped. */
	if (sh->out.fd >= 0)
		src_want(&sh->out, EPOLLIN);
	if (sh->err.fd >= 0)
		src_want(&sh->err, EPOLLIN);
	shell_maybe_free(sh);
}

static void shell_on_status(struct shell *sh)
{
	for (;;) {
		if (sh->slen == sizeof sh->sbuf) {
			/* Only a forged record could get this long; keep the tail. */
			memmove(sh->sbuf, sh->sbuf + 128, sh->slen - 128);
			sh->slen -= 128;
		}
		ssize_t n = read(sh->status.fd, sh->sbuf + sh->slen, sizeof sh->sbuf - sh->slen);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && errno == EAGAIN)
			break;
		if (n <= 0) {
			/* bash is gone (or exec'd something else): the reaper finishes the run. */
			src_close(&sh->status);
			return;
		}
		sh->slen += (size_t)n;
	}
	if (!sh->running)
		return;
	char *hit = memmem(sh->sbuf, sh->slen, sh->nonce, 32);
	if (!hit)
		return;
	char *p = hit + 32;
	char *end = sh->sbuf + sh->slen;
	if (p >= end || *p != ' ')
		return;
	p++;
	int code = 0, digits = 0;
	while (p < end && *p >= '0' && *p <= '9' && digits < 4) {
		code = code * 10 + (*p - '0');
		p++;
		digits++;
	}
	if (p >= end || *p != '\n' || !digits)
		return;
	shell_finish(sh, code, 1);
}

void shell_on_event(struct src *s, uint32_t ev)
{
	(void)ev;
	struct shell *sh = s->owner;
	if (s->kind == SK_SHELL_STATUS) {
		shell_on_status(sh);
		return;
	}
	if (shell_read(sh, s, s->kind == SK_SHELL_OUT ? F_STDOUT : F_STDERR, 0) == 0)
		shell_maybe_free(sh);
}

int shell_reaped(pid_t pid, int status)
{
	struct shell *sh;
	for (sh = g_shells; sh; sh = sh->next)
		if (sh->pid == pid && !sh->dead)
			break;
	if (!sh)
		return 0;
	sh->dead = 1;
	src_close(&sh->status);
	sink_close(&sh->bell);
	sink_close(&sh->cmdpipe);
	int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
	if (sh->running)
		shell_finish(sh, code, 0);
	else
		shell_maybe_free(sh);
	return 1;
}

static struct tree_spec command_tree(struct shell *sh)
{
	/* The command's processes: bash's descendants and session members started since the
	 * command began. Older background jobs (`server &` of an earlier run) are left alone. */
	struct tree_spec t = {.sid = sh->pid, .root = sh->pid, .exclude = sh->pid,
	                      .min_start = sh->start_tick};
	return t;
}

int64_t shell_timers(int64_t now)
{
	int64_t next = -1;
	struct shell *sh, *nx;
	for (sh = g_shells; sh; sh = nx) {
		nx = sh->next;
		if (!sh->running || sh->dead)
			continue;
		if (sh->phase == 0 && sh->deadline && now >= sh->deadline) {
			sh->timed_out = 1;
			struct tree_spec t = command_tree(sh);
			int n = tree_signal(&t, SIGINT);
			/* No process to interrupt: the loop runs inside bash; go straight on. */
			sh->phase = n ? 1 : 2;
			sh->phase_at = now + (n ? INT_GRACE_MS : KILL_GRACE_MS);
		} else if (sh->phase == 1 && now >= sh->phase_at) {
			struct tree_spec t = command_tree(sh);
			tree_kill(&t);
			sh->phase = 2;
			sh->phase_at = now + KILL_GRACE_MS;
		} else if (sh->phase == 2 && now >= sh->phase_at) {
			kill(sh->pid, SIGKILL);
			sh->phase = 3;
		}
		int64_t d = sh->phase == 0 ? sh->deadline : sh->phase < 3 ? sh->phase_at : 0;
		if (d > 0 && (next < 0 || d < next))
			next = d;
	}
	return next;
}

static void shell_kill(struct shell *sh)
{
	struct tree_spec t = {.sid = sh->pid, .root = sh->pid, .exclude = 0, .min_start = 0};
	tree_kill(&t);
	kill(sh->pid, SIGKILL);
}

void shell_kill_all(void)
{
	for (struct shell *sh = g_shells; sh; sh = sh->next)
		if (!sh->dead)
			shell_kill(sh);
}

void shell_frame(struct stream *st, int type, const uint8_t *p, size_t n)
{
	struct shell *sh = st->obj;
	if (type != F_SIGNAL || n < 4 || !sh->running || sh->dead)
		return;
	uint32_t sig = get_u32(p);
	if (sig < 1 || sig >= NSIG)
		return;
	struct tree_spec t = command_tree(sh);
	tree_signal(&t, (int)sig);
}

void shell_detach(struct stream *st)
{
	struct shell *sh = st->obj;
	/* The command runs on; its output and answer go nowhere. */
	sh->st = NULL;
	shell_resume(st);
}

void shell_resume(struct stream *st)
{
	struct shell *sh = st->obj;
	if (sh->out.fd >= 0)
		src_want(&sh->out, EPOLLIN);
	if (sh->err.fd >= 0)
		src_want(&sh->err, EPOLLIN);
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static int pwrite_all(int fd, const void *p, size_t n, off_t off)
{
	const char *b = p;
	while (n) {
		ssize_t w = pwrite(fd, b, n, off);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return -1;
		b += w;
		n -= (size_t)w;
		off += w;
	}
	return 0;
}

void op_shell_open(struct conn *c, uint32_t sid, const struct jv *req)
{
	char msg[512];
	const char *code;
	struct spawn_opts opts;
	if (spawn_opts_parse(req, &opts, &code, msg, sizeof msg) < 0) {
		conn_send_err(c, sid, code, msg, 0);
		return;
	}
	/* out and err pipes (p[k][0] ours), the command file, the control socket (sp[0] ours). */
	int p[2][2] = {{-1, -1}, {-1, -1}}, sp[2] = {-1, -1}, cmdp[2] = {-1, -1};
	int devnull = open("/dev/null", O_RDONLY | O_CLOEXEC);
	/* SHOAL_AGENT_NO_MEMFD: tests exercise the pipe fallback (kernels without memfd). */
	int memfd = getenv("SHOAL_AGENT_NO_MEMFD") ? -1 : memfd_create("shoal-shell-cmd", MFD_CLOEXEC);
	int ok = devnull >= 0 && pipe2(p[0], O_CLOEXEC) == 0 && pipe2(p[1], O_CLOEXEC) == 0 &&
	         socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) == 0 &&
	         (memfd >= 0 || pipe2(cmdp, O_CLOEXEC) == 0);
	int bell = ok ? fcntl(sp[0], F_DUPFD_CLOEXEC, 3) : -1;
	if (!ok || bell < 0) {
		int saved = errno;
		int all[] = {devnull, memfd, p[0][0], p[0][1], p[1][0], p[1][1], sp[0], sp[1], cmdp[0], cmdp[1]};
		for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
			if (all[i] >= 0)
				close(all[i]);
		spawn_opts_free(&opts);
		snprintf(msg, sizeof msg, "pipe: %s", strerror(saved));
		conn_send_err(c, sid, "spawn_failed", msg, saved);
		return;
	}
	char *argv[] = {"bash", "--noprofile", "--norc", "-c", (char *)BOOTSTRAP, "shoal-shell", NULL};
	struct spawn_req r = {.argv = argv, .opts = &opts, .nfds = 5, .ctty = -1,
	                      .fds = {devnull, p[0][1], p[1][1], memfd >= 0 ? memfd : cmdp[0], sp[1]}};
	pid_t pid = spawn_process(&r);
	close(devnull);
	close(p[0][1]);
	close(p[1][1]);
	close(sp[1]);
	if (cmdp[0] >= 0)
		close(cmdp[0]);
	if (pid < 0) {
		int ours[] = {memfd, p[0][0], p[1][0], sp[0], bell, cmdp[1]};
		for (size_t i = 0; i < sizeof ours / sizeof ours[0]; i++)
			if (ours[i] >= 0)
				close(ours[i]);
		spawn_error(&r, &code, msg, sizeof msg);
		conn_send_err(c, sid, code, msg, r.err_no);
		spawn_opts_free(&opts);
		return;
	}
	spawn_opts_free(&opts);
	struct shell *sh = xmalloc(sizeof *sh);
	memset(sh, 0, sizeof *sh);
	snprintf(sh->id, sizeof sh->id, "s%u", ++g_shell_seq);
	sh->pid = pid;
	sh->memfd = memfd;
	int nb[] = {p[0][0], p[1][0], sp[0], bell, cmdp[1]};
	for (size_t i = 0; i < sizeof nb / sizeof nb[0]; i++)
		if (nb[i] >= 0)
			set_nonblock(nb[i]);
	src_init(&sh->out, p[0][0], SK_SHELL_OUT, sh);
	src_init(&sh->err, p[1][0], SK_SHELL_ERR, sh);
	src_init(&sh->status, sp[0], SK_SHELL_STATUS, sh);
	sink_init(&sh->bell, bell);
	sink_init(&sh->cmdpipe, cmdp[1]);
	src_want(&sh->out, EPOLLIN);
	src_want(&sh->err, EPOLLIN);
	src_want(&sh->status, EPOLLIN);
	sh->next = g_shells;
	g_shells = sh;

	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "shell");
	jw_cstr(&w, sh->id);
	jw_key(&w, "pid");
	jw_int(&w, pid);
	conn_json_end(c, &w, pos, F_RESP, sid);
}

static struct shell *lookup_req(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *id;
	if (jv_str(req, "shell", &id, NULL) != 1) {
		conn_send_err(c, sid, "bad_request", "shell must be a string", 0);
		return NULL;
	}
	struct shell *sh = shell_find(id);
	if (!sh) {
		char msg[128];
		snprintf(msg, sizeof msg, "no such shell: %.60s (it exited or was closed)", id);
		conn_send_err(c, sid, "no_such_shell", msg, 0);
	}
	return sh;
}

void op_shell_run(struct conn *c, uint32_t sid, const struct jv *req)
{
	struct shell *sh = lookup_req(c, sid, req);
	if (!sh)
		return;
	const char *cmd;
	size_t cmdlen;
	int64_t timeout_ms = 0, max_output = 1 << 20;
	if (jv_str(req, "cmd", &cmd, &cmdlen) != 1 || memchr(cmd, 0, cmdlen) ||
	    jv_int(req, "timeout_ms", &timeout_ms) < 0 || jv_int(req, "max_output", &max_output) < 0 ||
	    timeout_ms < 0 || max_output < 0) {
		conn_send_err(c, sid, "bad_request", "cmd must be a string without NUL bytes", 0);
		return;
	}
	if (sh->running) {
		conn_send_err(c, sid, "shell_busy", "the shell is busy with another command", 0);
		return;
	}
	uint8_t rnd[16];
	if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
		/* Never expected; still unpredictable enough to avoid accidental matches. */
		for (size_t i = 0; i < sizeof rnd; i++)
			rnd[i] = (uint8_t)(now_ms() >> (i % 8) ^ (uint64_t)rand());
	}
	static const char hex[] = "0123456789abcdef";
	for (int i = 0; i < 16; i++) {
		sh->nonce[2 * i] = hex[rnd[i] >> 4];
		sh->nonce[2 * i + 1] = hex[rnd[i] & 15];
	}
	sh->nonce[32] = 0;
	sh->running = 1;
	sh->timed_out = sh->truncated = 0;
	sh->phase = 0;
	sh->slen = 0;
	sh->nout = sh->nerr = 0;
	sh->max_output = (uint64_t)max_output;
	sh->start_ms = now_ms();
	sh->start_tick = boot_ticks();
	sh->deadline = timeout_ms ? sh->start_ms + timeout_ms : 0;
	if (sh->memfd >= 0) {
		/* bash is idle, blocked on fd 4: rewinding the shared offset is safe. */
		if (ftruncate(sh->memfd, 0) < 0 || pwrite_all(sh->memfd, cmd, cmdlen, 0) < 0 ||
		    pwrite_all(sh->memfd, "", 1, (off_t)cmdlen) < 0 || lseek(sh->memfd, 0, SEEK_SET) < 0) {
			int saved = errno;
			sh->running = 0;
			conn_send_errno(c, sid, "writing the command", saved);
			return;
		}
	} else {
		sink_write(&sh->cmdpipe, cmd, cmdlen);
		sink_write(&sh->cmdpipe, "", 1);
	}
	sh->st = stream_add(c, sid, ST_SHELL_RUN, sh);
	sink_write(&sh->bell, sh->nonce, 33); /* includes the NUL */
}

void op_shell_close(struct conn *c, uint32_t sid, const struct jv *req)
{
	struct shell *sh = lookup_req(c, sid, req);
	if (!sh)
		return;
	sh->closed = 1;
	shell_kill(sh); /* the reaper finishes a running command with alive:false */
	conn_send_empty_resp(c, sid);
}
