/* The control socket (one request line, one JSON reply line) and image_corrupt events.
 *
 *   ping                      {"ok":true,"pid":N}
 *   stats                     counters, cache usage and mode
 *   touched <layer hex>       {"ok":true,"chunks":[i,...]}: chunks read through the layer, first-touch order
 *   prefetch <hex> <i,j,...>  {"ok":true,"queued":N}: fetch those chunks in the background
 *   idle <timeout ms>         {"ok":true,"idle":bool}: wait until no background fetch is queued or running
 *   limit <bytes>             {"ok":true}: resize the cache (evicts at once)
 *   subscribe                 {"ok":true}, then one line per event as it happens
 *
 * An event is also appended to the events file and, for the store's other readers, written as a marker
 * <store>/corrupt/<layer hex>/<chunk hex> (shoal.images.corruption reads them).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "chunkd.h"

#define MAX_SUBS 64
static pthread_mutex_t smu = PTHREAD_MUTEX_INITIALIZER;
static int subs[MAX_SUBS];
static int nsubs;

int fetch_queue_idle(void);

void event_corrupt(const char *layer, const uint8_t *chunk, const char *why)
{
    char ch[HEX_LEN + 1], line[512], path[4400];
    to_hex(chunk, ch);
    int n = snprintf(line, sizeof(line),
                     "{\"event\":\"image_corrupt\",\"layer\":\"sha256:%s\",\"chunk\":\"sha256:%s\","
                     "\"reason\":\"%s\",\"t\":%.6f,\"pid\":%d}\n",
                     layer, ch, why, wall_now(), (int)getpid());
    logmsg("chunkd: chunk sha256:%s of layer sha256:%s is %s: reads of it fail with EIO", ch, layer, why);
    if (cfg.events) {
        int fd = open(cfg.events, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
        if (fd >= 0) {
            write_full(fd, line, (size_t)n);
            close(fd);
        }
    }
    /* the store-wide mark: other nodes refuse new creates of images using this layer */
    snprintf(path, sizeof(path), "%s/corrupt/%s", cfg.store, layer);
    if (mkdirs(path, 0755) == 0) {
        snprintf(path, sizeof(path), "%s/corrupt/%s/%s", cfg.store, layer, ch);
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            write_full(fd, line, (size_t)n);
            close(fd);
        }
    }
    pthread_mutex_lock(&smu);
    for (int i = 0; i < nsubs;) {
        if (send(subs[i], line, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) != n) {
            close(subs[i]);
            subs[i] = subs[--nsubs];
            continue;
        }
        i++;
    }
    pthread_mutex_unlock(&smu);
}

static void say(int fd, const char *s)
{
    write_full(fd, s, strlen(s));
}

static void do_stats(int fd)
{
    uint64_t bytes, entries, mounted;
    cache_usage(&bytes, &entries, &mounted);
    char out[2048];
#define S(f) (unsigned long long)__atomic_load_n(&st.f, __ATOMIC_RELAXED)
    snprintf(out, sizeof(out),
             "{\"ok\":true,\"pid\":%d,\"mode\":\"%s\",\"reads\":%llu,\"read_bytes\":%llu,"
             "\"fetched_chunks\":%llu,\"fetched_bytes\":%llu,\"fetched_wire_bytes\":%llu,\"prefetched_chunks\":%llu,\"hits\":%llu,"
             "\"misses\":%llu,\"verified_chunks\":%llu,\"verified_bytes\":%llu,\"corrupt_chunks\":%llu,"
             "\"missing_chunks\":%llu,\"store_errors\":%llu,\"eio\":%llu,\"evicted_chunks\":%llu,"
             "\"evicted_bytes\":%llu,\"cache_bytes\":%llu,\"cache_chunks\":%llu,\"cache_limit\":%llu,"
             "\"cache_bytes_of_open_layers\":%llu,\"store_ok\":%s,\"readahead\":%llu}\n",
             (int)getpid(), "cache", S(reads), S(read_bytes), S(fetched_chunks),
             S(fetched_bytes), S(fetched_wire_bytes), S(prefetched_chunks), S(hits), S(misses), S(verified_chunks), S(verified_bytes),
             S(corrupt_chunks), S(missing_chunks), S(store_errors), S(eio), S(evicted_chunks), S(evicted_bytes),
             (unsigned long long)bytes, (unsigned long long)entries, (unsigned long long)cfg.cache_limit,
             (unsigned long long)mounted, g_store_ok ? "true" : "false", (unsigned long long)cfg.readahead);
#undef S
    say(fd, out);
}

static int handle(int fd, char *line)
{
    char *arg = strchr(line, ' ');
    if (arg)
        *arg++ = 0;
    if (!strcmp(line, "ping")) {
        char out[64];
        snprintf(out, sizeof(out), "{\"ok\":true,\"pid\":%d}\n", (int)getpid());
        say(fd, out);
    } else if (!strcmp(line, "stats")) {
        do_stats(fd);
    } else if (!strcmp(line, "touched") && arg) {
        char *j = layer_touched_json(arg);
        if (!j) {
            say(fd, "{\"ok\":false,\"error\":\"layer not loaded\"}\n");
        } else {
            say(fd, "{\"ok\":true,\"chunks\":");
            say(fd, j);
            say(fd, "}\n");
            free(j);
        }
    } else if (!strcmp(line, "prefetch") && arg) {
        char *list = strchr(arg, ' ');
        if (list)
            *list++ = 0;
        int queued = 0;
        int rc = strlen(arg) == HEX_LEN ? layer_prefetch(arg, list ? list : "", &queued) : -EINVAL;
        char out[128];
        if (rc)
            snprintf(out, sizeof(out), "{\"ok\":false,\"error\":\"%s\"}\n", strerror(-rc));
        else
            snprintf(out, sizeof(out), "{\"ok\":true,\"queued\":%d}\n", queued);
        say(fd, out);
    } else if (!strcmp(line, "idle")) {
        long ms = arg ? strtol(arg, NULL, 10) : 0;
        double until = mono_now() + ms / 1000.0;
        int idle;
        while (!(idle = fetch_queue_idle()) && mono_now() < until)
            usleep(2000);
        say(fd, idle ? "{\"ok\":true,\"idle\":true}\n" : "{\"ok\":true,\"idle\":false}\n");
    } else if (!strcmp(line, "limit") && arg) {
        cache_set_limit(strtoull(arg, NULL, 10));
        say(fd, "{\"ok\":true}\n");
    } else if (!strcmp(line, "subscribe")) {
        pthread_mutex_lock(&smu);
        int ok = nsubs < MAX_SUBS;
        if (ok)
            subs[nsubs++] = fd;
        pthread_mutex_unlock(&smu);
        say(fd, ok ? "{\"ok\":true}\n" : "{\"ok\":false,\"error\":\"too many subscribers\"}\n");
        return ok ? 1 : 0; /* the fd now belongs to the subscriber list */
    } else {
        say(fd, "{\"ok\":false,\"error\":\"unknown request\"}\n");
    }
    return 0;
}

static void *conn(void *arg)
{
    int fd = (int)(intptr_t)arg;
    char buf[1 << 20];
    size_t len = 0;
    for (;;) {
        ssize_t r = read(fd, buf + len, sizeof(buf) - 1 - len);
        if (r <= 0)
            break;
        len += (size_t)r;
        char *nl;
        while ((nl = memchr(buf, '\n', len))) {
            *nl = 0;
            if (handle(fd, buf))
                return NULL;
            size_t used = (size_t)(nl - buf) + 1;
            memmove(buf, nl + 1, len - used);
            len -= used;
        }
        if (len == sizeof(buf) - 1)
            break; /* a line too long */
    }
    close(fd);
    return NULL;
}

static int lfd = -1;

static void *acceptor(void *arg)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED)
                continue;
            usleep(10000);
            continue;
        }
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, (1 << 20) + (256 << 10));
        if (pthread_create(&t, &a, conn, (void *)(intptr_t)fd))
            close(fd);
        pthread_attr_destroy(&a);
    }
    return NULL;
}

int ctl_start(void)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(cfg.ctl) >= sizeof(sa.sun_path))
        return -ENAMETOOLONG;
    strcpy(sa.sun_path, cfg.ctl);
    unlink(cfg.ctl);
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (lfd < 0)
        return -errno;
    if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 64) < 0)
        return -errno;
    chmod(cfg.ctl, 0600);
    pthread_t t;
    if (pthread_create(&t, NULL, acceptor, NULL))
        return -EAGAIN;
    pthread_detach(t);
    return 0;
}
