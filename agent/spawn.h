/* Starting processes (clone+exec with the parent suspended, like posix_spawn) and finding or
 * killing process trees through /proc. */
#ifndef SHOAL_SPAWN_H
#define SHOAL_SPAWN_H

#include <sys/resource.h>
#include <sys/types.h>

#include "json.h"
#include "users.h"

/* Options shared by exec and shell_open: environment, cwd and user. */
struct spawn_opts {
	char **envp;          /* NULL-terminated, owned */
	const char *path;     /* PATH used for the executable search (points into envp) */
	char *cwd;            /* owned */
	int has_user;
	struct user_info user;
};

/* Parses "env", "cwd" and "user" from a request. On failure returns -1 and sets *code and msg. */
int spawn_opts_parse(const struct jv *req, struct spawn_opts *o, const char **code, char *msg,
                     size_t msglen);
void spawn_opts_free(struct spawn_opts *o);

struct spawn_req {
	char **argv;          /* NULL-terminated */
	const struct spawn_opts *opts;
	int fds[5];           /* become the child's fds 0..nfds-1 */
	int nfds;             /* 3, or 5 for the shell's bash (fd 3 commands, fd 4 status) */
	int ctty;             /* fd to make the controlling terminal, or -1 */
	/* filled in on failure */
	const char *err_stage;
	int err_no;
};

/* Returns the child's pid, or -1 with err_stage/err_no set (the failed child is reaped). */
pid_t spawn_process(struct spawn_req *r);
/* ERR frame for a failed spawn: chdir problems are file errors, the rest spawn_failed. */
void spawn_error(const struct spawn_req *r, const char **code, char *msg, size_t msglen);

extern struct rlimit g_orig_nofile;
/* oom_score_adj written by every child before exec ("-1000".."1000"); -1 for a bad value. */
int spawn_set_child_oom_score_adj(const char *v);
/* Call once after the agent's own signal setup. */
void spawn_init(void);

/* ---- /proc ---- */

struct pinfo {
	pid_t pid, ppid, pgrp, sid;
	char state;
	unsigned long long start;   /* clock ticks since boot */
	char comm[64];
};

int proc_read_stat(pid_t pid, struct pinfo *pi);
/* All processes (thread-group leaders); returns the count, *out malloc'd. -1 on error. */
int proc_scan(struct pinfo **out);
/* Current time in the units of /proc/PID/stat's starttime. */
unsigned long long boot_ticks(void);

/* Which processes a tree kill targets: the members of session `sid`, process `root` and every
 * descendant of those, except `exclude`; with min_start, only processes started at or after it. */
struct tree_spec {
	pid_t sid;
	pid_t root;
	pid_t exclude;
	unsigned long long min_start;
};

/* Sends sig to every target once. Returns the number signalled. */
int tree_signal(const struct tree_spec *t, int sig);
/* SIGSTOPs the targets in rounds until no new ones appear (so a fork loop cannot outrun us),
 * then SIGKILLs them all. */
void tree_kill(const struct tree_spec *t);

#endif
