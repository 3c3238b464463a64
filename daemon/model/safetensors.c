/* safetensors: header parse with every offset checked against the file's image (our
 * own copy of it), and the set of shard files a model directory names. Nothing here
 * trusts the file. */
#include "daemon/model/safetensors.h"
#include "format/file_read.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"
#define ST_MAX_INDEX (64u << 20)	/* bytes of index.json accepted */
#define ST_SHOW 160			/* characters of a name shown in a message */

static const struct {
	const char *name;
	unsigned size;		/* bytes per element */
	int ok;			/* 1: kdec computes with it */
	enum k_dtype dtype;
} st_dtypes[] = {
	{ "F32", 4, 1, K_F32 },
	{ "F16", 2, 1, K_F16 },
	{ "BF16", 2, 1, K_BF16 },
	{ "F64", 8, 0, K_F32 },
	{ "I64", 8, 0, K_F32 },
	{ "I32", 4, 0, K_F32 },
	{ "I16", 2, 0, K_F32 },
	{ "I8", 1, 0, K_F32 },
	{ "U8", 1, 0, K_F32 },
	{ "BOOL", 1, 0, K_F32 },
	{ "F8_E4M3", 1, 0, K_F32 },
	{ "F8_E5M2", 1, 0, K_F32 },
};

#define N_DTYPES (sizeof(st_dtypes) / sizeof(st_dtypes[0]))

static int st_dtype_index(const char *s)
{
	for (size_t i = 0; i < N_DTYPES; i++)
		if (!strcmp(s, st_dtypes[i].name))
			return (int)i;
	return -1;
}

int st_dtype_parse(const char *s, enum k_dtype *out)
{
	int i = s ? st_dtype_index(s) : -1;

	if (i < 0)
		return -EINVAL;
	if (!st_dtypes[i].ok)
		return -ENOTSUP;
	*out = st_dtypes[i].dtype;
	return 0;
}

/* A file or tensor name made safe for a one-line message. */
static const char *st_show(const char *s, char *buf, size_t n)
{
	size_t i;

	for (i = 0; s[i] && i + 1 < n; i++)
		buf[i] = ((unsigned char)s[i] < 0x20 || s[i] == 0x7f) ? '?' : s[i];
	buf[i] = '\0';
	return buf;
}

/* Everything one header entry says, before it becomes an st_tensor. */
struct st_entry {
	const char *name;
	const char *file;	/* shown name of the file, for messages */
	uint64_t begin, end;
};

static int st_parse_shape(struct st_tensor *t, json_t *shape, const struct st_entry *e,
			  char *err, size_t err_len)
{
	char nb[ST_SHOW];
	json_t *d;
	size_t i;

	if (!json_is_array(shape))
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': shape is not a list",
			       e->file, st_show(e->name, nb, sizeof(nb)));
	if (json_array_size(shape) > ST_MAX_DIMS)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': %zu dims, at most %d",
			       e->file, st_show(e->name, nb, sizeof(nb)), json_array_size(shape),
			       ST_MAX_DIMS);
	t->ndim = (int)json_array_size(shape);
	json_array_foreach(shape, i, d) {
		if (!json_is_integer(d) || json_integer_value(d) < 0)
			return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': shape[%zu] is not "
				       "a non-negative integer", e->file,
				       st_show(e->name, nb, sizeof(nb)), i);
		t->shape[i] = json_integer_value(d);
	}
	return 0;
}

static int st_parse_offsets(struct st_entry *e, json_t *off, char *err, size_t err_len)
{
	char nb[ST_SHOW];
	json_t *b, *x;

	b = json_array_get(off, 0);
	x = json_array_get(off, 1);
	if (!json_is_array(off) || json_array_size(off) != 2 || !json_is_integer(b) ||
	    !json_is_integer(x) || json_integer_value(b) < 0 || json_integer_value(x) < 0)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': data_offsets is not a "
			       "pair of non-negative integers", e->file,
			       st_show(e->name, nb, sizeof(nb)));
	e->begin = (uint64_t)json_integer_value(b);
	e->end = (uint64_t)json_integer_value(x);
	return 0;
}

/* Fills t from one header entry; the data section is data_len bytes at data. */
static int st_parse_entry(struct st_tensor *t, struct st_entry *e, json_t *v,
			  const uint8_t *data, uint64_t data_len, char *err, size_t err_len)
{
	char nb[ST_SHOW], db[32];
	json_t *dt, *shape, *off;
	uint64_t n;
	int i, di, rc;

	if (!json_is_object(v))
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': entry is not an object",
			       e->file, st_show(e->name, nb, sizeof(nb)));
	dt = json_object_get(v, "dtype");
	shape = json_object_get(v, "shape");
	off = json_object_get(v, "data_offsets");
	if (!dt || !shape || !off)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': missing %s", e->file,
			       st_show(e->name, nb, sizeof(nb)),
			       !dt ? "dtype" : !shape ? "shape" : "data_offsets");
	if (!json_is_string(dt))
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': dtype is not a string",
			       e->file, st_show(e->name, nb, sizeof(nb)));
	di = st_dtype_index(json_string_value(dt));
	if (di < 0)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': unknown dtype '%s'",
			       e->file, st_show(e->name, nb, sizeof(nb)),
			       st_show(json_string_value(dt), db, sizeof(db)));
	snprintf(t->dtype_name, sizeof(t->dtype_name), "%s", st_dtypes[di].name);
	t->dtype_ok = st_dtypes[di].ok;
	t->dtype = st_dtypes[di].dtype;
	rc = st_parse_shape(t, shape, e, err, err_len);
	if (!rc)
		rc = st_parse_offsets(e, off, err, err_len);
	if (rc)
		return rc;
	n = st_dtypes[di].size;
	for (i = 0; i < t->ndim; i++)
		if (__builtin_mul_overflow(n, (uint64_t)t->shape[i], &n))
			return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': shape size "
				       "overflows", e->file, st_show(e->name, nb, sizeof(nb)));
	if (e->begin > e->end)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': data_offsets [%llu, "
			       "%llu) end before they begin", e->file,
			       st_show(e->name, nb, sizeof(nb)), (unsigned long long)e->begin,
			       (unsigned long long)e->end);
	if (e->end > data_len)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': data_offsets [%llu, "
			       "%llu) run past the data section (%llu bytes)", e->file,
			       st_show(e->name, nb, sizeof(nb)), (unsigned long long)e->begin,
			       (unsigned long long)e->end, (unsigned long long)data_len);
	if (n != e->end - e->begin)
		return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': shape needs %llu bytes "
			       "of %s but data_offsets [%llu, %llu) hold %llu", e->file,
			       st_show(e->name, nb, sizeof(nb)), (unsigned long long)n,
			       t->dtype_name, (unsigned long long)e->begin,
			       (unsigned long long)e->end,
			       (unsigned long long)(e->end - e->begin));
	t->nbytes = n;
	t->data = data + e->begin;
	return 0;
}

static int st_cmp_begin(const void *a, const void *b)
{
	const struct st_entry *x = a, *y = b;

	if (x->begin != y->begin)
		return x->begin < y->begin ? -1 : 1;
	return x->end < y->end ? -1 : x->end > y->end;
}

/* Empty tensors occupy nothing; any other byte belongs to at most one tensor. */
static int st_check_overlap(struct st_entry *ents, int n, const char *file, char *err,
			    size_t err_len)
{
	char na[ST_SHOW], nb[ST_SHOW];
	const struct st_entry *last = NULL;

	qsort(ents, (size_t)n, sizeof(*ents), st_cmp_begin);
	for (int i = 0; i < n; i++) {
		if (ents[i].begin == ents[i].end)
			continue;
		if (last && ents[i].begin < last->end)
			return file_fail(err, err_len, -EINVAL, "%s: tensors '%s' [%llu, %llu) and "
				       "'%s' [%llu, %llu) overlap", file,
				       st_show(last->name, na, sizeof(na)),
				       (unsigned long long)last->begin,
				       (unsigned long long)last->end,
				       st_show(ents[i].name, nb, sizeof(nb)),
				       (unsigned long long)ents[i].begin,
				       (unsigned long long)ents[i].end);
		if (!last || ents[i].end > last->end)
			last = &ents[i];
	}
	return 0;
}

static int st_cmp_name(const void *a, const void *b)
{
	const struct st_tensor *x = a, *y = b;

	return strcmp(x->name, y->name);
}

static void st_free_tensors(struct st_file *f)
{
	for (int i = 0; f->tensors && i < f->n_tensors; i++)
		free(f->tensors[i].name);
	free(f->tensors);
	f->tensors = NULL;
	f->n_tensors = 0;
}

/* Builds f->tensors from the parsed header object. */
static int st_build(struct st_file *f, json_t *root, const uint8_t *data,
		    uint64_t data_len, const char *file, char *err, size_t err_len)
{
	struct st_entry *ents;
	const char *key;
	char nb[ST_SHOW];
	size_t cap;
	json_t *v;
	int n = 0, rc = 0;

	cap = json_object_size(root);
	if (cap > (size_t)1 << 24)
		return file_fail(err, err_len, -EINVAL, "%s: %zu header entries is too many",
			       file, cap);
	f->tensors = calloc(cap ? cap : 1, sizeof(*f->tensors));
	ents = calloc(cap ? cap : 1, sizeof(*ents));
	if (!f->tensors || !ents) {
		rc = file_fail(err, err_len, -ENOMEM, "%s: out of memory for %zu tensors",
			     file, cap);
		goto out;
	}
	json_object_foreach(root, key, v) {
		if (!strcmp(key, "__metadata__")) {
			if (!json_is_object(v)) {
				rc = file_fail(err, err_len, -EINVAL, "%s: __metadata__ is not an "
					     "object", file);
				goto out;
			}
			continue;
		}
		ents[n].name = key;
		ents[n].file = file;
		rc = st_parse_entry(&f->tensors[n], &ents[n], v, data, data_len, err, err_len);
		if (!rc && !(f->tensors[n].name = strdup(key)))
			rc = file_fail(err, err_len, -ENOMEM, "%s: out of memory", file);
		if (rc)
			goto out;
		f->n_tensors = ++n;
	}
	rc = st_check_overlap(ents, n, file, err, err_len);
	if (rc)
		goto out;
	qsort(f->tensors, (size_t)n, sizeof(*f->tensors), st_cmp_name);
	for (int i = 1; i < n; i++)
		if (!strcmp(f->tensors[i - 1].name, f->tensors[i].name)) {
			rc = file_fail(err, err_len, -EINVAL, "%s: tensor '%s' appears twice", file,
				     st_show(f->tensors[i].name, nb, sizeof(nb)));
			goto out;
		}
out:
	free(ents);
	if (rc)
		st_free_tensors(f);
	return rc;
}

int st_parse(struct st_file *f, const void *buf, size_t size, const char *name,
	     char *err, size_t err_len)
{
	const uint8_t *p = buf;
	char fb[512];
	const char *file = st_show(name ? name : "safetensors", fb, sizeof(fb));
	json_error_t jerr;
	uint64_t hlen = 0;
	json_t *root;
	int rc;

	f->size = size;
	f->n_tensors = 0;
	f->tensors = NULL;
	if (size < 8)
		return file_fail(err, err_len, -EINVAL, "%s: %zu bytes is too short for a "
			       "safetensors header", file, size);
	for (int i = 7; i >= 0; i--)
		hlen = hlen << 8 | p[i];
	if (hlen > size - 8)
		return file_fail(err, err_len, -EINVAL, "%s: header length %llu runs past the end "
			       "of the file (%zu bytes)", file, (unsigned long long)hlen, size);
	if (hlen > ST_MAX_HEADER)
		return file_fail(err, err_len, -EINVAL, "%s: header length %llu is over the %u "
			       "byte limit", file, (unsigned long long)hlen, ST_MAX_HEADER);
	root = json_loadb((const char *)p + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &jerr);
	if (!root) {
		rc = file_fail(err, err_len, -EINVAL, "%s: header JSON: %s (line %d, column %d)",
			     file, jerr.text, jerr.line, jerr.column);
		goto out;
	}
	if (!json_is_object(root))
		rc = file_fail(err, err_len, -EINVAL, "%s: header is not a JSON object", file);
	else
		rc = st_build(f, root, p + 8 + hlen, size - 8 - hlen, file, err, err_len);
	json_decref(root);
out:
	if (rc && err && err_len)	/* jansson's text may quote the input */
		st_show(err, err, err_len);
	return rc;
}

/* A file read into our own memory (file_load; or with map, a read-only mapping of it,
 * file_map) and parsed; progress as st_set_load's. */
static int st_file_load(struct st_file *f, const char *path, const struct st_progress *pr,
			int map, char *err, size_t err_len)
{
	static const uint8_t empty[1];
	int rc;

	memset(f, 0, sizeof(*f));
	f->path = strdup(path);
	if (!f->path)
		return file_fail(err, err_len, -ENOMEM, "%s: out of memory", path);
	f->mapped = map;
	if (map)
		rc = file_map(path, &f->map, &f->size, err, err_len);
	else
		rc = file_load(path, &f->map, &f->size, pr ? pr->fn : NULL, pr ? pr->ctx : NULL,
			       err, err_len);
	if (!rc)
		rc = st_parse(f, f->map ? f->map : empty, f->size, path, err, err_len);
	if (rc)
		st_file_close(f);
	return rc;
}

int st_file_open(struct st_file *f, const char *path, char *err, size_t err_len)
{
	return st_file_load(f, path, NULL, 0, err, err_len);
}

void st_file_close(struct st_file *f)
{
	if (!f)
		return;
	st_free_tensors(f);
	if (f->map)
		munmap(f->map, f->size);
	free(f->path);
	memset(f, 0, sizeof(*f));
}

const struct st_tensor *st_file_find(const struct st_file *f, const char *name)
{
	int lo = 0, hi = f->n_tensors - 1;

	while (lo <= hi) {
		int mid = lo + (hi - lo) / 2;
		int c = strcmp(name, f->tensors[mid].name);

		if (!c)
			return &f->tensors[mid];
		if (c < 0)
			hi = mid - 1;
		else
			lo = mid + 1;
	}
	return NULL;
}

/* ---- sets of files ------------------------------------------------------ */

static char *st_join(const char *dir, const char *name)
{
	char *s;

	if (asprintf(&s, "%s/%s", dir, name) < 0)
		return NULL;
	return s;
}

static int st_plain_name(const char *s)
{
	return *s && !strchr(s, '/') && strcmp(s, ".") && strcmp(s, "..");
}

static int st_cmp_str(const void *a, const void *b)
{
	return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Shard names of weight_map, each once, sorted (pointers into the JSON). */
static int st_shard_names(json_t *map, const char *ipath, const char ***out, int *n_out,
			  char *err, size_t err_len)
{
	char nb[ST_SHOW], sb[ST_SHOW];
	const char **names;
	const char *key;
	json_t *v;
	int n = 0, k = 0;

	names = calloc(json_object_size(map) + 1, sizeof(*names));
	if (!names)
		return file_fail(err, err_len, -ENOMEM, "%s: out of memory", ipath);
	json_object_foreach(map, key, v) {
		if (!json_is_string(v) || !st_plain_name(json_string_value(v))) {
			free(names);
			return file_fail(err, err_len, -EINVAL, "%s: tensor '%s': shard %s is not "
				       "a plain file name", ipath, st_show(key, nb, sizeof(nb)),
				       json_is_string(v) ? st_show(json_string_value(v), sb,
								   sizeof(sb)) : "(not a string)");
		}
		names[n++] = json_string_value(v);
	}
	qsort(names, (size_t)n, sizeof(*names), st_cmp_str);
	for (int i = 0; i < n; i++)
		if (!k || strcmp(names[k - 1], names[i]))
			names[k++] = names[i];
	*out = names;
	*n_out = k;
	return 0;
}

/* Every tensor the index maps must be in the shard it names. */
static int st_check_map(struct st_set *s, json_t *map, const char **names, const char *ipath,
			char *err, size_t err_len)
{
	char nb[ST_SHOW], sb[ST_SHOW];
	const char *key, *shard;
	const char **hit;
	json_t *v;

	json_object_foreach(map, key, v) {
		shard = json_string_value(v);
		hit = bsearch(&shard, names, (size_t)s->n_files, sizeof(*names), st_cmp_str);
		if (!hit || !st_file_find(&s->files[hit - names], key))
			return file_fail(err, err_len, -EINVAL, "%s: tensor '%s' is mapped to '%s' "
				       "but that file does not hold it", ipath,
				       st_show(key, nb, sizeof(nb)), st_show(shard, sb, sizeof(sb)));
	}
	return 0;
}

struct st_owner {
	const char *name;
	int file;
};

static int st_cmp_owner(const void *a, const void *b)
{
	const struct st_owner *x = a, *y = b;

	return strcmp(x->name, y->name);
}

/* No tensor name may be held by two files. */
static int st_check_unique(const struct st_set *s, char *err, size_t err_len)
{
	char nb[ST_SHOW], fa[ST_SHOW], fb[ST_SHOW];
	struct st_owner *all;
	size_t n = 0;
	int rc = 0;

	for (int i = 0; i < s->n_files; i++)
		n += (size_t)s->files[i].n_tensors;
	all = malloc((n ? n : 1) * sizeof(*all));
	if (!all)
		return file_fail(err, err_len, -ENOMEM, "out of memory for %zu tensor names", n);
	n = 0;
	for (int i = 0; i < s->n_files; i++)
		for (int j = 0; j < s->files[i].n_tensors; j++)
			all[n++] = (struct st_owner){ s->files[i].tensors[j].name, i };
	qsort(all, n, sizeof(*all), st_cmp_owner);
	for (size_t i = 1; i < n && !rc; i++)
		if (!strcmp(all[i - 1].name, all[i].name))
			rc = file_fail(err, err_len, -EINVAL, "tensor '%s' is in both %s and %s",
				     st_show(all[i].name, nb, sizeof(nb)),
				     st_show(s->files[all[i - 1].file].path, fa, sizeof(fa)),
				     st_show(s->files[all[i].file].path, fb, sizeof(fb)));
	free(all);
	return rc;
}

static int st_open_shards(struct st_set *s, const char *dir, const char **names, int n,
			  const struct st_progress *pr, int map, char *err, size_t err_len)
{
	char *path;
	int rc;

	s->files = calloc((size_t)(n ? n : 1), sizeof(*s->files));
	if (!s->files)
		return file_fail(err, err_len, -ENOMEM, "%s: out of memory", dir);
	for (int i = 0; i < n; i++) {
		path = st_join(dir, names[i]);
		if (!path)
			return file_fail(err, err_len, -ENOMEM, "%s: out of memory", dir);
		rc = st_file_load(&s->files[i], path, pr, map, err, err_len);
		free(path);
		if (rc)
			return rc;
		s->n_files = i + 1;
	}
	return 0;
}

static int st_set_from_index(struct st_set *s, const char *dir, const char *ipath,
			     const char *text, size_t len, const struct st_progress *pr, int by_map,
			     char *err, size_t err_len)
{
	const char **names = NULL;
	json_error_t jerr;
	json_t *root, *map;
	int n = 0, rc;

	root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
	if (!root)
		return file_fail(err, err_len, -EINVAL, "%s: not valid JSON: %s (line %d, column %d)",
			       ipath, jerr.text, jerr.line, jerr.column);
	map = json_object_get(root, "weight_map");
	if (!json_is_object(map)) {
		rc = file_fail(err, err_len, -EINVAL, "%s: weight_map is missing or not an object",
			     ipath);
		goto out;
	}
	rc = st_shard_names(map, ipath, &names, &n, err, err_len);
	if (!rc && n == 0)
		rc = file_fail(err, err_len, -EINVAL, "%s: weight_map is empty", ipath);
	if (!rc)
		rc = st_open_shards(s, dir, names, n, pr, by_map, err, err_len);
	if (!rc)
		rc = st_check_map(s, map, names, ipath, err, err_len);
out:
	free(names);
	json_decref(root);
	return rc;
}

static int st_set_read(struct st_set *s, const char *dir, const struct st_progress *pr, int map,
		       char *err, size_t err_len)
{
	char *ipath, *text = NULL;
	size_t len = 0;
	int rc;

	memset(s, 0, sizeof(*s));
	ipath = st_join(dir, ST_INDEX_NAME);
	if (!ipath)
		return file_fail(err, err_len, -ENOMEM, "%s: out of memory", dir);
	rc = file_read_all(ipath, ST_MAX_INDEX, &text, &len, err, err_len);
	if (!rc) {
		rc = st_set_from_index(s, dir, ipath, text, len, pr, map, err, err_len);
	} else if (rc == -ENOENT) {
		free(ipath);
		ipath = st_join(dir, ST_SINGLE_NAME);
		s->files = calloc(1, sizeof(*s->files));
		if (!ipath || !s->files) {
			rc = file_fail(err, err_len, -ENOMEM, "%s: out of memory", dir);
			goto out;
		}
		if (access(ipath, F_OK) && errno == ENOENT) {
			rc = file_fail(err, err_len, -ENOENT, "%s: no %s or %s", dir,
				     ST_SINGLE_NAME, ST_INDEX_NAME);
			goto out;
		}
		rc = st_file_load(&s->files[0], ipath, pr, map, err, err_len);
		if (!rc)
			s->n_files = 1;
	}
	if (!rc)
		rc = st_check_unique(s, err, err_len);
out:
	free(text);
	free(ipath);
	if (rc)
		st_set_close(s);
	return rc;
}

int st_set_load(struct st_set *s, const char *dir, const struct st_progress *pr,
		char *err, size_t err_len)
{
	return st_set_read(s, dir, pr, 0, err, err_len);
}

int st_set_map(struct st_set *s, const char *dir, char *err, size_t err_len)
{
	return st_set_read(s, dir, NULL, 1, err, err_len);
}

int st_set_open(struct st_set *s, const char *dir, char *err, size_t err_len)
{
	return st_set_load(s, dir, NULL, err, err_len);
}

void st_set_close(struct st_set *s)
{
	if (!s)
		return;
	for (int i = 0; s->files && i < s->n_files; i++)
		st_file_close(&s->files[i]);
	free(s->files);
	memset(s, 0, sizeof(*s));
}

const struct st_tensor *st_set_find(const struct st_set *s, const char *name,
				    const struct st_file **file)
{
	const struct st_tensor *t;

	for (int i = 0; i < s->n_files; i++) {
		t = st_file_find(&s->files[i], name);
		if (t) {
			if (file)
				*file = &s->files[i];
			return t;
		}
	}
	return NULL;
}
