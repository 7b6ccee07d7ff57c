/* Small helpers: clocks, hex, SHA-256 (libcrypto), whole reads/writes, logging. */
#include <errno.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chunkd.h"

double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

double wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

void to_hex(const uint8_t *d, char *out)
{
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < DIGEST_LEN; i++) {
        out[2 * i] = hx[d[i] >> 4];
        out[2 * i + 1] = hx[d[i] & 15];
    }
    out[HEX_LEN] = 0;
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* 64 lowercase hex chars -> 32 bytes; -1 when `s` is anything else */
int from_hex(const char *s, uint8_t *out)
{
    for (int i = 0; i < DIGEST_LEN; i++) {
        int a = hexval(s[2 * i]), b = a < 0 ? -1 : hexval(s[2 * i + 1]);
        if (a < 0 || b < 0)
            return -1;
        out[i] = (uint8_t)(a << 4 | b);
    }
    return 0;
}

/* 1 when sha256(buf) == want */
int sha256_check(const void *buf, size_t len, const uint8_t *want)
{
    uint8_t md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (!EVP_Digest(buf, len, md, &n, EVP_sha256(), NULL) || n != DIGEST_LEN)
        return 0;
    return memcmp(md, want, DIGEST_LEN) == 0;
}

/* pread until `len` bytes or EOF; bytes read or -errno */
ssize_t read_full(int fd, void *buf, size_t len, off_t off)
{
    size_t got = 0;
    while (got < len) {
        ssize_t r = pread(fd, (char *)buf + got, len - got, off + (off_t)got);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            break;
        got += (size_t)r;
    }
    return (ssize_t)got;
}

int write_full(int fd, const void *buf, size_t len)
{
    size_t done = 0;
    while (done < len) {
        ssize_t r = write(fd, (const char *)buf + done, len - done);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        done += (size_t)r;
    }
    return 0;
}

int mkdirs(const char *path, mode_t mode)
{
    char tmp[4096];
    size_t n = strlen(path);
    if (n >= sizeof(tmp))
        return -ENAMETOOLONG;
    memcpy(tmp, path, n + 1);
    for (char *p = tmp + 1; *p; p++) {
        if (*p == '/') {
            *p = 0;
            if (mkdir(tmp, mode) < 0 && errno != EEXIST)
                return -errno;
            *p = '/';
        }
    }
    if (mkdir(tmp, mode) < 0 && errno != EEXIST)
        return -errno;
    return 0;
}

void logmsg(const char *fmt, ...)
{
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    if ((size_t)n > sizeof(line) - 2)
        n = (int)sizeof(line) - 2;
    line[n++] = '\n';
    /* stderr is the daemon's log file (the node opens it); one write per line */
    ssize_t r = write(2, line, (size_t)n);
    (void)r;
}
