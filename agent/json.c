#include "json.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------- arena ---------- */

struct jarena_block {
	struct jarena_block *next;
	size_t used, cap;
	_Alignas(16) unsigned char data[];
};

static void *arena_alloc(struct jarena *a, size_t n)
{
	n = (n + 15) & ~(size_t)15;
	struct jarena_block *b = a->head;
	if (!b || b->cap - b->used < n) {
		size_t cap = n > 8192 ? n : 8192;
		b = xmalloc(sizeof *b + cap);
		b->cap = cap;
		b->used = 0;
		b->next = a->head;
		a->head = b;
	}
	void *p = b->data + b->used;
	b->used += n;
	return p;
}

void jarena_free(struct jarena *a)
{
	while (a->head) {
		struct jarena_block *n = a->head->next;
		free(a->head);
		a->head = n;
	}
}

/* ---------- parser ---------- */

struct parser {
	struct jarena *a;
	const char *s, *end;
	const char *err;
	int depth;
};

#define MAX_DEPTH 64

static void skip_ws(struct parser *p)
{
	while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r'))
		p->s++;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

static int read_hex4(struct parser *p, unsigned *out)
{
	if (p->end - p->s < 4)
		return -1;
	unsigned v = 0;
	for (int i = 0; i < 4; i++) {
		int h = hexval(p->s[i]);
		if (h < 0)
			return -1;
		v = (v << 4) | (unsigned)h;
	}
	p->s += 4;
	*out = v;
	return 0;
}

static char *put_utf8(char *o, unsigned cp)
{
	if (cp < 0x80) {
		*o++ = (char)cp;
	} else if (cp < 0x800) {
		*o++ = (char)(0xC0 | (cp >> 6));
		*o++ = (char)(0x80 | (cp & 0x3F));
	} else if (cp < 0x10000) {
		*o++ = (char)(0xE0 | (cp >> 12));
		*o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
		*o++ = (char)(0x80 | (cp & 0x3F));
	} else {
		*o++ = (char)(0xF0 | (cp >> 18));
		*o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
		*o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
		*o++ = (char)(0x80 | (cp & 0x3F));
	}
	return o;
}

/* On entry p->s points after the opening quote. Decoded output is never longer than input. */
static char *parse_string(struct parser *p, uint32_t *outlen)
{
	const char *q = p->s;
	while (q < p->end && *q != '"') {
		if (*q == '\\')
			q++;
		q++;
	}
	if (q >= p->end) {
		p->err = "unterminated string";
		return NULL;
	}
	char *out = arena_alloc(p->a, (size_t)(q - p->s) + 1);
	char *o = out;
	while (p->s < p->end && *p->s != '"') {
		char c = *p->s++;
		if (c != '\\') {
			*o++ = c;
			continue;
		}
		if (p->s >= p->end) {
			p->err = "bad escape";
			return NULL;
		}
		c = *p->s++;
		switch (c) {
		case '"': *o++ = '"'; break;
		case '\\': *o++ = '\\'; break;
		case '/': *o++ = '/'; break;
		case 'b': *o++ = '\b'; break;
		case 'f': *o++ = '\f'; break;
		case 'n': *o++ = '\n'; break;
		case 'r': *o++ = '\r'; break;
		case 't': *o++ = '\t'; break;
		case 'u': {
			unsigned cp;
			if (read_hex4(p, &cp) < 0) {
				p->err = "bad \\u escape";
				return NULL;
			}
			if (cp >= 0xD800 && cp <= 0xDBFF && p->end - p->s >= 6 && p->s[0] == '\\' &&
			    p->s[1] == 'u') {
				const char *save = p->s;
				unsigned lo;
				p->s += 2;
				if (read_hex4(p, &lo) == 0 && lo >= 0xDC00 && lo <= 0xDFFF) {
					cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
				} else {
					p->s = save;
				}
			}
			if (cp >= 0xDC80 && cp <= 0xDCFF) {
				*o++ = (char)(cp - 0xDC00); /* surrogateescape: a raw byte */
			} else if (cp >= 0xD800 && cp <= 0xDFFF) {
				o = put_utf8(o, 0xFFFD); /* other lone surrogate: replacement char */
			} else {
				o = put_utf8(o, cp);
			}
			break;
		}
		default:
			p->err = "bad escape";
			return NULL;
		}
	}
	p->s++; /* closing quote */
	*o = 0;
	*outlen = (uint32_t)(o - out);
	return out;
}

static int parse_number(struct parser *p, struct jv *v)
{
	const char *start = p->s;
	int neg = 0;
	if (p->s < p->end && *p->s == '-') {
		neg = 1;
		p->s++;
	}
	if (p->s >= p->end || *p->s < '0' || *p->s > '9') {
		p->err = "bad number";
		return -1;
	}
	uint64_t acc = 0;
	int overflow = 0;
	while (p->s < p->end && *p->s >= '0' && *p->s <= '9') {
		unsigned d = (unsigned)(*p->s - '0');
		if (acc > (UINT64_MAX - d) / 10)
			overflow = 1;
		else
			acc = acc * 10 + d;
		p->s++;
	}
	int isint = !overflow;
	if (p->s < p->end && *p->s == '.') {
		isint = 0;
		p->s++;
		if (p->s >= p->end || *p->s < '0' || *p->s > '9') {
			p->err = "bad number";
			return -1;
		}
		while (p->s < p->end && *p->s >= '0' && *p->s <= '9')
			p->s++;
	}
	if (p->s < p->end && (*p->s == 'e' || *p->s == 'E')) {
		isint = 0;
		p->s++;
		if (p->s < p->end && (*p->s == '+' || *p->s == '-'))
			p->s++;
		if (p->s >= p->end || *p->s < '0' || *p->s > '9') {
			p->err = "bad number";
			return -1;
		}
		while (p->s < p->end && *p->s >= '0' && *p->s <= '9')
			p->s++;
	}
	v->type = JV_NUM;
	if (isint && acc <= (uint64_t)INT64_MAX + (uint64_t)neg) {
		v->isint = 1;
		v->u.i = neg ? (int64_t)(0 - acc) : (int64_t)acc;
		return 0;
	}
	char tmp[64];
	size_t n = (size_t)(p->s - start);
	if (n >= sizeof tmp) {
		/* Absurdly long numbers only need their magnitude. */
		v->u.d = neg ? -HUGE_VAL : HUGE_VAL;
		return 0;
	}
	memcpy(tmp, start, n);
	tmp[n] = 0;
	v->u.d = strtod(tmp, NULL);
	return 0;
}

static int parse_value(struct parser *p, struct jv *v);

static int expect_lit(struct parser *p, const char *lit)
{
	size_t n = strlen(lit);
	if ((size_t)(p->end - p->s) < n || memcmp(p->s, lit, n) != 0) {
		p->err = "unexpected token";
		return -1;
	}
	p->s += n;
	return 0;
}

static int parse_container(struct parser *p, struct jv *v, int obj)
{
	if (++p->depth > MAX_DEPTH) {
		p->err = "nested too deeply";
		return -1;
	}
	char close = obj ? '}' : ']';
	v->type = obj ? JV_OBJ : JV_ARR;
	v->len = 0;
	v->u.kids = NULL;
	struct jv **tail = &v->u.kids;
	p->s++; /* opening bracket */
	skip_ws(p);
	if (p->s < p->end && *p->s == close) {
		p->s++;
		p->depth--;
		return 0;
	}
	for (;;) {
		struct jv *kid = arena_alloc(p->a, sizeof *kid);
		memset(kid, 0, sizeof *kid);
		skip_ws(p);
		if (obj) {
			uint32_t kl;
			if (p->s >= p->end || *p->s != '"') {
				p->err = "expected key";
				return -1;
			}
			p->s++;
			char *k = parse_string(p, &kl);
			if (!k)
				return -1;
			kid->key = k;
			skip_ws(p);
			if (p->s >= p->end || *p->s != ':') {
				p->err = "expected ':'";
				return -1;
			}
			p->s++;
		}
		if (parse_value(p, kid) < 0)
			return -1;
		*tail = kid;
		tail = &kid->next;
		v->len++;
		skip_ws(p);
		if (p->s < p->end && *p->s == ',') {
			p->s++;
			continue;
		}
		if (p->s < p->end && *p->s == close) {
			p->s++;
			p->depth--;
			return 0;
		}
		p->err = obj ? "expected ',' or '}'" : "expected ',' or ']'";
		return -1;
	}
}

static int parse_value(struct parser *p, struct jv *v)
{
	skip_ws(p);
	if (p->s >= p->end) {
		p->err = "unexpected end of input";
		return -1;
	}
	switch (*p->s) {
	case '{':
		return parse_container(p, v, 1);
	case '[':
		return parse_container(p, v, 0);
	case '"':
		p->s++;
		v->type = JV_STR;
		v->u.s = parse_string(p, &v->len);
		return v->u.s ? 0 : -1;
	case 't':
		v->type = JV_BOOL;
		v->u.b = 1;
		return expect_lit(p, "true");
	case 'f':
		v->type = JV_BOOL;
		v->u.b = 0;
		return expect_lit(p, "false");
	case 'n':
		v->type = JV_NULL;
		return expect_lit(p, "null");
	default:
		return parse_number(p, v);
	}
}

struct jv *json_parse(struct jarena *a, const char *s, size_t len, const char **err)
{
	struct parser p = {.a = a, .s = s, .end = s + len, .err = NULL, .depth = 0};
	struct jv *root = arena_alloc(a, sizeof *root);
	memset(root, 0, sizeof *root);
	if (parse_value(&p, root) < 0) {
		*err = p.err ? p.err : "invalid JSON";
		return NULL;
	}
	skip_ws(&p);
	if (p.s != p.end) {
		*err = "trailing data after JSON value";
		return NULL;
	}
	return root;
}

struct jv *jv_get(const struct jv *obj, const char *key)
{
	if (!obj || obj->type != JV_OBJ)
		return NULL;
	/* Last one wins for duplicate keys, like Python's json. */
	struct jv *found = NULL;
	for (struct jv *k = obj->u.kids; k; k = k->next)
		if (strcmp(k->key, key) == 0)
			found = k;
	return found;
}

int jv_str(const struct jv *obj, const char *key, const char **out, size_t *len)
{
	struct jv *v = jv_get(obj, key);
	if (!v || v->type == JV_NULL)
		return 0;
	if (v->type != JV_STR)
		return -1;
	*out = v->u.s;
	if (len)
		*len = v->len;
	return 1;
}

int jv_int(const struct jv *obj, const char *key, int64_t *out)
{
	struct jv *v = jv_get(obj, key);
	if (!v || v->type == JV_NULL)
		return 0;
	if (v->type != JV_NUM)
		return -1;
	if (v->isint) {
		*out = v->u.i;
	} else {
		if (!(v->u.d > -9.2e18 && v->u.d < 9.2e18))
			return -1;
		*out = (int64_t)v->u.d;
	}
	return 1;
}

int jv_bool(const struct jv *obj, const char *key, int *out)
{
	struct jv *v = jv_get(obj, key);
	if (!v || v->type == JV_NULL)
		return 0;
	if (v->type != JV_BOOL)
		return -1;
	*out = v->u.b;
	return 1;
}

/* ---------- writer ---------- */

void jw_init(struct jw *w, struct buf *b)
{
	w->b = b;
	w->first = 1;
	w->depth = 0;
	w->after_key = 0;
}

static void jw_sep(struct jw *w)
{
	if (w->after_key) {
		w->after_key = 0;
		return;
	}
	uint64_t bit = (uint64_t)1 << w->depth;
	if (w->first & bit)
		w->first &= ~bit;
	else
		buf_putc(w->b, ',');
}

static void jw_open(struct jw *w, char c)
{
	jw_sep(w);
	buf_putc(w->b, (uint8_t)c);
	if (w->depth < 63)
		w->depth++;
	w->first |= (uint64_t)1 << w->depth;
}

static void jw_close(struct jw *w, char c)
{
	buf_putc(w->b, (uint8_t)c);
	if (w->depth > 0)
		w->depth--;
}

void jw_obj(struct jw *w) { jw_open(w, '{'); }
void jw_obj_end(struct jw *w) { jw_close(w, '}'); }
void jw_arr(struct jw *w) { jw_open(w, '['); }
void jw_arr_end(struct jw *w) { jw_close(w, ']'); }

void jw_key(struct jw *w, const char *k)
{
	jw_sep(w);
	buf_putc(w->b, '"');
	json_escape(w->b, k, strlen(k));
	buf_append(w->b, "\":", 2);
	w->after_key = 1;
}

/* Length of the valid UTF-8 sequence at s (1..4), or 0 if invalid. */
static size_t utf8_seq(const unsigned char *s, size_t n)
{
	unsigned c = s[0];
	if (c < 0x80)
		return 1;
	if (c >= 0xC2 && c <= 0xDF) {
		if (n >= 2 && (s[1] & 0xC0) == 0x80)
			return 2;
		return 0;
	}
	if (c >= 0xE0 && c <= 0xEF) {
		if (n < 3 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80)
			return 0;
		if (c == 0xE0 && s[1] < 0xA0)
			return 0; /* overlong */
		if (c == 0xED && s[1] >= 0xA0)
			return 0; /* UTF-16 surrogate */
		return 3;
	}
	if (c >= 0xF0 && c <= 0xF4) {
		if (n < 4 || (s[1] & 0xC0) != 0x80 || (s[2] & 0xC0) != 0x80 || (s[3] & 0xC0) != 0x80)
			return 0;
		if (c == 0xF0 && s[1] < 0x90)
			return 0;
		if (c == 0xF4 && s[1] >= 0x90)
			return 0;
		return 4;
	}
	return 0;
}

void json_escape(struct buf *b, const char *str, size_t n)
{
	static const char hex[] = "0123456789abcdef";
	const unsigned char *s = (const unsigned char *)str;
	buf_reserve(b, n + 2);
	size_t i = 0;
	while (i < n) {
		unsigned c = s[i];
		if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
			/* Fast path: copy a run of plain ASCII. */
			size_t j = i + 1;
			while (j < n && s[j] >= 0x20 && s[j] < 0x80 && s[j] != '"' && s[j] != '\\')
				j++;
			buf_append(b, s + i, j - i);
			i = j;
			continue;
		}
		if (c >= 0x80) {
			size_t k = utf8_seq(s + i, n - i);
			if (k) {
				buf_append(b, s + i, k);
				i += k;
			} else {
				char e[6] = {'\\', 'u', 'd', 'c', hex[c >> 4], hex[c & 15]};
				buf_append(b, e, 6);
				i++;
			}
			continue;
		}
		switch (c) {
		case '"': buf_append(b, "\\\"", 2); break;
		case '\\': buf_append(b, "\\\\", 2); break;
		case '\n': buf_append(b, "\\n", 2); break;
		case '\r': buf_append(b, "\\r", 2); break;
		case '\t': buf_append(b, "\\t", 2); break;
		default: {
			char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
			buf_append(b, e, 6);
		}
		}
		i++;
	}
}

void jw_str(struct jw *w, const char *s, size_t n)
{
	jw_sep(w);
	buf_putc(w->b, '"');
	json_escape(w->b, s, n);
	buf_putc(w->b, '"');
}

void jw_cstr(struct jw *w, const char *s) { jw_str(w, s, strlen(s)); }

void jw_int(struct jw *w, int64_t v)
{
	char tmp[32];
	int n = snprintf(tmp, sizeof tmp, "%lld", (long long)v);
	jw_sep(w);
	buf_append(w->b, tmp, (size_t)n);
}

void jw_double(struct jw *w, double v)
{
	char tmp[64];
	int n;
	if (!isfinite(v))
		n = snprintf(tmp, sizeof tmp, "0");
	else
		n = snprintf(tmp, sizeof tmp, "%.17g", v);
	jw_sep(w);
	buf_append(w->b, tmp, (size_t)n);
}

void jw_bool(struct jw *w, int v)
{
	jw_sep(w);
	if (v)
		buf_append(w->b, "true", 4);
	else
		buf_append(w->b, "false", 5);
}

void jw_null(struct jw *w)
{
	jw_sep(w);
	buf_append(w->b, "null", 4);
}
