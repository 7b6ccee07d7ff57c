/* The FUSE side: a flat, read-only directory with one file per layer, spoken directly on /dev/fuse.
 *
 * Only what a file-backed EROFS mount, QEMU and `ls` need is implemented (lookup, getattr, open, read,
 * release, readdir, statfs, forget); everything else answers ENOSYS. Layer files are immutable, so their
 * attributes are cached for long and their pages kept between opens (FOPEN_KEEP_CACHE); directory entries
 * are not cached (entry_valid 0), so the kernel forgets a layer soon after its last user and the daemon
 * frees its table.
 */
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "chunkd.h"

#define MAX_READ (1u << 20)
#define IN_BUF (MAX_READ + 8192)

static int fuse_fd = -1;
static uint32_t proto_minor = 38;

static int reply(uint64_t unique, int error, const void *data, size_t len)
{
    struct fuse_out_header h = {.len = (uint32_t)(sizeof(h) + (error ? 0 : len)), .error = error, .unique = unique};
    struct iovec iov[2] = {{&h, sizeof(h)}, {(void *)data, error ? 0 : len}};
    ssize_t r = writev(fuse_fd, iov, (error || !len) ? 1 : 2);
    /* ENOENT: the request was interrupted and is gone; nothing to do */
    return r < 0 ? -errno : 0;
}

static void fill_attr(struct fuse_attr *a, uint64_t ino, const struct layer *l)
{
    memset(a, 0, sizeof(*a));
    a->ino = ino;
    if (l) {
        a->size = l->size;
        a->blocks = (l->size + 511) / 512;
        a->mode = S_IFREG | 0444;
        a->nlink = 1;
    } else {
        a->mode = S_IFDIR | 0555;
        a->nlink = 2;
    }
    a->blksize = 4096;
}

static void do_init(uint64_t unique, const struct fuse_init_in *in)
{
    struct fuse_init_out out;
    memset(&out, 0, sizeof(out));
    out.major = FUSE_KERNEL_VERSION;
    out.minor = in->minor < FUSE_KERNEL_MINOR_VERSION ? in->minor : FUSE_KERNEL_MINOR_VERSION;
    proto_minor = out.minor;
    out.max_readahead = in->max_readahead < MAX_READ ? in->max_readahead : MAX_READ;
    uint32_t want = FUSE_ASYNC_READ | FUSE_BIG_WRITES | FUSE_MAX_PAGES | FUSE_ASYNC_DIO | FUSE_PARALLEL_DIROPS;
    out.flags = in->flags & want;
    out.max_background = 64;
    out.congestion_threshold = 48;
    out.max_write = 4096;
    out.time_gran = 1;
    out.max_pages = MAX_READ / 4096;
    size_t len = sizeof(out);
    if (out.minor < 23)
        len = FUSE_COMPAT_22_INIT_OUT_SIZE;
    reply(unique, 0, &out, len);
}

static void do_lookup(uint64_t unique, uint64_t parent, const char *name)
{
    if (parent != FUSE_ROOT_ID) {
        reply(unique, -ENOENT, NULL, 0);
        return;
    }
    struct layer *l = layer_lookup(name);
    if (!l) {
        reply(unique, errno == EIO ? -EIO : -ENOENT, NULL, 0);
        return;
    }
    struct fuse_entry_out out;
    memset(&out, 0, sizeof(out));
    out.nodeid = l->ino;
    out.entry_valid = 0;
    out.attr_valid = 3600;
    fill_attr(&out.attr, l->ino, l);
    reply(unique, 0, &out, sizeof(out));
}

static void do_getattr(uint64_t unique, uint64_t nodeid)
{
    struct fuse_attr_out out;
    memset(&out, 0, sizeof(out));
    if (nodeid == FUSE_ROOT_ID) {
        fill_attr(&out.attr, nodeid, NULL);
        out.attr_valid = 1;
    } else {
        struct layer *l = layer_by_ino(nodeid);
        if (!l) {
            reply(unique, -ENOENT, NULL, 0);
            return;
        }
        fill_attr(&out.attr, nodeid, l);
        out.attr_valid = 3600;
    }
    reply(unique, 0, &out, sizeof(out));
}

static void do_open(uint64_t unique, uint64_t nodeid, const struct fuse_open_in *in)
{
    if ((in->flags & O_ACCMODE) != O_RDONLY) {
        reply(unique, -EROFS, NULL, 0);
        return;
    }
    int rc = layer_open(nodeid);
    if (rc) {
        reply(unique, rc, NULL, 0);
        return;
    }
    struct fuse_open_out out;
    memset(&out, 0, sizeof(out));
    /* the layer itself: it stays loaded while open (reads need no lookup) */
    out.fh = (uint64_t)(uintptr_t)layer_by_ino(nodeid);
    out.open_flags = FOPEN_KEEP_CACHE;
    reply(unique, 0, &out, sizeof(out));
}

static void do_read(uint64_t unique, uint64_t nodeid, const struct fuse_read_in *in, char *out)
{
    struct layer *l = (struct layer *)(uintptr_t)in->fh;
    if (!l) {
        reply(unique, -EBADF, NULL, 0);
        return;
    }
    uint32_t size = in->size > MAX_READ ? MAX_READ : in->size;
    ssize_t n = layer_read(l, out, in->offset, size);
    if (n < 0) {
        STAT_ADD(eio, 1);
        reply(unique, (int)n, NULL, 0);
        return;
    }
    reply(unique, 0, out, (size_t)n);
}

static size_t add_dirent(char *buf, size_t cap, size_t at, uint64_t ino, uint64_t off, const char *name,
                         uint32_t type)
{
    size_t nl = strlen(name);
    size_t entlen = FUSE_NAME_OFFSET + nl;
    size_t padded = FUSE_DIRENT_ALIGN(entlen);
    if (at + padded > cap)
        return 0;
    struct fuse_dirent *d = (struct fuse_dirent *)(buf + at);
    d->ino = ino;
    d->off = off;
    d->namelen = (uint32_t)nl;
    d->type = type;
    memcpy(d->name, name, nl);
    memset(buf + at + entlen, 0, padded - entlen);
    return padded;
}

static void do_readdir(uint64_t unique, const struct fuse_read_in *in, char *out)
{
    char **names = NULL;
    int n = layers_list(&names);
    size_t cap = in->size < MAX_READ ? in->size : MAX_READ, at = 0;
    for (uint64_t i = in->offset; i < (uint64_t)n + 2; i++) {
        const char *name = i == 0 ? "." : i == 1 ? ".." : names[i - 2];
        size_t w = add_dirent(out, cap, at, i < 2 ? FUSE_ROOT_ID : 0xffffffffull, i + 1, name,
                              i < 2 ? S_IFDIR >> 12 : S_IFREG >> 12);
        if (!w)
            break;
        at += w;
    }
    for (int i = 0; i < n; i++)
        free(names[i]);
    free(names);
    reply(unique, 0, out, at);
}

static void do_statfs(uint64_t unique)
{
    struct fuse_statfs_out out;
    memset(&out, 0, sizeof(out));
    out.st.bsize = 4096;
    out.st.frsize = 4096;
    out.st.namelen = 255;
    reply(unique, 0, &out, sizeof(out));
}

static void *worker(void *arg)
{
    char *in = malloc(IN_BUF);
    char *out = malloc(MAX_READ);
    if (!in || !out) {
        logmsg("chunkd: out of memory");
        exit(1);
    }
    for (;;) {
        ssize_t r = read(fuse_fd, in, IN_BUF);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == ENOENT)
                continue;
            if (errno == ENODEV) /* unmounted */
                exit(0);
            logmsg("chunkd: reading /dev/fuse: %s", strerror(errno));
            exit(1);
        }
        if ((size_t)r < sizeof(struct fuse_in_header))
            continue;
        struct fuse_in_header *h = (struct fuse_in_header *)in;
        void *arg0 = in + sizeof(*h);
        switch (h->opcode) {
        case FUSE_INIT:
            do_init(h->unique, arg0);
            break;
        case FUSE_LOOKUP:
            do_lookup(h->unique, h->nodeid, arg0);
            break;
        case FUSE_FORGET:
            layer_forget(h->nodeid, ((struct fuse_forget_in *)arg0)->nlookup);
            break;
        case FUSE_BATCH_FORGET: {
            struct fuse_batch_forget_in *b = arg0;
            struct fuse_forget_one *one = (struct fuse_forget_one *)(b + 1);
            for (uint32_t i = 0; i < b->count; i++)
                layer_forget(one[i].nodeid, one[i].nlookup);
            break;
        }
        case FUSE_GETATTR:
            do_getattr(h->unique, h->nodeid);
            break;
        case FUSE_OPEN:
            do_open(h->unique, h->nodeid, arg0);
            break;
        case FUSE_READ:
            do_read(h->unique, h->nodeid, arg0, out);
            break;
        case FUSE_RELEASE:
            layer_release(h->nodeid);
            reply(h->unique, 0, NULL, 0);
            break;
        case FUSE_FLUSH:
        case FUSE_FSYNC:
        case FUSE_RELEASEDIR:
        case FUSE_ACCESS:
            reply(h->unique, 0, NULL, 0);
            break;
        case FUSE_OPENDIR: {
            if (h->nodeid != FUSE_ROOT_ID) {
                reply(h->unique, -ENOTDIR, NULL, 0);
                break;
            }
            struct fuse_open_out o;
            memset(&o, 0, sizeof(o));
            reply(h->unique, 0, &o, sizeof(o));
            break;
        }
        case FUSE_READDIR:
            do_readdir(h->unique, arg0, out);
            break;
        case FUSE_STATFS:
            do_statfs(h->unique);
            break;
        case FUSE_INTERRUPT:
            break; /* reads finish on their own; nothing to cancel */
        case FUSE_DESTROY:
            reply(h->unique, 0, NULL, 0);
            exit(0);
        default:
            reply(h->unique, -ENOSYS, NULL, 0);
        }
    }
    return NULL;
}

int fuse_mount_and_serve(void)
{
    fuse_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (fuse_fd < 0)
        return -errno;
    char opts[256];
    snprintf(opts, sizeof(opts),
             "fd=%d,rootmode=40555,user_id=0,group_id=0,allow_other,default_permissions,max_read=%u", fuse_fd,
             MAX_READ);
    if (mount("shoal-chunkd", cfg.mount, "fuse.shoal-chunkd", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY,
              opts) < 0)
        return -errno;
    for (int i = 0; i < cfg.threads; i++) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&a, 256 << 10);
        if (pthread_create(&t, &a, worker, NULL))
            return -EAGAIN;
        pthread_attr_destroy(&a);
    }
    return 0;
}

void fuse_unmount(void)
{
    if (umount2(cfg.mount, 0) < 0)
        umount2(cfg.mount, MNT_DETACH);
}
