/* shoal-agent: the in-sandbox agent (PID 1). Argument parsing, setup and the event loop. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include "agent.h"
#include "spawn.h"

int64_t g_start_ms;
const char *g_token;
size_t g_token_len;
/* Where output past max_output (or for a departed client) is read to and dropped. */
uint8_t g_scratch[65536];

void run_deferred(void);      /* loop.c */
void conn_process(struct conn *c);

static struct src g_listen = {.fd = -1};
static struct src g_sigsrc = {.fd = -1};
static const char *g_listen_path;
static const char *g_serial_path;
static int64_t g_serial_reopen_at = -1;
static struct conn *g_serial_conn;       /* hung up, waiting for g_serial_resume_at */
static int64_t g_serial_resume_at = -1;
static int g_kicked;
static int64_t g_accept_resume_at = -1;

static void usage(void)
{
	fprintf(stderr,
	        "usage: shoal-agent (--listen-fd N | --listen PATH | --serial DEVICE) [--token-file PATH]\n"
	        "                   [--child-oom-score-adj N]\n"
	        "The in-sandbox agent of shoal; the protocol is described in docs/protocol.md.\n");
}

void conn_kick(struct conn *c)
{
	(void)c;
	g_kicked = 1;
}

/* ---------- serial ---------- */

static void serial_open(void)
{
	int fd = open(g_serial_path, O_RDWR | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		g_serial_reopen_at = now_ms() + 100;
		return;
	}
	if (isatty(fd)) {
		/* A real serial line: raw bytes, no echo, no line discipline. */
		struct termios t;
		if (tcgetattr(fd, &t) == 0) {
			cfmakeraw(&t);
			tcsetattr(fd, TCSANOW, &t);
		}
	}
	g_serial_reopen_at = -1;
	conn_new(fd, 1);
}

void serial_lost(void)
{
	/* The device failed (e.g. the PTY standing in for it lost its master): reopen it later. */
	g_serial_conn = NULL;
	g_serial_resume_at = -1;
	g_serial_reopen_at = now_ms() + 100;
}

void serial_hangup(struct conn *c)
{
	/* The host hung up (virtio-serial keeps reporting POLLHUP until it reconnects): look
	 * again in a while rather than spin on the hangup. */
	g_serial_conn = c;
	g_serial_resume_at = now_ms() + 100;
}

/* ---------- signals ---------- */

static void reap(void)
{
	for (;;) {
		int status;
		pid_t pid = waitpid(-1, &status, WNOHANG);
		if (pid <= 0) {
			if (pid < 0 && errno == EINTR)
				continue;
			break;
		}
		if (!exec_reaped(pid, status))
			shell_reaped(pid, status);
		/* anything else was an orphan: reaping it is all there is to do */
	}
}

static void shutdown_all(void)
{
	if (getpid() == 1) {
		/* PID 1 of a namespace: -1 reaches every other process in it. */
		kill(-1, SIGKILL);
	} else {
		exec_kill_all();
		shell_kill_all();
	}
	if (g_listen_path)
		unlink(g_listen_path);
	exit(0);
}

static void on_signals(void)
{
	struct signalfd_siginfo si[16];
	int chld = 0;
	for (;;) {
		ssize_t n = read(g_sigsrc.fd, si, sizeof si);
		if (n < 0 && errno == EINTR)
			continue;
		if (n <= 0)
			break;
		for (size_t i = 0; i < (size_t)n / sizeof si[0]; i++) {
			switch (si[i].ssi_signo) {
			case SIGCHLD: chld = 1; break;
			case SIGTERM:
			case SIGINT:
				/* As PID 1, only the host may stop the sandbox: a sender outside our PID
				 * namespace shows up as pid 0. Processes in the sandbox are root too. */
				if (getpid() != 1 || si[i].ssi_pid == 0)
					shutdown_all();
				break;
			default: break;
			}
		}
	}
	if (chld)
		reap();
}

/* ---------- timers ---------- */

/* The earlier of two deadlines, where -1 means none. */
static int64_t earliest(int64_t a, int64_t b)
{
	if (a < 0)
		return b;
	if (b < 0)
		return a;
	return a < b ? a : b;
}

/* Deadlines of the loop itself (not of execs and shells) that are due. */
static void misc_timers(int64_t now)
{
	if (g_accept_resume_at >= 0 && now >= g_accept_resume_at) {
		g_accept_resume_at = -1;
		src_want(&g_listen, EPOLLIN);
	}
	if (g_serial_conn && g_serial_resume_at >= 0 && now >= g_serial_resume_at) {
		struct conn *sc = g_serial_conn;
		g_serial_conn = NULL;
		g_serial_resume_at = -1;
		sc->hung = 0;
		conn_update(sc);
	}
	if (g_serial_path && g_serial_reopen_at >= 0 && now >= g_serial_reopen_at)
		serial_open();
}

/* ---------- setup ---------- */

static int read_token(const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	char b[4096];
	size_t n = 0;
	for (;;) {
		ssize_t r = read(fd, b + n, sizeof b - 1 - n);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		n += (size_t)r;
		if (n == sizeof b - 1)
			break;
	}
	close(fd);
	unlink(path); /* nothing in the sandbox may read it later */
	while (n && (b[n - 1] == '\n' || b[n - 1] == '\r' || b[n - 1] == ' '))
		n--;
	if (!n)
		return -1;
	char *t = xmalloc(n + 1);
	memcpy(t, b, n);
	t[n] = 0;
	g_token = t;
	g_token_len = n;
	return 0;
}

static int listen_path(const char *path)
{
	/* Bind under a temporary name and rename once listening: whoever waits for PATH to
	 * appear can connect at once (between bind and listen it would be refused). */
	char tmp[sizeof(((struct sockaddr_un *)0)->sun_path)];
	if (snprintf(tmp, sizeof tmp, "%s.%d", path, (int)getpid()) >= (int)sizeof tmp) {
		errno = ENAMETOOLONG;
		return -1;
	}
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	strcpy(a.sun_path, tmp);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	unlink(tmp);
	if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 512) < 0) {
		int e = errno;
		unlink(tmp);
		close(fd);
		errno = e;
		return -1;
	}
	if (rename(tmp, path) == 0)
		return fd;
	/* gVisor cannot rename a socket its gofer made on the host (EPERM): bind PATH itself; the
	 * host then retries a refused connect until the listen below has happened. */
	int e = errno;
	unlink(tmp);
	close(fd);
	if (e != EPERM && e != EXDEV && e != ENOTSUP) {
		errno = e;
		return -1;
	}
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	strcpy(a.sun_path, path);
	unlink(path);
	if (bind(fd, (struct sockaddr *)&a, sizeof a) < 0 || listen(fd, 512) < 0) {
		e = errno;
		close(fd);
		errno = e;
		return -1;
	}
	return fd;
}

static void on_accept(void)
{
	for (;;) {
		int fd = accept4(g_listen.fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
		if (fd < 0) {
			if (errno == EINTR || errno == ECONNABORTED)
				continue;
			if (errno == EMFILE || errno == ENFILE) {
				/* The pending connection stays readable: pause instead of spinning. */
				logmsg("accept: %s", strerror(errno));
				src_want(&g_listen, 0);
				g_accept_resume_at = now_ms() + 100;
			}
			return;
		}
		conn_new(fd, 0);
	}
}

static void ensure_std_fds(void)
{
	/* Pipes must never land on 0-2; and children inherit nothing from us anyway. */
	for (int fd = 0; fd < 3; fd++) {
		if (fcntl(fd, F_GETFD) < 0) {
			int n = open("/dev/null", O_RDWR);
			if (n >= 0 && n != fd) {
				dup2(n, fd);
				close(n);
			}
		}
	}
}

int main(int argc, char **argv)
{
	int listen_fd = -1;
	const char *token_file = NULL;
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;
		if (strcmp(a, "--listen-fd") == 0 && v) {
			listen_fd = atoi(v);
			i++;
		} else if (strcmp(a, "--listen") == 0 && v) {
			g_listen_path = v;
			i++;
		} else if (strcmp(a, "--serial") == 0 && v) {
			g_serial_path = v;
			i++;
		} else if (strcmp(a, "--token-file") == 0 && v) {
			token_file = v;
			i++;
		} else if (strcmp(a, "--child-oom-score-adj") == 0 && v) {
			/* The node may lower the agent's own score after start (it must survive an OOM in
			 * its sandbox); what the agent runs gets this one instead of inheriting that. */
			if (spawn_set_child_oom_score_adj(v) < 0) {
				usage();
				return 2;
			}
			i++;
		} else if (strcmp(a, "--version") == 0) {
			printf("%s\n", AGENT_NAME);
			return 0;
		} else {
			usage();
			return 2;
		}
	}
	if ((listen_fd >= 0) + (g_listen_path != NULL) + (g_serial_path != NULL) != 1) {
		usage();
		return 2;
	}

	g_start_ms = now_ms();
	ensure_std_fds();
	umask(022);
	/* Processes in the sandbox are root too: keep them out of our memory (the token). */
	prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
	/* Orphans of execs come back to us even when we are not PID 1 (tests), so their
	 * zombies are reaped and their trees stay findable. */
	prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
	signal(SIGPIPE, SIG_IGN);
	/* Fixed thresholds (no dynamic growth): big output buffers are mmap'd and given back to
	 * the kernel when freed, so an agent returns to its small idle footprint after a burst. */
	mallopt(M_MMAP_THRESHOLD, 128 * 1024);
	mallopt(M_TRIM_THRESHOLD, 128 * 1024);

	/* Many concurrent execs need many pipes; children get the original limit back. */
	getrlimit(RLIMIT_NOFILE, &g_orig_nofile);
	struct rlimit rl = g_orig_nofile;
	if (rl.rlim_cur < rl.rlim_max) {
		rl.rlim_cur = rl.rlim_max > 65536 ? 65536 : rl.rlim_max;
		if (rl.rlim_cur > g_orig_nofile.rlim_cur)
			setrlimit(RLIMIT_NOFILE, &rl);
	}

	if (token_file && read_token(token_file) < 0) {
		logmsg("cannot read token file %s", token_file);
		return 1;
	}
	if (!getenv("PATH"))
		setenv("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", 1);

	sigset_t mask;
	sigemptyset(&mask);
	sigaddset(&mask, SIGCHLD);
	sigaddset(&mask, SIGTERM);
	sigaddset(&mask, SIGINT);
	sigaddset(&mask, SIGHUP);
	sigprocmask(SIG_BLOCK, &mask, NULL);
	spawn_init();
	int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
	g_epfd = epoll_create1(EPOLL_CLOEXEC);
	if (sfd < 0 || g_epfd < 0) {
		logmsg("signalfd/epoll: %s", strerror(errno));
		return 1;
	}
	src_init(&g_sigsrc, sfd, SK_SIGNAL, NULL);
	src_want(&g_sigsrc, EPOLLIN);

	if (listen_fd >= 0) {
		fcntl(listen_fd, F_SETFL, fcntl(listen_fd, F_GETFL) | O_NONBLOCK);
		fcntl(listen_fd, F_SETFD, FD_CLOEXEC);
	} else if (g_listen_path) {
		listen_fd = listen_path(g_listen_path);
		if (listen_fd < 0) {
			logmsg("listen %s: %s", g_listen_path, strerror(errno));
			return 1;
		}
	}
	if (listen_fd >= 0) {
		src_init(&g_listen, listen_fd, SK_LISTEN, NULL);
		src_want(&g_listen, EPOLLIN);
	} else {
		serial_open();
	}
	/* Relative paths in our arguments are resolved by now; do not pin any directory. */
	if (chdir("/") < 0) { /* keep whatever cwd we have: nothing depends on it */ }
	/* Children started before we blocked SIGCHLD cannot exist, but orphans may: reap. */
	reap();

	struct epoll_event evs[64];
	int timeout = 0;
	for (;;) {
		int n = epoll_wait(g_epfd, evs, 64, timeout);
		if (n < 0 && errno != EINTR) {
			logmsg("epoll_wait: %s", strerror(errno));
			return 1;
		}
		for (int i = 0; i < n; i++) {
			struct src *s = evs[i].data.ptr;
			uint32_t ev = evs[i].events;
			if (s->fd < 0)
				continue; /* closed by an earlier event of this batch */
			switch (s->kind) {
			case SK_LISTEN: on_accept(); break;
			case SK_SIGNAL: on_signals(); break;
			case SK_CONN: conn_on_event(s->owner, ev); break;
			case SK_EXEC_OUT:
			case SK_EXEC_ERR: exec_on_event(s, ev); break;
			case SK_SHELL_OUT:
			case SK_SHELL_ERR:
			case SK_SHELL_STATUS: shell_on_event(s, ev); break;
			case SK_SINK: sink_on_writable(s->owner); break;
			case SK_TCP: tcp_on_event(s, ev); break;
			case SK_WATCH: watch_on_event(s, ev); break;
			default: break;
			}
		}
		if (g_kicked) {
			g_kicked = 0;
			struct conn *c, *nx;
			for (c = g_conns; c; c = nx) {
				nx = c->next;
				conn_process(c);
			}
		}
		/* Timers run after the events and before the flush, so whatever they answer (an
		 * exec's RESP after its grace period) goes out in this iteration. */
		int64_t now = now_ms();
		int64_t next = earliest(exec_timers(now), shell_timers(now));
		misc_timers(now);
		/* Frames queued above go out now, coalesced per connection. */
		struct conn *c, *nx;
		for (c = g_conns; c; c = nx) {
			nx = c->next;
			if (c->out.len)
				conn_flush(c);
		}
		/* The flush itself may arm a timer (a serial line that hung up): deadlines are
		 * collected only now, or epoll_wait could sleep past them. */
		next = earliest(next, earliest(g_accept_resume_at, earliest(g_serial_resume_at,
		                                                            g_serial_reopen_at)));
		if (g_kicked)
			timeout = 0;
		else if (next < 0)
			timeout = -1;
		else
			timeout = next > now ? (int)(next - now) : 0;
		run_deferred();
	}
}
