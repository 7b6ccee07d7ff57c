/* shoal-chunkd: serves each layer of a node as one read-only file on a FUSE mount, assembled from
 * content-addressed chunks that are checked against their SHA-256 before a byte of them is served.
 *
 *   store:  <store>/chunks/sha256/<aa>/<hex>.zst      the shared, content-addressed chunk objects
 *   tables: <tables>/<layer hex>                      binary chunk tables written by the node (trusted:
 *                                                     the node checked them against the layer digest)
 *   cache:  <cache>/<aa>/<hex>                        node-local copies of verified chunks (LRU, bounded)
 *   mount:  <mount>/<layer hex>.erofs                 one file per layer (file-backed EROFS mounts it)
 *
 * A chunk object in the store is one zstd frame of the chunk's bytes; the cache holds them decompressed.
 */
#ifndef SHOAL_CHUNKD_H
#define SHOAL_CHUNKD_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define DIGEST_LEN 32
#define HEX_LEN 64
#define TABLE_MAGIC "SHCT0001"
#define MAX_CHUNK (4u << 20) /* the largest chunk a table may name */

enum cstate { C_ABSENT = 0, C_BUSY = 1, C_PRESENT = 2 };

/* One chunk this process knows of (named by a loaded table, or found in the cache). */
struct centry {
    uint8_t dig[DIGEST_LEN];
    uint32_t len;
    uint8_t state;       /* enum cstate */
    uint8_t verified;    /* hashed by this process (cache files are re-hashed once per process) */
    uint8_t reported;    /* an image_corrupt event was emitted for it */
    int pins;            /* readers using its file right now */
    int layer_refs;      /* loaded tables naming it */
    int open_refs;       /* open layer files naming it (a mounted layer, a VM drive): "in use right now" */
    int fd;              /* open descriptor of its file, or -1 */
    double bad_until;    /* a corrupt or missing chunk fails fast until then (monotonic seconds) */
    struct centry *hnext;
    struct centry *lprev, *lnext; /* LRU list of cached (present) entries: head = least recently used */
    struct centry *fprev, *fnext; /* list of entries holding an open fd */
};

struct chunkref {
    uint64_t off;
    uint32_t len;
    struct centry *e;
};

/* One layer whose table is loaded (looked up through the FUSE mount). */
struct layer {
    char hex[HEX_LEN + 1];
    uint64_t ino;
    uint64_t size;
    uint32_t n;
    struct chunkref *chunks;
    uint64_t nlookup;
    int opens;
    int busy; /* kept loaded by a control request */
    /* the chunks read through this layer since its table was loaded, in first-touch order */
    uint8_t *touched;
    uint32_t *order;
    uint32_t norder;
    struct layer *next;
};

struct config {
    const char *mount;
    const char *tables;
    const char *store;
    const char *cache;
    const char *ctl;
    const char *events;
    const char *pidfile;
    uint64_t cache_limit;
    uint64_t readahead;   /* bytes fetched beyond a missed chunk, in the background */
    int threads;          /* FUSE request workers */
    int fetchers;         /* background fetch workers (read-ahead, prefetch) */
    int max_fds;          /* descriptors of chunk files kept open */
    int foreground;
    const char *trace; /* append "<layer> <offset> <size>" per read (measurements) */
};

struct stats {
    uint64_t reads, read_bytes;           /* FUSE reads served */
    uint64_t fetched_chunks, fetched_bytes; /* read from the store (misses, read-ahead, prefetch) */
    uint64_t fetched_wire_bytes;          /* ... as stored (compressed) */
    uint64_t prefetched_chunks;
    uint64_t hits, misses;
    uint64_t verified_chunks, verified_bytes;
    uint64_t corrupt_chunks, missing_chunks, store_errors, eio;
    uint64_t evicted_chunks, evicted_bytes;
    uint64_t served_unverified; /* must stay 0: bytes ever served from an unchecked chunk */
};

extern struct config cfg;
extern struct stats st;
extern volatile int g_store_ok;

/* util.c */
double mono_now(void);
double wall_now(void);
void to_hex(const uint8_t *d, char *out);
int from_hex(const char *s, uint8_t *out);
int sha256_check(const void *buf, size_t len, const uint8_t *want);
ssize_t read_full(int fd, void *buf, size_t len, off_t off);
int write_full(int fd, const void *buf, size_t len);
int mkdirs(const char *path, mode_t mode);
void logmsg(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define STAT_ADD(field, v) __atomic_add_fetch(&st.field, (v), __ATOMIC_RELAXED)

/* cache.c */
int cache_init(void);
struct centry *cache_ref(const uint8_t *dig, uint32_t len); /* +1 layer ref */
void cache_unref(struct centry *e);
/* copy bytes [off, off+len) of chunk e into buf, fetching and verifying it first when needed;
 * 0 or -errno. `layer` names the layer the read came through (for events). */
int cache_read(struct centry *e, const char *layer, void *buf, uint32_t off, uint32_t len);
/* make sure a chunk is present and verified (background fetch); 0 or -errno */
int cache_fetch(struct centry *e, const char *layer, int prefetch);
void cache_set_limit(uint64_t bytes);
void cache_usage(uint64_t *bytes, uint64_t *entries, uint64_t *of_open_layers);
void cache_open_refs(struct chunkref *chunks, uint32_t n, int delta);
int cache_is_present(struct centry *e);

/* layers.c */
void layers_init(void);
struct layer *layer_lookup(const char *name); /* "<hex>.erofs": load its table; +1 nlookup */
struct layer *layer_by_ino(uint64_t ino);
void layer_forget(uint64_t ino, uint64_t n);
int layer_open(uint64_t ino);
void layer_release(uint64_t ino);
ssize_t layer_read(struct layer *l, char *buf, uint64_t off, uint32_t size);
/* the chunks touched so far, as JSON array text into out (malloc'd) */
char *layer_touched_json(const char *hex);
int layer_prefetch(const char *hex, const char *list, int *queued);
int layers_list(char ***names);
void fetch_queue_push(struct centry *e, const char *layer, int prefetch);
void fetchers_start(void);

/* ctl.c */
int ctl_start(void);
void event_corrupt(const char *layer, const uint8_t *chunk, const char *why);

/* fuse.c */
int fuse_mount_and_serve(void);
void fuse_unmount(void);

#endif
