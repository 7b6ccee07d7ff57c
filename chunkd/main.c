/* shoal-chunkd: see chunkd.h. Started by the node (shoal.images.chunkd), one per SHOAL_HOME; it forks,
 * and the parent exits 0 once the FUSE mount and the control socket are up (1 with a message if not),
 * so the daemon is never a child the node must reap. SIGTERM unmounts and exits. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "chunkd.h"

struct config cfg = {.threads = 8, .fetchers = 8, .max_fds = 512, .cache_limit = 4ull << 30};
struct stats st;

static void usage(void)
{
    fprintf(stderr,
            "usage: shoal-chunkd --mount DIR --tables DIR --store DIR --cache DIR --ctl SOCKET [--cache-mb N]\n"
            "                    [--events FILE] [--pidfile FILE] [--readahead-kb N] [--threads N]\n"
            "                    [--fetchers N] [--max-fds N] [--foreground]\n");
    exit(2);
}

static int sigpipe_fds[2];

static void on_term(int sig)
{
    char c = (char)sig;
    ssize_t r = write(sigpipe_fds[1], &c, 1);
    (void)r;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && v && (i++, 1))
        if (OPT("--mount"))
            cfg.mount = v;
        else if (OPT("--tables"))
            cfg.tables = v;
        else if (OPT("--store"))
            cfg.store = v;
        else if (OPT("--cache"))
            cfg.cache = v;
        else if (OPT("--cache-mb"))
            cfg.cache_limit = strtoull(v, NULL, 10) << 20;
        else if (OPT("--ctl"))
            cfg.ctl = v;
        else if (OPT("--events"))
            cfg.events = v;
        else if (OPT("--pidfile"))
            cfg.pidfile = v;
        else if (OPT("--readahead-kb"))
            cfg.readahead = strtoull(v, NULL, 10) << 10;
        else if (OPT("--threads"))
            cfg.threads = atoi(v);
        else if (OPT("--fetchers"))
            cfg.fetchers = atoi(v);
        else if (OPT("--max-fds"))
            cfg.max_fds = atoi(v);
        else if (OPT("--trace"))
            cfg.trace = v;
        else if (!strcmp(a, "--foreground"))
            cfg.foreground = 1;
        else
            usage();
#undef OPT
    }
    if (!cfg.mount || !cfg.tables || !cfg.store || !cfg.ctl || !cfg.cache || cfg.threads < 1 || cfg.fetchers < 1 ||
        cfg.max_fds < 16)
        usage();

    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    int ready[2] = {-1, -1};
    if (!cfg.foreground) {
        if (pipe2(ready, O_CLOEXEC) < 0)
            return 1;
        pid_t pid = fork();
        if (pid < 0)
            return 1;
        if (pid > 0) {
            close(ready[1]);
            char msg[512];
            ssize_t n = read(ready[0], msg, sizeof(msg) - 1);
            if (n == 2 && !memcmp(msg, "ok", 2))
                return 0;
            if (n > 0) {
                msg[n] = 0;
                fprintf(stderr, "shoal-chunkd: %s\n", msg);
            } else {
                fprintf(stderr, "shoal-chunkd: the daemon exited before it was ready (see its log)\n");
            }
            return 1;
        }
        close(ready[0]);
        setsid();
    }
    signal(SIGPIPE, SIG_IGN);
    char err[512] = "";
    int rc;
    if ((rc = cache_init())) {
        snprintf(err, sizeof(err), "cannot use the cache directory %s: %s", cfg.cache, strerror(-rc));
    } else if ((rc = fuse_mount_and_serve())) {
        snprintf(err, sizeof(err), "cannot mount FUSE at %s: %s", cfg.mount, strerror(-rc));
    } else if ((rc = ctl_start())) {
        fuse_unmount();
        snprintf(err, sizeof(err), "cannot listen on %s: %s", cfg.ctl, strerror(-rc));
    }
    if (err[0]) {
        logmsg("chunkd: %s", err);
        if (ready[1] >= 0) {
            write_full(ready[1], err, strlen(err));
        }
        return 1;
    }
    fetchers_start();
    if (cfg.pidfile) {
        char tmp[4200], pid[32];
        snprintf(tmp, sizeof(tmp), "%s.tmp", cfg.pidfile);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
            write_full(fd, pid, (size_t)n);
            close(fd);
            rename(tmp, cfg.pidfile);
        }
    }
    logmsg("chunkd: serving %s (store %s, %s)", cfg.mount, cfg.store, "cached");
    if (pipe2(sigpipe_fds, O_CLOEXEC) < 0)
        return 1;
    struct sigaction sa = {.sa_handler = on_term};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (ready[1] >= 0) {
        write_full(ready[1], "ok", 2);
        close(ready[1]);
        int devnull = open("/dev/null", O_RDWR | O_CLOEXEC);
        if (devnull >= 0) {
            dup2(devnull, 0);
            dup2(devnull, 1);
            close(devnull);
        }
    }
    char c;
    while (read(sigpipe_fds[0], &c, 1) < 0 && errno == EINTR)
        ;
    logmsg("chunkd: signal %d: unmounting %s", (int)c, cfg.mount);
    fuse_unmount();
    if (cfg.pidfile)
        unlink(cfg.pidfile);
    unlink(cfg.ctl);
    _exit(0);
}
