/* Layers: the binary chunk tables the node writes into <tables>/, loaded when the kernel looks a layer
 * up; reads of a layer file become reads of its chunks; which chunks were read first (the record a
 * later create prefetches); the background fetch queue (read-ahead and prefetch).
 *
 * Table file: "SHCT0001", u64 size, u32 n, u32 0, then n x {u64 offset, u32 length, u32 0, u8 sha256[32]}
 * (little endian). Chunks are contiguous and cover [0, size).
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "chunkd.h"

static pthread_mutex_t lmu = PTHREAD_MUTEX_INITIALIZER;
static struct layer *layers;
static uint64_t next_ino = 2;

void layers_init(void) {}

static int valid_name(const char *name, char *hex)
{
    size_t n = strlen(name);
    uint8_t tmp[DIGEST_LEN];
    if (n != HEX_LEN + 6 || strcmp(name + HEX_LEN, ".erofs"))
        return 0;
    memcpy(hex, name, HEX_LEN);
    hex[HEX_LEN] = 0;
    return from_hex(hex, tmp) == 0;
}

static void free_layer(struct layer *l)
{
    for (uint32_t i = 0; i < l->n; i++)
        if (l->chunks[i].e)
            cache_unref(l->chunks[i].e);
    free(l->chunks);
    free(l->touched);
    free(l->order);
    free(l);
}

/* Load and check <tables>/<hex>; NULL (errno set) when absent or malformed. */
static struct layer *load(const char *hex)
{
    char path[4200];
    snprintf(path, sizeof(path), "%s/%s", cfg.tables, hex);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return NULL;
    struct stat sb;
    uint8_t *buf = NULL;
    struct layer *l = NULL;
    if (fstat(fd, &sb) < 0 || sb.st_size < 24 || sb.st_size > (1 << 30))
        goto bad;
    buf = malloc((size_t)sb.st_size);
    if (!buf || read_full(fd, buf, (size_t)sb.st_size, 0) != sb.st_size)
        goto bad;
    if (memcmp(buf, TABLE_MAGIC, 8))
        goto bad;
    uint64_t size;
    uint32_t n;
    memcpy(&size, buf + 8, 8);
    memcpy(&n, buf + 16, 4);
    if ((uint64_t)sb.st_size != 24 + (uint64_t)n * 48)
        goto bad;
    l = calloc(1, sizeof(*l));
    if (!l)
        goto bad;
    memcpy(l->hex, hex, HEX_LEN + 1);
    l->size = size;
    l->n = n;
    l->chunks = calloc(n ? n : 1, sizeof(*l->chunks));
    l->touched = calloc(n / 8 + 1, 1);
    l->order = malloc((n ? n : 1) * sizeof(uint32_t));
    if (!l->chunks || !l->touched || !l->order)
        goto bad;
    memset(l->order, 0xff, (n ? n : 1) * sizeof(uint32_t));
    uint64_t expect = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *p = buf + 24 + (size_t)i * 48;
        uint64_t off;
        uint32_t len;
        memcpy(&off, p, 8);
        memcpy(&len, p + 8, 4);
        if (off != expect || len == 0 || len > MAX_CHUNK)
            goto bad;
        expect += len;
        l->chunks[i].off = off;
        l->chunks[i].len = len;
        l->chunks[i].e = cache_ref(p + 16, len);
        if (!l->chunks[i].e)
            goto bad;
    }
    if (expect != size)
        goto bad;
    free(buf);
    close(fd);
    return l;
bad:
    logmsg("chunkd: table %s is malformed", hex);
    if (l)
        free_layer(l);
    free(buf);
    close(fd);
    errno = EIO;
    return NULL;
}

struct layer *layer_lookup(const char *name)
{
    char hex[HEX_LEN + 1];
    if (!valid_name(name, hex)) {
        errno = ENOENT;
        return NULL;
    }
    pthread_mutex_lock(&lmu);
    for (struct layer *l = layers; l; l = l->next)
        if (!strcmp(l->hex, hex)) {
            l->nlookup++;
            pthread_mutex_unlock(&lmu);
            return l;
        }
    pthread_mutex_unlock(&lmu);
    struct layer *nl = load(hex);
    if (!nl)
        return NULL;
    pthread_mutex_lock(&lmu);
    for (struct layer *l = layers; l; l = l->next)
        if (!strcmp(l->hex, hex)) { /* loaded meanwhile by another thread */
            l->nlookup++;
            pthread_mutex_unlock(&lmu);
            free_layer(nl);
            return l;
        }
    nl->ino = next_ino++;
    nl->nlookup = 1;
    nl->next = layers;
    layers = nl;
    pthread_mutex_unlock(&lmu);
    return nl;
}

struct layer *layer_by_ino(uint64_t ino)
{
    pthread_mutex_lock(&lmu);
    struct layer *l = layers;
    while (l && l->ino != ino)
        l = l->next;
    pthread_mutex_unlock(&lmu);
    return l;
}

static void maybe_free_locked(struct layer *l)
{
    if (l->nlookup || l->opens || l->busy)
        return;
    struct layer **pp = &layers;
    while (*pp && *pp != l)
        pp = &(*pp)->next;
    if (*pp)
        *pp = l->next;
    free_layer(l);
}

void layer_forget(uint64_t ino, uint64_t n)
{
    pthread_mutex_lock(&lmu);
    for (struct layer *l = layers; l; l = l->next)
        if (l->ino == ino) {
            l->nlookup = l->nlookup > n ? l->nlookup - n : 0;
            maybe_free_locked(l);
            break;
        }
    pthread_mutex_unlock(&lmu);
}

int layer_open(uint64_t ino)
{
    int rc = -ENOENT;
    pthread_mutex_lock(&lmu);
    for (struct layer *l = layers; l; l = l->next)
        if (l->ino == ino) {
            if (l->opens++ == 0)
                cache_open_refs(l->chunks, l->n, 1);
            rc = 0;
            break;
        }
    pthread_mutex_unlock(&lmu);
    return rc;
}

void layer_release(uint64_t ino)
{
    pthread_mutex_lock(&lmu);
    for (struct layer *l = layers; l; l = l->next)
        if (l->ino == ino) {
            if (l->opens > 0 && --l->opens == 0)
                cache_open_refs(l->chunks, l->n, -1);
            maybe_free_locked(l);
            break;
        }
    pthread_mutex_unlock(&lmu);
}

static uint32_t chunk_at(const struct layer *l, uint64_t off)
{
    uint32_t lo = 0, hi = l->n;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (l->chunks[mid].off <= off)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

static void note_touch(struct layer *l, uint32_t i)
{
    uint8_t bit = (uint8_t)(1u << (i & 7));
    if (__atomic_fetch_or(&l->touched[i >> 3], bit, __ATOMIC_RELAXED) & bit)
        return;
    uint32_t k = __atomic_fetch_add(&l->norder, 1, __ATOMIC_RELAXED);
    if (k < l->n)
        __atomic_store_n(&l->order[k], i, __ATOMIC_RELAXED);
}

/* Read [off, off+size) of a layer; every byte comes from a verified chunk or the read fails as a whole
 * (a short FUSE read would be taken for end of file and zero-filled). */
ssize_t layer_read(struct layer *l, char *buf, uint64_t off, uint32_t size)
{
    if (off >= l->size || !size)
        return 0;
    if (size > l->size - off)
        size = (uint32_t)(l->size - off);
    uint32_t i = chunk_at(l, off), done = 0, last = i;
    while (done < size) {
        struct chunkref *c = &l->chunks[i];
        uint64_t at = off + done;
        uint32_t co = (uint32_t)(at - c->off);
        uint32_t n = c->len - co;
        if (n > size - done)
            n = size - done;
        note_touch(l, i);
        int rc = cache_read(c->e, l->hex, buf + done, co, n);
        if (rc)
            return rc;
        done += n;
        last = i;
        i++;
    }
    STAT_ADD(reads, 1);
    STAT_ADD(read_bytes, size);
    if (cfg.trace) {
        static pthread_mutex_t tmu = PTHREAD_MUTEX_INITIALIZER;
        static FILE *tf;
        pthread_mutex_lock(&tmu);
        if (!tf)
            tf = fopen(cfg.trace, "a");
        if (tf) {
            fprintf(tf, "%s %llu %u\n", l->hex, (unsigned long long)off, size);
            fflush(tf);
        }
        pthread_mutex_unlock(&tmu);
    }
    if (cfg.readahead) {
        uint64_t ahead = 0;
        for (uint32_t j = last + 1; j < l->n && ahead < cfg.readahead; j++) {
            ahead += l->chunks[j].len;
            if (!cache_is_present(l->chunks[j].e))
                fetch_queue_push(l->chunks[j].e, l->hex, 0);
        }
    }
    return size;
}

char *layer_touched_json(const char *hex)
{
    pthread_mutex_lock(&lmu);
    struct layer *l = layers;
    while (l && strcmp(l->hex, hex))
        l = l->next;
    if (!l) {
        pthread_mutex_unlock(&lmu);
        return NULL;
    }
    uint32_t k = __atomic_load_n(&l->norder, __ATOMIC_RELAXED);
    if (k > l->n)
        k = l->n;
    size_t cap = 32 + (size_t)k * 11, len = 0;
    char *out = malloc(cap);
    if (!out) {
        pthread_mutex_unlock(&lmu);
        return NULL;
    }
    len += (size_t)snprintf(out, cap, "[");
    int first = 1;
    for (uint32_t j = 0; j < k; j++) {
        uint32_t v = __atomic_load_n(&l->order[j], __ATOMIC_RELAXED);
        if (v == UINT32_MAX)
            continue;
        len += (size_t)snprintf(out + len, cap - len, first ? "%u" : ",%u", v);
        first = 0;
    }
    snprintf(out + len, cap - len, "]");
    pthread_mutex_unlock(&lmu);
    return out;
}

/* ---- background fetches --------------------------------------------------------------------- */
struct job {
    struct centry *e;
    char layer[HEX_LEN + 1];
    int prefetch;
};

#define QCAP 65536
static struct job *queue;
static size_t qhead, qlen;
static pthread_mutex_t qmu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t qcv = PTHREAD_COND_INITIALIZER;
static int active; /* jobs being run now */

int fetch_queue_idle(void)
{
    pthread_mutex_lock(&qmu);
    int idle = qlen == 0 && active == 0;
    pthread_mutex_unlock(&qmu);
    return idle;
}

void fetch_queue_push(struct centry *e, const char *layer, int prefetch)
{
    /* a reference keeps the entry alive until the job ran */
    struct centry *ref = cache_ref(e->dig, e->len);
    if (!ref)
        return;
    pthread_mutex_lock(&qmu);
    if (!queue || qlen == QCAP) {
        pthread_mutex_unlock(&qmu);
        cache_unref(ref);
        return;
    }
    struct job *j = &queue[(qhead + qlen) % QCAP];
    j->e = ref;
    memcpy(j->layer, layer, HEX_LEN + 1);
    j->prefetch = prefetch;
    qlen++;
    pthread_cond_signal(&qcv);
    pthread_mutex_unlock(&qmu);
}

static void *fetcher(void *arg)
{
    for (;;) {
        pthread_mutex_lock(&qmu);
        while (!qlen)
            pthread_cond_wait(&qcv, &qmu);
        struct job j = queue[qhead];
        qhead = (qhead + 1) % QCAP;
        qlen--;
        active++;
        pthread_mutex_unlock(&qmu);
        cache_fetch(j.e, j.layer, j.prefetch);
        cache_unref(j.e);
        pthread_mutex_lock(&qmu);
        active--;
        pthread_mutex_unlock(&qmu);
    }
    return NULL;
}

void fetchers_start(void)
{
    queue = calloc(QCAP, sizeof(*queue));
    for (int i = 0; i < cfg.fetchers; i++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 256 << 10);
        pthread_create(&t, &a, fetcher, NULL);
        pthread_attr_destroy(&a);
    }
}

/* Queue the chunks `list` ("3,17,18,…": indexes into the layer's table) for a background fetch. */
int layer_prefetch(const char *hex, const char *list, int *queued)
{
    *queued = 0;
    pthread_mutex_lock(&lmu);
    struct layer *l = layers;
    while (l && strcmp(l->hex, hex))
        l = l->next;
    if (l)
        l->busy++; /* keep it while we queue */
    pthread_mutex_unlock(&lmu);
    struct layer *own = NULL;
    if (!l) {
        own = load(hex);
        if (!own)
            return -ENOENT;
        l = own;
    }
    const char *p = list;
    while (*p) {
        char *end;
        unsigned long i = strtoul(p, &end, 10);
        if (end == p)
            break;
        if (i < l->n && !cache_is_present(l->chunks[i].e)) {
            fetch_queue_push(l->chunks[i].e, hex, 1);
            (*queued)++;
        }
        p = *end == ',' ? end + 1 : end;
    }
    if (own) {
        free_layer(own);
    } else {
        pthread_mutex_lock(&lmu);
        l->busy--;
        maybe_free_locked(l);
        pthread_mutex_unlock(&lmu);
    }
    return 0;
}

int layers_list(char ***names)
{
    DIR *d = opendir(cfg.tables);
    size_t cap = 16, n = 0;
    char **out = malloc(cap * sizeof(*out));
    if (!d || !out) {
        if (d)
            closedir(d);
        free(out);
        *names = NULL;
        return 0;
    }
    struct dirent *de;
    while ((de = readdir(d))) {
        uint8_t tmp[DIGEST_LEN];
        if (strlen(de->d_name) != HEX_LEN || from_hex(de->d_name, tmp))
            continue;
        if (n == cap) {
            cap *= 2;
            char **no = realloc(out, cap * sizeof(*out));
            if (!no)
                break;
            out = no;
        }
        out[n] = malloc(HEX_LEN + 7);
        if (!out[n])
            break;
        snprintf(out[n], HEX_LEN + 7, "%s.erofs", de->d_name);
        n++;
    }
    closedir(d);
    *names = out;
    return (int)n;
}
