/* User lookup from the sandbox's own /etc/passwd and /etc/group. No NSS: getpwnam() in a
 * static binary would try to dlopen NSS modules, and the sandbox's files are what count. */
#ifndef SHOAL_USERS_H
#define SHOAL_USERS_H

#include <sys/types.h>

#define MAX_GROUPS 64

struct user_info {
	uid_t uid;
	gid_t gid;
	int ngroups;
	gid_t groups[MAX_GROUPS];
	int have_pw;            /* found in /etc/passwd: name and home are set */
	char name[64];
	char home[256];
};

/* spec: "name", "uid", "uid:gid", "name:group" (either part a name or a number; "root" is uid 0
 * even without /etc/passwd). Returns 0, or -1
 * when the name is unknown or the spec is malformed. */
int user_lookup(const char *spec, struct user_info *u);

#endif
