/* The watch operation: inotify events of a directory (and, recursively, of its subdirectories) as
 * EVENT frames. Every watch of the agent shares one inotify instance (made on the first watch, closed
 * with the last): without user namespaces, instances count against the host user's limit
 * (fs.inotify.max_user_instances, 128 by default), so one per sandbox rather than one per watch. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"

#define WATCH_MASK (IN_CREATE | IN_DELETE | IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | \
                    IN_DELETE_SELF | IN_MOVE_SELF)
/* Directories one recursive watch may cover: inotify watches are a host-wide budget too. */
#define MAX_DIRS 8192

struct watch;

/* One directory of one watch; several watches of the same directory share its wd. */
struct wdir {
	int wd;
	struct watch *w;
	char *rel;              /* path below the watch's root ("" for the root) */
	struct wdir *next_wd;   /* same wd, other watches */
	struct wdir *next_w;    /* same watch, other directories */
};

struct watch {
	struct stream *st;
	struct wdir *dirs;
	char *root;
	size_t ndirs;
	uint8_t recursive, dropped;
};

static struct src g_ino = {.fd = -1};
static struct wdir **g_by_wd;  /* indexed by wd */
static size_t g_cap_wd;
static int g_nwatches;

static void by_wd_put(struct wdir *d)
{
	if ((size_t)d->wd >= g_cap_wd) {
		size_t cap = g_cap_wd ? g_cap_wd : 64;
		while (cap <= (size_t)d->wd)
			cap *= 2;
		g_by_wd = xrealloc(g_by_wd, cap * sizeof *g_by_wd);
		memset(g_by_wd + g_cap_wd, 0, (cap - g_cap_wd) * sizeof *g_by_wd);
		g_cap_wd = cap;
	}
	d->next_wd = g_by_wd[d->wd];
	g_by_wd[d->wd] = d;
}

static void by_wd_del(struct wdir *d)
{
	for (struct wdir **pp = &g_by_wd[d->wd]; *pp; pp = &(*pp)->next_wd) {
		if (*pp == d) {
			*pp = d->next_wd;
			return;
		}
	}
}

/* Watch `abs` (a directory of `w`, named `rel` below its root). 0, or -1 with errno. */
static int add_dir(struct watch *w, const char *abs, const char *rel)
{
	if (w->ndirs >= MAX_DIRS) {
		errno = ENOSPC;
		return -1;
	}
	int wd = inotify_add_watch(g_ino.fd, abs, WATCH_MASK | IN_ONLYDIR | IN_DONT_FOLLOW);
	if (wd < 0)
		return -1;
	for (struct wdir *d = w->dirs; d; d = d->next_w)
		if (d->wd == wd)
			return 0; /* already ours (a directory moved in twice, a race with a walk) */
	struct wdir *d = xmalloc(sizeof *d);
	d->wd = wd;
	d->w = w;
	d->rel = xstrdup(rel);
	d->next_w = w->dirs;
	w->dirs = d;
	w->ndirs++;
	by_wd_put(d);
	return 0;
}

/* Watch every directory below `abs` (not following symlinks). Stops at the first hard failure. */
static int add_tree(struct watch *w, const char *abs, const char *rel, int depth)
{
	if (depth > 64)
		return 0;
	DIR *dir = opendir(abs);
	if (!dir)
		return errno == ENOENT || errno == EACCES || errno == ENOTDIR ? 0 : -1;
	struct dirent *de;
	int rc = 0;
	while (rc == 0 && (de = readdir(dir))) {
		if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
			continue;
		int isdir = de->d_type == DT_DIR;
		if (de->d_type == DT_UNKNOWN) {
			struct stat st;
			isdir = fstatat(dirfd(dir), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
		}
		if (!isdir)
			continue;
		char sub[PATH_MAX], subrel[PATH_MAX];
		if (snprintf(sub, sizeof sub, "%s/%s", strcmp(abs, "/") ? abs : "", de->d_name) >= (int)sizeof sub ||
		    snprintf(subrel, sizeof subrel, "%s%s%s", rel, *rel ? "/" : "", de->d_name) >= (int)sizeof subrel)
			continue;
		if (add_dir(w, sub, subrel) < 0) {
			if (errno == ENOENT || errno == EACCES || errno == ENOTDIR)
				continue; /* gone meanwhile, or not ours to see */
			rc = -1;
			break;
		}
		rc = add_tree(w, sub, subrel, depth + 1);
	}
	int e = errno;
	closedir(dir);
	errno = e;
	return rc;
}

static void drop_dir(struct wdir *d)
{
	by_wd_del(d);
	free(d->rel);
	free(d);
}

static void watch_free(struct watch *w)
{
	struct wdir *d, *nx;
	for (d = w->dirs; d; d = nx) {
		nx = d->next_w;
		int wd = d->wd;
		drop_dir(d);
		if ((size_t)wd < g_cap_wd && !g_by_wd[wd] && g_ino.fd >= 0)
			inotify_rm_watch(g_ino.fd, wd); /* nobody else watches that directory */
	}
	free(w->root);
	free(w);
	if (--g_nwatches == 0) {
		src_close(&g_ino);
		free(g_by_wd);
		g_by_wd = NULL;
		g_cap_wd = 0;
	}
}

static void watch_end(struct watch *w)
{
	if (w->st) {
		conn_send(w->st->conn, F_RESP, w->st->id, "{}", 2);
		stream_end(w->st);
		w->st = NULL;
	}
	watch_free(w);
}

static void send_event(struct watch *w, const char *rel, const char *name, uint32_t mask)
{
	if (!w->st)
		return;
	struct conn *c = w->st->conn;
	if (c->out.len >= OUT_HIGH) {
		w->dropped = 1; /* the client does not keep up: tell it later that events were lost */
		return;
	}
	struct jw jw;
	size_t pos;
	if (w->dropped) {
		w->dropped = 0;
		pos = conn_json_begin(c, &jw, F_EVENT);
		jw_key(&jw, "overflow");
		jw_bool(&jw, 1);
		conn_json_end(c, &jw, pos, F_EVENT, w->st->id);
	}
	char full[2 * PATH_MAX + 2];
	int len = snprintf(full, sizeof full, "%s%s%s", rel, *rel && *name ? "/" : "", name);
	if (len < 0 || len >= (int)sizeof full)
		return;
	pos = conn_json_begin(c, &jw, F_EVENT);
	jw_key(&jw, "name");
	jw_str(&jw, full, (size_t)len);
	jw_key(&jw, "mask");
	jw_int(&jw, mask);
	conn_json_end(c, &jw, pos, F_EVENT, w->st->id);
}

static void handle_event(const struct inotify_event *ev)
{
	if (ev->mask & IN_Q_OVERFLOW) {
		for (size_t i = 0; i < g_cap_wd; i++)
			for (struct wdir *d = g_by_wd[i]; d; d = d->next_wd)
				d->w->dropped = 1;
		return;
	}
	if (ev->wd < 0 || (size_t)ev->wd >= g_cap_wd)
		return;
	const char *name = ev->len ? ev->name : "";
	struct wdir *d, *nx;
	for (d = g_by_wd[ev->wd]; d; d = nx) {
		nx = d->next_wd;
		struct watch *w = d->w;
		if (ev->mask & IN_IGNORED) {
			/* the directory is gone (or unmounted): forget it; the root's end was reported already */
			for (struct wdir **pp = &w->dirs; *pp; pp = &(*pp)->next_w) {
				if (*pp == d) {
					*pp = d->next_w;
					break;
				}
			}
			w->ndirs--;
			drop_dir(d);
			continue;
		}
		int self = ev->mask & (IN_DELETE_SELF | IN_MOVE_SELF);
		if (self && *d->rel)
			continue; /* a subdirectory's removal was reported by its parent */
		if (ev->mask & WATCH_MASK)
			send_event(w, d->rel, self ? "" : name, ev->mask);
		if (w->recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO)) && ev->len) {
			char abs[PATH_MAX], rel[PATH_MAX];
			int a = snprintf(abs, sizeof abs, "%s%s%s%s%s", strcmp(w->root, "/") ? w->root : "",
			                 *d->rel ? "/" : "", d->rel, "/", name);
			int b = snprintf(rel, sizeof rel, "%s%s%s", d->rel, *d->rel ? "/" : "", name);
			if (a < (int)sizeof abs && b < (int)sizeof rel && add_dir(w, abs, rel) == 0)
				add_tree(w, abs, rel, 1);
		}
	}
}

void watch_on_event(struct src *s, uint32_t ev)
{
	(void)ev;
	_Alignas(struct inotify_event) uint8_t b[64 * 1024];
	for (int round = 0; round < 16 && s->fd >= 0; round++) {
		ssize_t n = read(s->fd, b, sizeof b);
		if (n <= 0)
			return;
		for (ssize_t off = 0; off < n;) {
			const struct inotify_event *ie = (const struct inotify_event *)(b + off);
			off += (ssize_t)(sizeof *ie + ie->len);
			handle_event(ie);
			if (g_ino.fd < 0)
				return;
		}
	}
}

void watch_frame(struct stream *st, int type, const uint8_t *p, size_t n)
{
	(void)p;
	(void)n;
	if (type == F_SIGNAL)
		watch_end(st->obj); /* the client stops watching */
}

void watch_detach(struct stream *st)
{
	struct watch *w = st->obj;
	w->st = NULL;
	watch_free(w);
}

void op_watch(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path;
	size_t n;
	int recursive = 0;
	if (jv_str(req, "path", &path, &n) != 1 || n == 0 || memchr(path, 0, n) || path[0] != '/' ||
	    n >= PATH_MAX - 256 || jv_bool(req, "recursive", &recursive) < 0) {
		conn_send_err(c, sid, "bad_request", "path must be an absolute path; recursive a boolean", 0);
		return;
	}
	struct stat st;
	if (stat(path, &st) < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	if (!S_ISDIR(st.st_mode)) {
		conn_send_err(c, sid, "not_a_directory", "only a directory can be watched", ENOTDIR);
		return;
	}
	if (g_ino.fd < 0) {
		int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
		if (fd < 0) {
			int e = errno;
			conn_send_err(c, sid, "too_many_watchers",
			              e == EMFILE ? "no inotify instance left (the host's fs.inotify.max_user_instances)"
			                          : strerror(e), e);
			return;
		}
		src_init(&g_ino, fd, SK_WATCH, NULL);
		src_want(&g_ino, EPOLLIN);
	}
	struct watch *w = xmalloc(sizeof *w);
	memset(w, 0, sizeof *w);
	w->root = xstrdup(path);
	w->recursive = (uint8_t)recursive;
	g_nwatches++;
	/* the root without a trailing slash, so that events compose "root/rel/name" */
	size_t rl = strlen(w->root);
	while (rl > 1 && w->root[rl - 1] == '/')
		w->root[--rl] = 0;
	if (add_dir(w, w->root, "") < 0 || (recursive && add_tree(w, w->root, "", 1) < 0)) {
		int e = errno;
		watch_free(w);
		if (e == ENOSPC)
			conn_send_err(c, sid, "too_many_watchers",
			              "too many directories to watch (at most 8192 per watch, and the host's "
			              "fs.inotify.max_user_watches)", e);
		else
			conn_send_errno(c, sid, path, e);
		return;
	}
	w->st = stream_add(c, sid, ST_WATCH, w);
	conn_send(c, F_READY, sid, "{}", 2);
}
