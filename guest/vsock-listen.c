/* shoal-vsock-listen PORT PROG ARGS...: listen on AF_VSOCK PORT (any CID), put the listening socket on
 * fd 3 and exec PROG. Firecracker has no virtio-serial; its host side of a vsock is a Unix socket, and
 * the agent's --listen-fd mode then serves any number of host connections over it. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <linux/vm_sockets.h>

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: shoal-vsock-listen PORT PROG [ARGS...]\n");
		return 2;
	}
	char *end;
	unsigned long port = strtoul(argv[1], &end, 10);
	if (*end || port == 0 || port > 0xffffffffUL) {
		fprintf(stderr, "shoal-vsock-listen: bad port %s\n", argv[1]);
		return 2;
	}
	int fd = socket(AF_VSOCK, SOCK_STREAM, 0);
	if (fd < 0) {
		fprintf(stderr, "shoal-vsock-listen: socket(AF_VSOCK): %s\n", strerror(errno));
		return 1;
	}
	struct sockaddr_vm addr;
	memset(&addr, 0, sizeof addr);
	addr.svm_family = AF_VSOCK;
	addr.svm_cid = VMADDR_CID_ANY;
	addr.svm_port = (unsigned int)port;
	if (bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || listen(fd, 64) < 0) {
		fprintf(stderr, "shoal-vsock-listen: bind/listen port %lu: %s\n", port, strerror(errno));
		return 1;
	}
	if (fd != 3) {
		if (dup2(fd, 3) < 0) {
			fprintf(stderr, "shoal-vsock-listen: dup2: %s\n", strerror(errno));
			return 1;
		}
		close(fd);
	}
	execv(argv[2], argv + 2);
	fprintf(stderr, "shoal-vsock-listen: exec %s: %s\n", argv[2], strerror(errno));
	return 127;
}
