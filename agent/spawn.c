#define _GNU_SOURCE
#include "spawn.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "agent.h"

extern char **environ;

struct rlimit g_orig_nofile;
static char g_child_oom[8];
static size_t g_child_oom_len;

int spawn_set_child_oom_score_adj(const char *v)
{
	char *end;
	errno = 0;
	long n = strtol(v, &end, 10);
	if (errno || *end || end == v || n < -1000 || n > 1000)
		return -1;
	g_child_oom_len = (size_t)snprintf(g_child_oom, sizeof g_child_oom, "%ld", n);
	return 0;
}
/* Signals whose disposition is not SIG_DFL in the agent (SIGPIPE, anything inherited as
 * ignored): the only ones a child has to reset, instead of 64 syscalls per spawn. */
static unsigned char g_sig_nondefault[NSIG];

/* The kernel's own struct sigaction. glibc's sigaction() refuses the two signals it keeps
 * for itself (32 and 33), yet a parent can hand them down ignored (some CI runners do), and
 * an ignored disposition survives execve; so both the query and the reset go to the kernel. */
struct kernel_sigaction {
	void (*handler)(int);
	unsigned long flags;
	void (*restorer)(void);
	unsigned long mask;
};

static int raw_sigaction(int sig, const struct kernel_sigaction *act, struct kernel_sigaction *old)
{
	return (int)syscall(SYS_rt_sigaction, sig, act, old, sizeof(unsigned long));
}

void spawn_init(void)
{
	for (int s = 1; s < NSIG; s++) {
		struct kernel_sigaction old;
		if (s == SIGKILL || s == SIGSTOP)
			continue;
		if (raw_sigaction(s, NULL, &old) < 0)
			continue;
		g_sig_nondefault[s] = old.handler != SIG_DFL || (old.flags & SA_SIGINFO);
	}
}

static const char DEFAULT_PATH[] = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/* ---------- options ---------- */

static int env_find(char **v, int n, const char *key, size_t klen)
{
	for (int i = 0; i < n; i++)
		if (strncmp(v[i], key, klen) == 0 && v[i][klen] == '=')
			return i;
	return -1;
}

static void env_set(char ***v, int *n, int *cap, const char *key, size_t klen, const char *val,
                    size_t vlen, int override)
{
	int i = env_find(*v, *n, key, klen);
	if (i >= 0 && !override)
		return;
	char *s = xmalloc(klen + vlen + 2);
	memcpy(s, key, klen);
	s[klen] = '=';
	memcpy(s + klen + 1, val, vlen);
	s[klen + vlen + 1] = 0;
	if (i >= 0) {
		free((*v)[i]);
		(*v)[i] = s;
		return;
	}
	if (*n + 2 > *cap) {
		*cap = *cap ? *cap * 2 : 32;
		*v = xrealloc(*v, sizeof(char *) * (size_t)*cap);
	}
	(*v)[(*n)++] = s;
	(*v)[*n] = NULL;
}

int spawn_opts_parse(const struct jv *req, struct spawn_opts *o, const char **code, char *msg,
                     size_t msglen)
{
	memset(o, 0, sizeof *o);
	*code = "bad_request";
	const char *cwd = "/";
	size_t cwdlen = 1;
	if (jv_str(req, "cwd", &cwd, &cwdlen) < 0 || memchr(cwd, 0, cwdlen) || cwd[0] != '/') {
		snprintf(msg, msglen, "cwd must be an absolute path");
		return -1;
	}
	const char *user;
	size_t ulen;
	int r = jv_str(req, "user", &user, &ulen);
	if (r < 0 || (r > 0 && memchr(user, 0, ulen))) {
		snprintf(msg, msglen, "user must be a string");
		return -1;
	}
	if (r > 0 && ulen > 0) {
		if (user_lookup(user, &o->user) < 0) {
			*code = "no_such_user";
			snprintf(msg, msglen, "no such user in the sandbox's /etc/passwd: %.100s", user);
			return -1;
		}
		o->has_user = 1;
	}
	struct jv *env = jv_get(req, "env");
	if (env && env->type != JV_OBJ && env->type != JV_NULL) {
		snprintf(msg, msglen, "env must be an object of strings");
		return -1;
	}
	struct stat st;
	if (stat(cwd, &st) < 0) {
		*code = errno_code(errno);
		snprintf(msg, msglen, "cwd %.200s: %s", cwd, strerror(errno));
		return -1;
	}
	if (!S_ISDIR(st.st_mode)) {
		*code = "not_a_directory";
		snprintf(msg, msglen, "cwd %.200s: Not a directory", cwd);
		return -1;
	}

	int n = 0, cap = 0;
	char **v = NULL;
	for (char **e = environ; e && *e; e++) {
		const char *eq = strchr(*e, '=');
		if (!eq)
			continue;
		env_set(&v, &n, &cap, *e, (size_t)(eq - *e), eq + 1, strlen(eq + 1), 1);
	}
	if (env && env->type == JV_OBJ) {
		for (struct jv *k = env->u.kids; k; k = k->next) {
			size_t klen = strlen(k->key);
			if (k->type != JV_STR || klen == 0 || memchr(k->key, '=', klen) ||
			    memchr(k->u.s, 0, k->len)) {
				snprintf(msg, msglen, "env: bad entry %.100s", k->key);
				for (int i = 0; i < n; i++)
					free(v[i]);
				free(v);
				return -1;
			}
			env_set(&v, &n, &cap, k->key, klen, k->u.s, k->len, 1);
		}
	}
	if (o->has_user && o->user.have_pw) {
		/* A login-like environment for the target user, unless the request set it. */
		const struct user_info *u = &o->user;
		int req_env = env && env->type == JV_OBJ;
		env_set(&v, &n, &cap, "HOME", 4, u->home, strlen(u->home), !(req_env && jv_get(env, "HOME")));
		env_set(&v, &n, &cap, "USER", 4, u->name, strlen(u->name), !(req_env && jv_get(env, "USER")));
		env_set(&v, &n, &cap, "LOGNAME", 7, u->name, strlen(u->name),
		        !(req_env && jv_get(env, "LOGNAME")));
	}
	if (env_find(v, n, "PATH", 4) < 0)
		env_set(&v, &n, &cap, "PATH", 4, DEFAULT_PATH, sizeof DEFAULT_PATH - 1, 1);
	if (!v) {
		v = xmalloc(sizeof(char *));
		v[0] = NULL;
	}
	o->envp = v;
	o->path = v[env_find(v, n, "PATH", 4)] + 5;
	o->cwd = xmalloc(cwdlen + 1);
	memcpy(o->cwd, cwd, cwdlen + 1);
	return 0;
}

void spawn_opts_free(struct spawn_opts *o)
{
	if (o->envp) {
		for (char **e = o->envp; *e; e++)
			free(*e);
		free(o->envp);
	}
	free(o->cwd);
	memset(o, 0, sizeof *o);
}

/* ---------- spawn ---------- */

/* The child runs on this stack while the parent is suspended (CLONE_VFORK), so one is enough. */
static char child_stack[64 * 1024] __attribute__((aligned(16)));

struct child_ctx {
	struct spawn_req *r;
	char **sh_argv;       /* room for the ENOEXEC fallback, prepared by the parent */
};

/* Everything below runs in the child, which shares our memory: only raw syscalls and pure
 * functions, no malloc, no stdio, no locks. Failures are reported through r->err_*. */
__attribute__((noreturn)) static void child_fail(struct spawn_req *r, const char *stage)
{
	r->err_no = errno;
	r->err_stage = stage;
	_exit(127);
}

static void try_exec(struct child_ctx *cx, const char *path)
{
	struct spawn_req *r = cx->r;
	execve(path, r->argv, r->opts->envp);
	if (errno == ENOEXEC) {
		/* Like execvp: a file without a #! line is a shell script. */
		int i = 0;
		cx->sh_argv[i++] = (char *)"/bin/sh";
		cx->sh_argv[i++] = (char *)path;
		for (char **a = r->argv + 1; *a; a++)
			cx->sh_argv[i++] = *a;
		cx->sh_argv[i] = NULL;
		execve("/bin/sh", cx->sh_argv, r->opts->envp);
		errno = ENOEXEC;
	}
}

static int child_main(void *arg)
{
	struct child_ctx *cx = arg;
	struct spawn_req *r = cx->r;
	const struct spawn_opts *o = r->opts;

	/* The agent ignores SIGPIPE and blocks the signals it reads through signalfd; a child
	 * must start from defaults. (No CLONE_SIGHAND: these changes are the child's alone.) */
	struct kernel_sigaction sa;
	memset(&sa, 0, sizeof sa);
	sa.handler = SIG_DFL;
	for (int s = 1; s < NSIG; s++)
		if (g_sig_nondefault[s])
			raw_sigaction(s, &sa, NULL);
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);

	if (setsid() < 0)
		child_fail(r, "setsid");
	if (r->ctty >= 0 && ioctl(r->ctty, TIOCSCTTY, 0) < 0)
		child_fail(r, "TIOCSCTTY");

	/* First move every source above the target range so dup2 cannot clobber one that
	 * still has to be copied; the copies are close-on-exec. */
	int hi[5];
	for (int i = 0; i < r->nfds; i++) {
		hi[i] = fcntl(r->fds[i], F_DUPFD_CLOEXEC, 10);
		if (hi[i] < 0)
			child_fail(r, "dup");
	}
	for (int i = 0; i < r->nfds; i++)
		if (dup2(hi[i], i) < 0)
			child_fail(r, "dup2");
	/* Everything else is O_CLOEXEC already; this also catches anything that is not. */
	syscall(SYS_close_range, (unsigned)r->nfds, ~0u, 0u);

	setrlimit(RLIMIT_NOFILE, &g_orig_nofile);

	if (g_child_oom_len) {
		/* Raising a score needs no privilege; a failure (no /proc) leaves the inherited one. */
		int fd = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
		if (fd >= 0) {
			ssize_t w = write(fd, g_child_oom, g_child_oom_len);
			(void)w;
			close(fd);
		}
	}

	if (o->has_user) {
		const struct user_info *u = &o->user;
		if (syscall(SYS_setgroups, (size_t)u->ngroups, u->groups) < 0 && errno != EPERM)
			child_fail(r, "setgroups");
		if (syscall(SYS_setresgid, u->gid, u->gid, u->gid) < 0)
			child_fail(r, "setgid");
		if (syscall(SYS_setresuid, u->uid, u->uid, u->uid) < 0)
			child_fail(r, "setuid");
	}
	if (chdir(o->cwd) < 0)
		child_fail(r, "chdir");

	const char *file = r->argv[0];
	if (strchr(file, '/')) {
		try_exec(cx, file);
		child_fail(r, "execvp");
	}
	size_t flen = strlen(file);
	char path[PATH_MAX];
	int saw_eacces = 0;
	const char *p = o->path;
	for (;;) {
		const char *e = strchrnul(p, ':');
		size_t dl = (size_t)(e - p);
		if (dl + flen + 2 <= sizeof path) {
			size_t k = 0;
			if (dl) {
				memcpy(path, p, dl);
				path[dl] = '/';
				k = dl + 1;
			}
			memcpy(path + k, file, flen + 1);
			try_exec(cx, path);
			switch (errno) {
			case EACCES:
				saw_eacces = 1;
				break;
			case ENOENT:
			case ENOTDIR:
			case ESTALE:
			case ENODEV:
			case ETIMEDOUT:
				break;
			default:
				child_fail(r, "execvp");
			}
		}
		if (!*e)
			break;
		p = e + 1;
	}
	errno = saw_eacces ? EACCES : ENOENT;
	child_fail(r, "execvp");
}

pid_t spawn_process(struct spawn_req *r)
{
	r->err_stage = NULL;
	r->err_no = 0;
	int argc = 0;
	while (r->argv[argc])
		argc++;
	char **sh_argv = xmalloc(sizeof(char *) * (size_t)(argc + 3));
	struct child_ctx cx = {.r = r, .sh_argv = sh_argv};
	/* CLONE_VM|CLONE_VFORK: no page-table copy, we resume once the child has exec'd. */
	pid_t pid = clone(child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD,
	                  &cx);
	int saved = errno;
	free(sh_argv);
	if (pid < 0) {
		r->err_stage = "fork";
		r->err_no = saved;
		return -1;
	}
	__atomic_thread_fence(__ATOMIC_SEQ_CST);
	if (r->err_stage) {
		while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {
		}
		return -1;
	}
	return pid;
}

void spawn_error(const struct spawn_req *r, const char **code, char *msg, size_t msglen)
{
	if (strcmp(r->err_stage, "chdir") == 0) {
		*code = errno_code(r->err_no);
		snprintf(msg, msglen, "cwd %.200s: %s", r->opts->cwd, strerror(r->err_no));
		return;
	}
	*code = "spawn_failed";
	snprintf(msg, msglen, "%s: %s", r->err_stage, strerror(r->err_no));
}

/* ---------- /proc ---------- */

int proc_read_stat(pid_t pid, struct pinfo *pi)
{
	char path[64], b[1024];
	snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n;
	do
		n = read(fd, b, sizeof b - 1);
	while (n < 0 && errno == EINTR);
	close(fd);
	if (n <= 0)
		return -1;
	b[n] = 0;
	char *lp = strchr(b, '(');
	char *rp = strrchr(b, ')');
	if (!lp || !rp || rp < lp || rp[1] != ' ')
		return -1;
	size_t cl = (size_t)(rp - lp - 1);
	if (cl >= sizeof pi->comm)
		cl = sizeof pi->comm - 1;
	memcpy(pi->comm, lp + 1, cl);
	pi->comm[cl] = 0;
	pi->pid = pid;
	/* Fields after ")": state ppid pgrp session ... with starttime the 20th. */
	char *s = rp + 2;
	pi->state = *s;
	char *save = NULL;
	int field = 3;
	for (char *t = strtok_r(s, " ", &save); t; t = strtok_r(NULL, " ", &save), field++) {
		switch (field) {
		case 4: pi->ppid = (pid_t)strtol(t, NULL, 10); break;
		case 5: pi->pgrp = (pid_t)strtol(t, NULL, 10); break;
		case 6: pi->sid = (pid_t)strtol(t, NULL, 10); break;
		case 22: pi->start = strtoull(t, NULL, 10); return 0;
		}
	}
	return -1;
}

int proc_scan(struct pinfo **out)
{
	DIR *d = opendir("/proc");
	if (!d)
		return -1;
	int n = 0, cap = 64;
	struct pinfo *v = xmalloc(sizeof *v * (size_t)cap);
	struct dirent *de;
	while ((de = readdir(d))) {
		if (de->d_name[0] < '1' || de->d_name[0] > '9')
			continue;
		char *end;
		long pid = strtol(de->d_name, &end, 10);
		if (*end)
			continue;
		if (n == cap) {
			cap *= 2;
			v = xrealloc(v, sizeof *v * (size_t)cap);
		}
		if (proc_read_stat((pid_t)pid, &v[n]) == 0)
			n++;
	}
	closedir(d);
	*out = v;
	return n;
}

unsigned long long boot_ticks(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_BOOTTIME, &ts);
	/* USER_HZ is 100 on every Linux architecture we run on. */
	return (unsigned long long)ts.tv_sec * 100ull + (unsigned long long)ts.tv_nsec / 10000000ull;
}

static int cmp_pid(const void *a, const void *b)
{
	pid_t x = ((const struct pinfo *)a)->pid, y = ((const struct pinfo *)b)->pid;
	return (x > y) - (x < y);
}

/* Marks targets in v (sorted by pid). Returns count. */
static int mark_targets(const struct tree_spec *t, struct pinfo *v, int n, unsigned char *mark)
{
	pid_t self = getpid();
	memset(mark, 0, (size_t)n);
	int changed = 1, count = 0;
	while (changed) {
		changed = 0;
		for (int i = 0; i < n; i++) {
			struct pinfo *p = &v[i];
			if (mark[i] || p->pid == self || p->pid == 1 || p->state == 'Z' || p->state == 'X')
				continue;
			if (t->min_start && p->start < t->min_start)
				continue;
			int hit = (t->sid > 0 && p->sid == t->sid) || (t->root > 0 && p->pid == t->root) ||
			          (t->root > 0 && p->ppid == t->root);
			if (!hit) {
				struct pinfo key = {.pid = p->ppid};
				struct pinfo *par = bsearch(&key, v, (size_t)n, sizeof *v, cmp_pid);
				hit = par && mark[par - v];
			}
			if (hit) {
				mark[i] = 1;
				changed = 1;
				count++;
			}
		}
	}
	for (int i = 0; i < n; i++) {
		if (mark[i] && v[i].pid == t->exclude) {
			mark[i] = 0;
			count--;
		}
	}
	return count;
}

int tree_signal(const struct tree_spec *t, int sig)
{
	struct pinfo *v;
	int n = proc_scan(&v);
	if (n < 0)
		return 0;
	qsort(v, (size_t)n, sizeof *v, cmp_pid);
	unsigned char *mark = xmalloc((size_t)n + 1);
	int count = mark_targets(t, v, n, mark);
	for (int i = 0; i < n; i++)
		if (mark[i])
			kill(v[i].pid, sig);
	free(mark);
	free(v);
	return count;
}

void tree_kill(const struct tree_spec *t)
{
	pid_t *done = NULL;
	int nd = 0, capd = 0;
	for (int round = 0; round < 64; round++) {
		struct pinfo *v;
		int n = proc_scan(&v);
		if (n < 0)
			break;
		qsort(v, (size_t)n, sizeof *v, cmp_pid);
		unsigned char *mark = xmalloc((size_t)n + 1);
		mark_targets(t, v, n, mark);
		int fresh = 0;
		for (int i = 0; i < n; i++) {
			if (!mark[i])
				continue;
			int seen = 0;
			for (int j = 0; j < nd && !seen; j++)
				seen = done[j] == v[i].pid;
			if (seen)
				continue;
			kill(v[i].pid, SIGSTOP);
			if (nd == capd) {
				capd = capd ? capd * 2 : 64;
				done = xrealloc(done, sizeof *done * (size_t)capd);
			}
			done[nd++] = v[i].pid;
			fresh++;
		}
		free(mark);
		free(v);
		if (!fresh)
			break;
	}
	for (int j = 0; j < nd; j++)
		kill(done[j], SIGKILL);
	free(done);
}
