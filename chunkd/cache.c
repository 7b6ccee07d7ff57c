/* The chunk map: every chunk this process knows of, the node-local cache of verified chunks (LRU,
 * bounded in bytes), fetching from the store and checking each chunk against its digest.
 *
 * A chunk is served only when `verified` is set: this process hashed its bytes (fetched from the store,
 * or read back from the cache file the first time after the process started). A chunk that does not
 * hash to its name (or is missing) is never served: the read fails with EIO and an image_corrupt
 * event names it (ctl.c).
 *
 * Eviction: least recently used first, and chunks of no open layer before chunks an open (mounted, or a
 * VM's drive) layer names; the latter only while the store answers (so they can be fetched again).
 * Chunks being read (pinned) or fetched are never evicted.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "chunkd.h"

static pthread_mutex_t cmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ccv = PTHREAD_COND_INITIALIZER;
static struct centry **buckets;
static size_t nbuckets = 1 << 16, nentries;
static struct centry *lru_head, *lru_tail; /* cached entries, least recently used first */
static struct centry *fd_head, *fd_tail;   /* entries with an open fd, least recently used first */
static int nfds;
static uint64_t cache_bytes;
volatile int g_store_ok = 1;

#define BAD_RETRY_S 5.0

static size_t bucket_of(const uint8_t *dig, size_t n)
{
    uint64_t h;
    memcpy(&h, dig, sizeof(h));
    return (size_t)(h % n);
}

static void grow(void)
{
    size_t nn = nbuckets * 4;
    struct centry **nb = calloc(nn, sizeof(*nb));
    if (!nb)
        return;
    for (size_t i = 0; i < nbuckets; i++) {
        struct centry *e = buckets[i];
        while (e) {
            struct centry *next = e->hnext;
            size_t b = bucket_of(e->dig, nn);
            e->hnext = nb[b];
            nb[b] = e;
            e = next;
        }
    }
    free(buckets);
    buckets = nb;
    nbuckets = nn;
}

static struct centry *find(const uint8_t *dig)
{
    for (struct centry *e = buckets[bucket_of(dig, nbuckets)]; e; e = e->hnext)
        if (!memcmp(e->dig, dig, DIGEST_LEN))
            return e;
    return NULL;
}

static struct centry *insert(const uint8_t *dig, uint32_t len)
{
    if (nentries > nbuckets)
        grow();
    struct centry *e = calloc(1, sizeof(*e));
    if (!e)
        return NULL;
    memcpy(e->dig, dig, DIGEST_LEN);
    e->len = len;
    e->fd = -1;
    size_t b = bucket_of(dig, nbuckets);
    e->hnext = buckets[b];
    buckets[b] = e;
    nentries++;
    return e;
}

static void remove_entry(struct centry *e)
{
    struct centry **pp = &buckets[bucket_of(e->dig, nbuckets)];
    while (*pp && *pp != e)
        pp = &(*pp)->hnext;
    if (*pp)
        *pp = e->hnext;
    nentries--;
    free(e);
}

/* ---- lists ---------------------------------------------------------------------------------- */
static void lru_unlink(struct centry *e)
{
    if (e->lprev)
        e->lprev->lnext = e->lnext;
    else if (lru_head == e)
        lru_head = e->lnext;
    else
        return; /* not on the list */
    if (e->lnext)
        e->lnext->lprev = e->lprev;
    else
        lru_tail = e->lprev;
    e->lprev = e->lnext = NULL;
}

static void lru_append(struct centry *e)
{
    e->lprev = lru_tail;
    e->lnext = NULL;
    if (lru_tail)
        lru_tail->lnext = e;
    else
        lru_head = e;
    lru_tail = e;
}

static int on_lru(struct centry *e) { return e->lprev || lru_head == e; }

static void fd_unlink(struct centry *e)
{
    if (e->fprev)
        e->fprev->fnext = e->fnext;
    else if (fd_head == e)
        fd_head = e->fnext;
    else
        return;
    if (e->fnext)
        e->fnext->fprev = e->fprev;
    else
        fd_tail = e->fprev;
    e->fprev = e->fnext = NULL;
}

static void fd_append(struct centry *e)
{
    e->fprev = fd_tail;
    e->fnext = NULL;
    if (fd_tail)
        fd_tail->fnext = e;
    else
        fd_head = e;
    fd_tail = e;
}

static void close_fd(struct centry *e)
{
    if (e->fd >= 0) {
        close(e->fd);
        e->fd = -1;
        nfds--;
        fd_unlink(e);
    }
}

/* ---- paths ---------------------------------------------------------------------------------- */
static void store_path(const struct centry *e, char *out, size_t n)
{
    char hex[HEX_LEN + 1];
    to_hex(e->dig, hex);
    snprintf(out, n, "%s/chunks/sha256/%.2s/%s.zst", cfg.store, hex, hex);
}

static void cache_path(const struct centry *e, char *out, size_t n)
{
    char hex[HEX_LEN + 1];
    to_hex(e->dig, hex);
    snprintf(out, n, "%s/%.2s/%s", cfg.cache, hex, hex);
}

/* ---- startup -------------------------------------------------------------------------------- */
struct found {
    uint8_t dig[DIGEST_LEN];
    uint32_t len;
    double mtime;
};

static int by_mtime(const void *a, const void *b)
{
    double x = ((const struct found *)a)->mtime, y = ((const struct found *)b)->mtime;
    return x < y ? -1 : x > y;
}

static void evict_locked(const struct centry *keep);

int cache_init(void)
{
    buckets = calloc(nbuckets, sizeof(*buckets));
    if (!buckets)
        return -ENOMEM;
    char path[4096];
    int rc = mkdirs(cfg.cache, 0700);
    if (rc)
        return rc;
    snprintf(path, sizeof(path), "%s/tmp", cfg.cache);
    if ((rc = mkdirs(path, 0700)))
        return rc;
    /* half-written copies of a previous process */
    DIR *d = opendir(path);
    if (d) {
        struct dirent *de;
        while ((de = readdir(d)))
            if (de->d_name[0] != '.') {
                char p[4200];
                snprintf(p, sizeof(p), "%s/%s", path, de->d_name);
                unlink(p);
            }
        closedir(d);
    }
    /* what the cache held when the node last ran: present, re-hashed at first use; LRU by mtime */
    size_t cap = 1024, n = 0;
    struct found *fs = malloc(cap * sizeof(*fs));
    for (int a = 0; a < 256 && fs; a++) {
        char sub[4200];
        snprintf(sub, sizeof(sub), "%s/%02x", cfg.cache, a);
        DIR *sd = opendir(sub);
        if (!sd)
            continue;
        struct dirent *de;
        while ((de = readdir(sd))) {
            uint8_t dig[DIGEST_LEN];
            if (strlen(de->d_name) != HEX_LEN || from_hex(de->d_name, dig))
                continue;
            struct stat sb;
            char p[4400];
            snprintf(p, sizeof(p), "%s/%s", sub, de->d_name);
            if (stat(p, &sb) < 0 || !S_ISREG(sb.st_mode))
                continue;
            if (n == cap) {
                cap *= 2;
                struct found *nf = realloc(fs, cap * sizeof(*fs));
                if (!nf)
                    break;
                fs = nf;
            }
            memcpy(fs[n].dig, dig, DIGEST_LEN);
            fs[n].len = (uint32_t)sb.st_size;
            fs[n].mtime = (double)sb.st_mtim.tv_sec + sb.st_mtim.tv_nsec / 1e9;
            n++;
        }
        closedir(sd);
    }
    if (fs) {
        qsort(fs, n, sizeof(*fs), by_mtime);
        pthread_mutex_lock(&cmu);
        for (size_t i = 0; i < n; i++) {
            struct centry *e = insert(fs[i].dig, fs[i].len);
            if (!e)
                break;
            e->state = C_PRESENT;
            lru_append(e);
            cache_bytes += e->len;
        }
        evict_locked(NULL);
        pthread_mutex_unlock(&cmu);
        free(fs);
    }
    logmsg("chunkd: cache %s holds %zu chunks, %llu bytes (limit %llu)", cfg.cache, n,
           (unsigned long long)cache_bytes, (unsigned long long)cfg.cache_limit);
    return 0;
}

/* ---- eviction ------------------------------------------------------------------------------- */
static void drop_cached_locked(struct centry *e)
{
    char p[4400];
    cache_path(e, p, sizeof(p));
    unlink(p);
    close_fd(e);
    lru_unlink(e);
    cache_bytes -= e->len;
    e->state = C_ABSENT;
    e->verified = 0;
}

static void evict_locked(const struct centry *keep)
{
    for (int pass = 0; pass < 2 && cache_bytes > cfg.cache_limit; pass++) {
        /* pass 0: chunks no open layer names; pass 1: chunks of open layers, only while the store
         * answers (they can be fetched again) */
        if (pass == 1 && !g_store_ok)
            break;
        struct centry *e = lru_head;
        while (e && cache_bytes > cfg.cache_limit) {
            struct centry *next = e->lnext;
            if (e != keep && e->pins == 0 && e->state == C_PRESENT && (pass == 1 || e->open_refs == 0)) {
                STAT_ADD(evicted_chunks, 1);
                STAT_ADD(evicted_bytes, e->len);
                drop_cached_locked(e);
                if (e->layer_refs == 0)
                    remove_entry(e);
            }
            e = next;
        }
    }
}

void cache_set_limit(uint64_t bytes)
{
    pthread_mutex_lock(&cmu);
    cfg.cache_limit = bytes;
    evict_locked(NULL);
    pthread_mutex_unlock(&cmu);
}

void cache_usage(uint64_t *bytes, uint64_t *entries, uint64_t *of_open_layers)
{
    pthread_mutex_lock(&cmu);
    uint64_t n = 0, pl = 0;
    for (struct centry *e = lru_head; e; e = e->lnext) {
        n++;
        if (e->open_refs)
            pl += e->len;
    }
    *bytes = cache_bytes;
    *entries = n;
    *of_open_layers = pl;
    pthread_mutex_unlock(&cmu);
}

void cache_open_refs(struct chunkref *chunks, uint32_t n, int delta)
{
    pthread_mutex_lock(&cmu);
    for (uint32_t i = 0; i < n; i++)
        chunks[i].e->open_refs += delta;
    pthread_mutex_unlock(&cmu);
}

int cache_is_present(struct centry *e)
{
    pthread_mutex_lock(&cmu);
    int r = e->state == C_PRESENT && e->verified;
    pthread_mutex_unlock(&cmu);
    return r;
}

/* ---- references from tables ----------------------------------------------------------------- */
struct centry *cache_ref(const uint8_t *dig, uint32_t len)
{
    pthread_mutex_lock(&cmu);
    struct centry *e = find(dig);
    if (!e)
        e = insert(dig, len);
    if (e) {
        if (e->len != len && e->state != C_BUSY) {
            /* a cache file of another size than the table says: it is damaged; fetch it again */
            if (e->state == C_PRESENT && on_lru(e))
                drop_cached_locked(e);
            e->len = len;
        }
        e->layer_refs++;
    }
    pthread_mutex_unlock(&cmu);
    return e;
}

void cache_unref(struct centry *e)
{
    pthread_mutex_lock(&cmu);
    e->layer_refs--;
    if (e->layer_refs == 0 && e->pins == 0 && e->state == C_ABSENT)
        remove_entry(e);
    pthread_mutex_unlock(&cmu);
}

/* ---- descriptors ---------------------------------------------------------------------------- */
static int get_fd_locked(struct centry *e)
{
    if (e->fd >= 0) {
        fd_unlink(e);
        fd_append(e);
        return e->fd;
    }
    char p[4400];
    cache_path(e, p, sizeof(p));
    int fd = open(p, O_RDONLY | O_CLOEXEC | O_NOATIME);
    if (fd < 0 && errno == EPERM)
        fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -errno;
    e->fd = fd;
    nfds++;
    fd_append(e);
    for (struct centry *x = fd_head; x && nfds > cfg.max_fds;) {
        struct centry *next = x->fnext;
        if (x != e && x->pins == 0)
            close_fd(x);
        x = next;
    }
    return fd;
}

/* ---- fetch and verify ----------------------------------------------------------------------- */
static __thread uint8_t *tbuf, *zbuf;
static __thread ZSTD_DCtx *dctx;
static size_t zcap;

static uint8_t *thread_buf(void)
{
    if (!tbuf)
        tbuf = malloc(MAX_CHUNK + 1);
    if (!zbuf) {
        zcap = ZSTD_compressBound(MAX_CHUNK) + 1;
        zbuf = malloc(zcap);
    }
    if (!dctx)
        dctx = ZSTD_createDCtx();
    return tbuf && zbuf && dctx ? tbuf : NULL;
}

/* 0: the cache file holds exactly the chunk; -1: it does not (or cannot be read) */
static int verify_file(struct centry *e, uint8_t *data)
{
    char p[4400];
    cache_path(e, p, sizeof(p));
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read_full(fd, data, (size_t)e->len + 1, 0);
    close(fd);
    if (n != (ssize_t)e->len || !sha256_check(data, e->len, e->dig))
        return -1;
    STAT_ADD(verified_chunks, 1);
    STAT_ADD(verified_bytes, e->len);
    return 0;
}

/* Read a chunk from the store into `data` and check it. 0, or -EIO (with *why set when the store holds
 * a bad or no copy: "corrupt"/"missing"; NULL when the store did not answer). */
static int fetch_store(struct centry *e, uint8_t *data, const char **why)
{
    char p[4400];
    store_path(e, p, sizeof(p));
    *why = NULL;
    int fd = open(p, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT) {
            *why = "missing";
            STAT_ADD(missing_chunks, 1);
        } else {
            g_store_ok = 0;
            STAT_ADD(store_errors, 1);
        }
        return -EIO;
    }
    /* a chunk object is one zstd frame of the chunk's bytes */
    ssize_t n = read_full(fd, zbuf, zcap, 0);
    close(fd);
    if (n < 0) {
        g_store_ok = 0;
        STAT_ADD(store_errors, 1);
        return -EIO;
    }
    g_store_ok = 1;
    STAT_ADD(fetched_wire_bytes, (uint64_t)n);
    size_t got = (size_t)n < zcap ? ZSTD_decompressDCtx(dctx, data, MAX_CHUNK + 1, zbuf, (size_t)n) : 0;
    if (ZSTD_isError(got) || got != e->len || !sha256_check(data, e->len, e->dig)) {
        *why = "corrupt";
        STAT_ADD(corrupt_chunks, 1);
        return -EIO;
    }
    STAT_ADD(fetched_chunks, 1);
    STAT_ADD(fetched_bytes, e->len);
    STAT_ADD(verified_chunks, 1);
    STAT_ADD(verified_bytes, e->len);
    return 0;
}

/* Write a verified chunk into the cache; 0 when it is there now. */
static int store_in_cache(struct centry *e, const uint8_t *data)
{
    char hex[HEX_LEN + 1], tmp[4400], dst[4400], dir[4400];
    to_hex(e->dig, hex);
    snprintf(tmp, sizeof(tmp), "%s/tmp/%s.%ld", cfg.cache, hex, (long)gettid());
    snprintf(dir, sizeof(dir), "%s/%.2s", cfg.cache, hex);
    snprintf(dst, sizeof(dst), "%s/%s", dir, hex);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0400);
    if (fd < 0)
        return -errno;
    int rc = write_full(fd, data, e->len);
    close(fd);
    if (!rc && rename(tmp, dst) < 0) {
        rc = -errno;
        if (rc == -ENOENT && (mkdir(dir, 0700) == 0 || errno == EEXIST))
            rc = rename(tmp, dst) < 0 ? -errno : 0;
    }
    if (rc)
        unlink(tmp);
    return rc;
}

/* Make `e` present and verified (or fail); with `buf`, copy [off, off+len) of it there. */
static int ensure(struct centry *e, const char *layer, void *buf, uint32_t off, uint32_t len, int prefetch)
{
    pthread_mutex_lock(&cmu);
    e->pins++; /* keeps the entry alive while we wait or fetch */
    for (;;) {
        if (e->bad_until > mono_now()) {
            e->pins--;
            pthread_mutex_unlock(&cmu);
            return -EIO;
        }
        if (e->state == C_PRESENT && e->verified) {
            if (!buf) {
                e->pins--;
                pthread_mutex_unlock(&cmu);
                return 0;
            }
            int fd = get_fd_locked(e);
            if (fd < 0) {
                /* the file went away under us (removed by hand): fetch it again */
                if (on_lru(e))
                    drop_cached_locked(e);
                e->state = C_ABSENT;
                e->verified = 0;
                continue;
            }
            if (on_lru(e)) {
                lru_unlink(e);
                lru_append(e);
            }
            pthread_mutex_unlock(&cmu);
            ssize_t r = read_full(fd, buf, len, off);
            pthread_mutex_lock(&cmu);
            if (r == (ssize_t)len) {
                e->pins--;
                pthread_mutex_unlock(&cmu);
                STAT_ADD(hits, 1);
                return 0;
            }
            /* a cached copy that cannot be read back: forget it and fetch again */
            if (on_lru(e))
                drop_cached_locked(e);
            continue;
        }
        if (e->state == C_BUSY) {
            pthread_cond_wait(&ccv, &cmu);
            continue;
        }
        int was_cached = e->state == C_PRESENT;
        e->state = C_BUSY;
        pthread_mutex_unlock(&cmu);

        uint8_t *data = thread_buf();
        int rc = data ? 0 : -ENOMEM;
        const char *why = NULL;
        int cached = 0;
        if (!rc && was_cached && verify_file(e, data) == 0) {
            cached = 1; /* the copy of an earlier process: good */
        } else if (!rc) {
            if (was_cached) {
                /* a damaged cache file: drop it, then fetch the chunk again */
                pthread_mutex_lock(&cmu);
                if (on_lru(e))
                    drop_cached_locked(e);
                pthread_mutex_unlock(&cmu);
            }
            rc = fetch_store(e, data, &why);
            if (!rc) {
                if (prefetch)
                    STAT_ADD(prefetched_chunks, 1);
                cached = store_in_cache(e, data) == 0;
            }
        }
        pthread_mutex_lock(&cmu);
        if (!rc) {
            e->bad_until = 0;
            if (cached) {
                e->state = C_PRESENT;
                e->verified = 1;
                if (!on_lru(e)) {
                    lru_append(e);
                    cache_bytes += e->len;
                }
                evict_locked(e);
            } else {
                e->state = C_ABSENT; /* served from memory; the cache could not take it */
            }
            if (!was_cached || !cached)
                STAT_ADD(misses, 1);
            else
                STAT_ADD(hits, 1);
        } else {
            e->state = C_ABSENT;
            if (why)
                e->bad_until = mono_now() + BAD_RETRY_S;
        }
        int report = why && !e->reported;
        uint8_t dig[DIGEST_LEN];
        memcpy(dig, e->dig, DIGEST_LEN);
        if (report)
            e->reported = 1;
        e->pins--;
        pthread_cond_broadcast(&ccv);
        if (!rc && buf)
            memcpy(buf, data + off, len);
        if (!rc && e->layer_refs == 0 && e->pins == 0 && e->state == C_ABSENT)
            remove_entry(e);
        pthread_mutex_unlock(&cmu);
        if (report)
            event_corrupt(layer, dig, why);
        return rc;
    }
}

int cache_read(struct centry *e, const char *layer, void *buf, uint32_t off, uint32_t len)
{
    return ensure(e, layer, buf, off, len, 0);
}

int cache_fetch(struct centry *e, const char *layer, int prefetch)
{
    return ensure(e, layer, NULL, 0, 0, prefetch);
}
