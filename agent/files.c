/* File operations: streamed reads and atomic uploads, directory listings, stat, mkdir,
 * remove, sync and ps. Paths resolve inside the sandbox because the agent runs inside it. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include "agent.h"
#include "spawn.h"
#include "users.h"

/* ---------- helpers ---------- */

/* Fetch a required absolute path; sends bad_request and returns NULL otherwise. */
static const char *req_path(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *p;
	size_t n;
	if (jv_str(req, "path", &p, &n) != 1 || n == 0 || memchr(p, 0, n) || p[0] != '/' ||
	    n >= PATH_MAX) {
		conn_send_err(c, sid, "bad_request", "path must be an absolute path", 0);
		return NULL;
	}
	return p;
}

static const char *type_name(mode_t m)
{
	if (S_ISREG(m))
		return "file";
	if (S_ISDIR(m))
		return "dir";
	if (S_ISLNK(m))
		return "symlink";
	return "other";
}

static double mtime_of(const struct stat *st)
{
	return (double)st->st_mtim.tv_sec + (double)st->st_mtim.tv_nsec / 1e9;
}

/* Optional "user" field for ownership. Returns 0 (none), 1 (set), -1 (error already sent). */
static int req_owner(struct conn *c, uint32_t sid, const struct jv *req, uid_t *uid, gid_t *gid)
{
	const char *u;
	size_t ul;
	int r = jv_str(req, "user", &u, &ul);
	if (r < 0 || (r > 0 && memchr(u, 0, ul))) {
		conn_send_err(c, sid, "bad_request", "user must be a string", 0);
		return -1;
	}
	if (r == 0 || ul == 0)
		return 0;
	struct user_info ui;
	if (user_lookup(u, &ui) < 0) {
		char msg[160];
		snprintf(msg, sizeof msg, "no such user in the sandbox's /etc/passwd: %.100s", u);
		conn_send_err(c, sid, "no_such_user", msg, 0);
		return -1;
	}
	*uid = ui.uid;
	*gid = ui.gid;
	return 1;
}

/* mkdir -p; newly made directories get mode and (if own) the owner. */
static int mkdirs(const char *path, mode_t mode, int own, uid_t uid, gid_t gid)
{
	char tmp[PATH_MAX];
	size_t n = strlen(path);
	if (n >= sizeof tmp) {
		errno = ENAMETOOLONG;
		return -1;
	}
	memcpy(tmp, path, n + 1);
	while (n > 1 && tmp[n - 1] == '/')
		tmp[--n] = 0;
	for (char *p = tmp + 1;; p++) {
		if (*p != '/' && *p != 0)
			continue;
		char saved = *p;
		*p = 0;
		if (mkdir(tmp, mode) == 0) {
			chmod(tmp, mode);
			if (own && chown(tmp, uid, gid) < 0) { /* best effort */ }
		} else if (errno != EEXIST) {
			return -1;
		} else {
			struct stat st;
			if (stat(tmp, &st) < 0)
				return -1;
			if (!S_ISDIR(st.st_mode)) {
				errno = ENOTDIR;
				return -1;
			}
		}
		*p = saved;
		if (!saved)
			break;
	}
	return 0;
}

/* ---------- read_file ---------- */

struct download {
	int fd;
	uint64_t off, remaining;   /* remaining == UINT64_MAX: to EOF */
	uint64_t size, sent;
	mode_t mode;
};

void op_read_file(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	int64_t off = 0, limit = 0;
	if (jv_int(req, "offset", &off) < 0 || jv_int(req, "limit", &limit) < 0 || off < 0 || limit < 0) {
		conn_send_err(c, sid, "bad_request", "offset and limit must be non-negative integers", 0);
		return;
	}
	/* O_NONBLOCK: opening a FIFO must not hang the agent. */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	struct stat st;
	if (fstat(fd, &st) < 0) {
		conn_send_errno(c, sid, path, errno);
		close(fd);
		return;
	}
	if (S_ISDIR(st.st_mode)) {
		close(fd);
		conn_send_errno(c, sid, path, EISDIR);
		return;
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		conn_send_err(c, sid, "io_error", "not a regular file", 0);
		return;
	}
	struct download *d = xmalloc(sizeof *d);
	d->fd = fd;
	d->off = (uint64_t)off;
	d->remaining = limit ? (uint64_t)limit : UINT64_MAX;
	d->size = (uint64_t)st.st_size;
	d->sent = 0;
	d->mode = st.st_mode & 07777;
	struct stream *s = stream_add(c, sid, ST_DOWNLOAD, d);
	download_pump(s);
}

static void download_free(struct download *d)
{
	close(d->fd);
	free(d);
}

void download_pump(struct stream *st)
{
	struct download *d = st->obj;
	struct conn *c = st->conn;
	for (;;) {
		if (d->remaining == 0)
			break;
		if (conn_out_full(c))
			return; /* conn_flush calls us again once the client has read */
		size_t want = CHUNK;
		if (d->remaining < want)
			want = (size_t)d->remaining;
		uint8_t *p = conn_frame_begin(c, want);
		ssize_t n = pread(d->fd, p, want, (off_t)d->off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			conn_send_errno(c, st->id, "read", errno);
			download_free(d);
			stream_end(st);
			return;
		}
		if (n == 0)
			break;
		conn_frame_commit(c, F_DATA, st->id, (size_t)n);
		d->off += (uint64_t)n;
		d->sent += (uint64_t)n;
		if (d->remaining != UINT64_MAX)
			d->remaining -= (uint64_t)n;
	}
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "size");
	jw_int(&w, (int64_t)d->size);
	jw_key(&w, "mode");
	jw_int(&w, d->mode);
	jw_key(&w, "sent");
	jw_int(&w, (int64_t)d->sent);
	conn_json_end(c, &w, pos, F_RESP, st->id);
	download_free(d);
	stream_end(st);
}

void download_abort(struct stream *st) { download_free(st->obj); }

/* ---------- write_file ---------- */

struct upload {
	int fd;
	char *path;     /* target */
	char *tmp;      /* temporary file, NULL when appending in place */
	uint64_t size;
	mode_t mode;
	int own;
	uid_t uid;
	gid_t gid;
};

static void upload_free(struct upload *u, int unlink_tmp)
{
	if (u->fd >= 0)
		close(u->fd);
	if (unlink_tmp && u->tmp)
		unlink(u->tmp);
	free(u->path);
	free(u->tmp);
	free(u);
}

void op_write_file(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	int64_t mode = 0644;
	int mk = 1, append = 0;
	if (jv_int(req, "mode", &mode) < 0 || jv_bool(req, "mkdirs", &mk) < 0 ||
	    jv_bool(req, "append", &append) < 0 || mode < 0 || mode > 07777) {
		conn_send_err(c, sid, "bad_request", "bad mode, mkdirs or append", 0);
		return;
	}
	uid_t uid = 0;
	gid_t gid = 0;
	int own = req_owner(c, sid, req, &uid, &gid);
	if (own < 0)
		return;
	size_t plen = strlen(path);
	if (path[plen - 1] == '/') {
		conn_send_errno(c, sid, path, EISDIR);
		return;
	}
	const char *slash = strrchr(path, '/');
	char dir[PATH_MAX];
	size_t dl = (size_t)(slash - path);
	memcpy(dir, path, dl);
	dir[dl ? dl : 1] = 0;
	if (dl == 0)
		dir[0] = '/';
	if (mk && mkdirs(dir, 0755, own, uid, gid) < 0) {
		conn_send_errno(c, sid, dir, errno);
		return;
	}
	struct upload *u = xmalloc(sizeof *u);
	memset(u, 0, sizeof *u);
	u->fd = -1;
	u->path = xstrdup(path);
	u->mode = (mode_t)mode;
	u->own = own;
	u->uid = uid;
	u->gid = gid;
	if (append) {
		/* O_NONBLOCK: a FIFO at the target must not hang the agent; only files are appended. */
		u->fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NOCTTY | O_NONBLOCK,
		             (mode_t)mode);
		struct stat st;
		if (u->fd < 0) {
			conn_send_errno(c, sid, path, errno == ENXIO ? EINVAL : errno);
			upload_free(u, 0);
			return;
		}
		if (fstat(u->fd, &st) < 0 || !S_ISREG(st.st_mode)) {
			conn_send_err(c, sid, "io_error", "not a regular file", 0);
			upload_free(u, 0);
			return;
		}
		fcntl(u->fd, F_SETFL, O_APPEND);
	} else {
		struct stat st;
		if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) {
			conn_send_errno(c, sid, path, EISDIR);
			upload_free(u, 0);
			return;
		}
		uint8_t r[6];
		if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
			memset(r, (int)(now_ms() & 0xff), sizeof r);
		size_t tl = plen + 32;
		u->tmp = xmalloc(tl);
		/* The base name is shortened so the temporary name stays within NAME_MAX. */
		snprintf(u->tmp, tl, "%.*s.%.200s.shoal-%02x%02x%02x%02x%02x%02x", (int)(slash - path + 1),
		         path, slash + 1, r[0], r[1], r[2], r[3], r[4], r[5]);
		u->fd = open(u->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0600);
		if (u->fd < 0) {
			conn_send_errno(c, sid, path, errno);
			free(u->tmp);
			u->tmp = NULL;
			upload_free(u, 0);
			return;
		}
	}
	stream_add(c, sid, ST_UPLOAD, u);
}

void upload_frame(struct stream *st, int type, const uint8_t *p, size_t n)
{
	struct upload *u = st->obj;
	struct conn *c = st->conn;
	if (type == F_DATA) {
		while (n) {
			ssize_t w = write(u->fd, p, n);
			if (w < 0 && errno == EINTR)
				continue;
			if (w < 0) {
				conn_send_errno(c, st->id, u->path, errno);
				upload_free(u, 1);
				stream_end(st);
				return;
			}
			p += w;
			n -= (size_t)w;
			u->size += (uint64_t)w;
		}
		return;
	}
	/* DATA_END */
	int err = 0;
	if (u->tmp) {
		if (fchmod(u->fd, u->mode) < 0)
			err = errno;
		if (!err && u->own && fchown(u->fd, u->uid, u->gid) < 0)
			err = errno;
	} else if (u->own && fchown(u->fd, u->uid, u->gid) < 0) {
		err = errno;
	}
	if (close(u->fd) < 0 && !err)
		err = errno;
	u->fd = -1;
	if (!err && u->tmp && rename(u->tmp, u->path) < 0)
		err = errno;
	if (err) {
		conn_send_errno(c, st->id, u->path, err);
		upload_free(u, 1);
		stream_end(st);
		return;
	}
	free(u->tmp);
	u->tmp = NULL;
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "size");
	jw_int(&w, (int64_t)u->size);
	conn_json_end(c, &w, pos, F_RESP, st->id);
	upload_free(u, 0);
	stream_end(st);
}

void upload_abort(struct stream *st)
{
	/* The client went away before DATA_END: the target stays untouched. */
	upload_free(st->obj, 1);
}

/* ---------- list_dir / stat ---------- */

struct dent {
	char *name;
	struct stat st;
	int ok;
};

static int cmp_dent(const void *a, const void *b)
{
	return strcmp(((const struct dent *)a)->name, ((const struct dent *)b)->name);
}

void op_list_dir(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	int64_t limit = 10000;
	if (jv_int(req, "limit", &limit) < 0 || limit < 0) {
		conn_send_err(c, sid, "bad_request", "limit must be a non-negative integer", 0);
		return;
	}
	int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (dfd < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	DIR *d = fdopendir(dfd);
	if (!d) {
		conn_send_errno(c, sid, path, errno);
		close(dfd);
		return;
	}
	size_t n = 0, cap = 64;
	struct dent *v = xmalloc(sizeof *v * cap);
	struct dirent *de;
	while ((de = readdir(d))) {
		if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
			continue;
		if (n == cap) {
			cap *= 2;
			v = xrealloc(v, sizeof *v * cap);
		}
		v[n].name = xstrdup(de->d_name);
		v[n].ok = fstatat(dfd, de->d_name, &v[n].st, AT_SYMLINK_NOFOLLOW) == 0;
		n++;
	}
	qsort(v, n, sizeof *v, cmp_dent);
	int truncated = limit && n > (size_t)limit;
	size_t shown = truncated ? (size_t)limit : n;
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	size_t body_start = c->out.len;
	jw_key(&w, "entries");
	jw_arr(&w);
	for (size_t i = 0; i < shown; i++) {
		/* Leave room below the frame limit for the closing fields. */
		if (c->out.len - body_start > MAX_PAYLOAD - 4096) {
			truncated = 1;
			break;
		}
		const struct stat *st = &v[i].st;
		jw_obj(&w);
		jw_key(&w, "name");
		jw_cstr(&w, v[i].name);
		jw_key(&w, "type");
		jw_cstr(&w, v[i].ok ? type_name(st->st_mode) : "other");
		jw_key(&w, "size");
		jw_int(&w, v[i].ok ? (int64_t)st->st_size : 0);
		jw_key(&w, "mode");
		jw_int(&w, v[i].ok ? (int64_t)(st->st_mode & 07777) : 0);
		jw_key(&w, "mtime");
		jw_double(&w, v[i].ok ? mtime_of(st) : 0.0);
		jw_obj_end(&w);
	}
	jw_arr_end(&w);
	jw_key(&w, "truncated");
	jw_bool(&w, truncated);
	conn_json_end(c, &w, pos, F_RESP, sid);
	for (size_t i = 0; i < n; i++)
		free(v[i].name);
	free(v);
	closedir(d);
}

void op_stat(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	struct stat st;
	if (lstat(path, &st) < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "type");
	jw_cstr(&w, type_name(st.st_mode));
	jw_key(&w, "size");
	jw_int(&w, (int64_t)st.st_size);
	jw_key(&w, "mode");
	jw_int(&w, st.st_mode & 07777);
	jw_key(&w, "mtime");
	jw_double(&w, mtime_of(&st));
	jw_key(&w, "uid");
	jw_int(&w, st.st_uid);
	jw_key(&w, "gid");
	jw_int(&w, st.st_gid);
	conn_json_end(c, &w, pos, F_RESP, sid);
}

/* ---------- mkdir / remove ---------- */

void op_mkdir(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	int parents = 1;
	int64_t mode = 0755;
	if (jv_bool(req, "parents", &parents) < 0 || jv_int(req, "mode", &mode) < 0 || mode < 0 ||
	    mode > 07777) {
		conn_send_err(c, sid, "bad_request", "bad parents or mode", 0);
		return;
	}
	uid_t uid = 0;
	gid_t gid = 0;
	int own = req_owner(c, sid, req, &uid, &gid);
	if (own < 0)
		return;
	int r;
	if (parents) {
		r = mkdirs(path, (mode_t)mode, own, uid, gid);
	} else {
		r = mkdir(path, (mode_t)mode);
		if (r == 0) {
			chmod(path, (mode_t)mode);
			if (own && chown(path, uid, gid) < 0) { /* best effort */ }
		}
	}
	if (r < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	conn_send_empty_resp(c, sid);
}

/* Remove everything inside the directory dfd (which is consumed). No symlink is followed:
 * subdirectories are opened with O_NOFOLLOW relative to their parent. */
static int rm_contents(int dfd, int depth)
{
	if (depth > 256) {
		close(dfd);
		errno = ELOOP;
		return -1;
	}
	DIR *d = fdopendir(dfd);
	if (!d) {
		close(dfd);
		return -1;
	}
	int err = 0;
	struct dirent *de;
	while ((de = readdir(d))) {
		const char *nm = de->d_name;
		if (strcmp(nm, ".") == 0 || strcmp(nm, "..") == 0)
			continue;
		if (unlinkat(dfd, nm, 0) == 0)
			continue;
		if (errno != EISDIR && errno != EPERM) {
			if (errno != ENOENT)
				err = errno;
			continue;
		}
		int sub = openat(dfd, nm, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (sub < 0) {
			err = errno;
			continue;
		}
		if (rm_contents(sub, depth + 1) < 0)
			err = errno;
		if (unlinkat(dfd, nm, AT_REMOVEDIR) < 0 && errno != ENOENT)
			err = errno;
	}
	closedir(d);
	if (err) {
		errno = err;
		return -1;
	}
	return 0;
}

void op_remove(struct conn *c, uint32_t sid, const struct jv *req)
{
	const char *path = req_path(c, sid, req);
	if (!path)
		return;
	int recursive = 0;
	if (jv_bool(req, "recursive", &recursive) < 0) {
		conn_send_err(c, sid, "bad_request", "recursive must be a boolean", 0);
		return;
	}
	struct stat st;
	if (lstat(path, &st) < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	if (!S_ISDIR(st.st_mode)) {
		if (unlink(path) < 0) {
			conn_send_errno(c, sid, path, errno);
			return;
		}
		conn_send_empty_resp(c, sid);
		return;
	}
	if (recursive) {
		int dfd = open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		if (dfd < 0 || rm_contents(dfd, 0) < 0) {
			conn_send_errno(c, sid, path, errno);
			return;
		}
	}
	if (rmdir(path) < 0) {
		conn_send_errno(c, sid, path, errno);
		return;
	}
	conn_send_empty_resp(c, sid);
}

/* ---------- misc ---------- */

void op_sync(struct conn *c, uint32_t sid, const struct jv *req)
{
	(void)req;
	sync();
	conn_send_empty_resp(c, sid);
}

void op_ps(struct conn *c, uint32_t sid, const struct jv *req)
{
	(void)req;
	struct pinfo *v;
	int n = proc_scan(&v);
	if (n < 0) {
		conn_send_errno(c, sid, "/proc", errno);
		return;
	}
	struct jw w;
	size_t pos = conn_json_begin(c, &w, F_RESP);
	jw_key(&w, "processes");
	jw_arr(&w);
	for (int i = 0; i < n; i++) {
		char st[2] = {v[i].state, 0};
		jw_obj(&w);
		jw_key(&w, "pid");
		jw_int(&w, v[i].pid);
		jw_key(&w, "ppid");
		jw_int(&w, v[i].ppid);
		jw_key(&w, "comm");
		jw_cstr(&w, v[i].comm);
		jw_key(&w, "state");
		jw_cstr(&w, st);
		jw_obj_end(&w);
	}
	jw_arr_end(&w);
	conn_json_end(c, &w, pos, F_RESP, sid);
	free(v);
}
