/* A minimal JSON parser (into an arena-allocated tree) and a streaming writer.
 *
 * Byte strings that are not valid UTF-8 travel as Python's "surrogateescape": each invalid
 * byte 0xXY (0x80..0xFF) is written as the escape \udcXY, and the parser turns such a lone
 * surrogate back into the raw byte. So non-UTF-8 file names round-trip through the client. */
#ifndef SHOAL_JSON_H
#define SHOAL_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "buf.h"

enum jtype { JV_NULL, JV_BOOL, JV_NUM, JV_STR, JV_ARR, JV_OBJ };

struct jv {
	uint8_t type;
	uint8_t isint;       /* JV_NUM: integral and fits int64 */
	uint32_t len;        /* JV_STR: byte length; JV_ARR/JV_OBJ: number of children */
	const char *key;     /* set when this value is an object member (NUL-terminated) */
	struct jv *next;     /* next sibling */
	union {
		char *s;     /* NUL-terminated; may contain NULs (check len) */
		int64_t i;
		double d;
		int b;
		struct jv *kids;
	} u;
};

struct jarena_block;
struct jarena {
	struct jarena_block *head;
};

/* Parse `len` bytes. Returns the root or NULL with a static message in *err. */
struct jv *json_parse(struct jarena *a, const char *s, size_t len, const char **err);
void jarena_free(struct jarena *a);

struct jv *jv_get(const struct jv *obj, const char *key);
/* Field accessors: return 0 when absent (leaving *out untouched), 1 when present and well
 * typed, -1 when present but of the wrong type. */
int jv_str(const struct jv *obj, const char *key, const char **out, size_t *len);
int jv_int(const struct jv *obj, const char *key, int64_t *out);
int jv_bool(const struct jv *obj, const char *key, int *out);

/* Streaming writer appending to a buf. */
struct jw {
	struct buf *b;
	uint64_t first;  /* bit d set: no element written yet at depth d */
	int depth;
	int after_key;
};

void jw_init(struct jw *w, struct buf *b);
void jw_obj(struct jw *w);
void jw_obj_end(struct jw *w);
void jw_arr(struct jw *w);
void jw_arr_end(struct jw *w);
void jw_key(struct jw *w, const char *k);
void jw_str(struct jw *w, const char *s, size_t n);
void jw_cstr(struct jw *w, const char *s);
void jw_int(struct jw *w, int64_t v);
void jw_double(struct jw *w, double v);
void jw_bool(struct jw *w, int v);
void jw_null(struct jw *w);
/* Raw string contents with JSON escaping (no quotes), for building strings piecewise. */
void json_escape(struct buf *b, const char *s, size_t n);

#endif
