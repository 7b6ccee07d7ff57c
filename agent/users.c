#define _GNU_SOURCE
#include "users.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The sandbox owns these files and its processes are root: a FIFO in place of /etc/passwd must
 * not hang the agent, nor a huge file stall it. Only regular files are read, and at most this
 * much of them. */
#define MAX_DB_BYTES (16l << 20)

static FILE *open_db(const char *path)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
	if (fd < 0)
		return NULL;
	struct stat st;
	if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) {
		close(fd);
		return NULL;
	}
	FILE *f = fdopen(fd, "r");
	if (!f)
		close(fd);
	return f;
}

static int parse_id(const char *s, size_t n, unsigned long *out)
{
	if (n == 0 || n > 10)
		return -1;
	unsigned long v = 0;
	for (size_t i = 0; i < n; i++) {
		if (s[i] < '0' || s[i] > '9')
			return -1;
		v = v * 10 + (unsigned long)(s[i] - '0');
	}
	if (v > 0xFFFFFFFEul)
		return -1;
	*out = v;
	return 0;
}

/* Split a colon-separated line into at most max fields (in place). */
static int split(char *line, char **f, int max)
{
	int n = 0;
	f[n++] = line;
	for (char *p = line; *p && n < max; p++) {
		if (*p == ':') {
			*p = 0;
			f[n++] = p + 1;
		}
	}
	return n;
}

static void chomp(char *s)
{
	size_t n = strlen(s);
	while (n && (s[n - 1] == '\n' || s[n - 1] == '\r'))
		s[--n] = 0;
}

/* by_name != NULL: match the name; else match uid. */
static int find_passwd(const char *by_name, uid_t uid, struct user_info *u)
{
	FILE *f = open_db("/etc/passwd");
	if (!f)
		return -1;
	char *line = NULL;
	size_t cap = 0;
	int found = -1;
	while (getline(&line, &cap, f) > 0 && ftell(f) <= MAX_DB_BYTES) {
		chomp(line);
		char *fl[7];
		if (split(line, fl, 7) < 7)
			continue;
		unsigned long pu, pg;
		if (parse_id(fl[2], strlen(fl[2]), &pu) < 0 || parse_id(fl[3], strlen(fl[3]), &pg) < 0)
			continue;
		if (by_name ? strcmp(fl[0], by_name) != 0 : (uid_t)pu != uid)
			continue;
		u->uid = (uid_t)pu;
		u->gid = (gid_t)pg;
		snprintf(u->name, sizeof u->name, "%s", fl[0]);
		snprintf(u->home, sizeof u->home, "%s", fl[5]);
		u->have_pw = 1;
		found = 0;
		break;
	}
	free(line);
	fclose(f);
	return found;
}

static void add_group(struct user_info *u, gid_t g)
{
	for (int i = 0; i < u->ngroups; i++)
		if (u->groups[i] == g)
			return;
	if (u->ngroups < MAX_GROUPS)
		u->groups[u->ngroups++] = g;
}

static void find_groups(struct user_info *u)
{
	FILE *f = open_db("/etc/group");
	if (!f)
		return;
	char *line = NULL;
	size_t cap = 0;
	while (getline(&line, &cap, f) > 0 && ftell(f) <= MAX_DB_BYTES) {
		chomp(line);
		char *fl[4];
		if (split(line, fl, 4) < 4)
			continue;
		unsigned long g;
		if (parse_id(fl[2], strlen(fl[2]), &g) < 0)
			continue;
		char *save = NULL;
		for (char *m = strtok_r(fl[3], ",", &save); m; m = strtok_r(NULL, ",", &save)) {
			if (strcmp(m, u->name) == 0) {
				add_group(u, (gid_t)g);
				break;
			}
		}
	}
	free(line);
	fclose(f);
}

/* The gid of group `name` in /etc/group; -1 when there is none. */
static int find_group_gid(const char *name, gid_t *gid)
{
	FILE *f = open_db("/etc/group");
	if (!f)
		return -1;
	char *line = NULL;
	size_t cap = 0;
	int found = -1;
	while (getline(&line, &cap, f) > 0 && ftell(f) <= MAX_DB_BYTES) {
		chomp(line);
		char *fl[4];
		if (split(line, fl, 4) < 3)
			continue;
		unsigned long g;
		if (strcmp(fl[0], name) != 0 || parse_id(fl[2], strlen(fl[2]), &g) < 0)
			continue;
		*gid = (gid_t)g;
		found = 0;
		break;
	}
	free(line);
	fclose(f);
	return found;
}

int user_lookup(const char *spec, struct user_info *u)
{
	memset(u, 0, sizeof *u);
	const char *colon = strchr(spec, ':');
	size_t ulen = colon ? (size_t)(colon - spec) : strlen(spec);
	char uname[256];
	if (ulen == 0 || ulen >= sizeof uname)
		return -1;
	memcpy(uname, spec, ulen);
	uname[ulen] = 0;
	unsigned long uid, gid;
	if (parse_id(uname, ulen, &uid) == 0) {
		u->uid = (uid_t)uid;
		if (find_passwd(NULL, (uid_t)uid, u) < 0)
			u->gid = (gid_t)uid;
	} else if (find_passwd(uname, 0, u) < 0) {
		/* Images without /etc/passwd (scratch, distroless) still run as root, as under
		 * Docker: "root" is uid 0 whatever the files say (HOME stays the process's). */
		if (strcmp(uname, "root") != 0)
			return -1;
		u->uid = 0;
		u->gid = 0;
	}
	if (colon) {
		/* Docker's USER name:group / uid:gid / name:gid / uid:group: the group is the primary gid */
		const char *g = colon + 1;
		if (parse_id(g, strlen(g), &gid) == 0) {
			u->gid = (gid_t)gid;
		} else {
			gid_t gg;
			if (!*g || find_group_gid(g, &gg) < 0)
				return -1;
			u->gid = gg;
		}
	}
	add_group(u, u->gid);
	if (u->have_pw)
		find_groups(u);
	return 0;
}
