/* Tensor-parallel shards read straight from the files (docs/PARALLEL.md, "Loading"):
 * on a llama-shaped checkpoint written here (two safetensors files and an index,
 * about 52 MiB), the shards built from the mapped files equal, byte for byte, those
 * built from the model read whole; and the whole model is never resident: in a child
 * process each, the peak resident memory (VmHWM) of building tp 4's shards from the
 * mapped files, each rank's host copy given back once made (what a GPU rank does after
 * its upload), stays under half the model; keeping every shard (the CPU ranks), under
 * 1.35 models; and the old way (the model read whole, then its shards) is measured
 * above 1.7 models, so the measurement can tell them apart. A file cut short under the
 * mapping fails the shard's build with -EIO and one line, not SIGBUS. The same for a
 * GGUF (tests/data/gguf-golden/qwen3.gguf, bf16, copied here): its mapped load
 * dequantizes nothing whole, each rank's slice alone, and the peaks and the cut file
 * are checked as above (the peaks in models of the dequantized fp32 weights). And Q8_0
 * slices (llama3-q8_0.gguf, blocks of 32 along a row): rows, and columns on block
 * bounds and off them, of plain, rope-permuted (attn_q) and embedding weights
 * dequantized from the mapping equal the same elements of the model read whole, bit
 * for bit. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "daemon/model/model.h"
#include "daemon/model/model_gguf.h"
#include "daemon/model/model_shard.h"
#include "tests/testutil.h"

#define HIDDEN 512
#define HEADS 8
#define KV_HEADS 4
#define HEAD_DIM 64
#define INTER 1536
#define LAYERS 6
#define VOCAB 8192
#define TP 4

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif
#ifndef UNDER_ASAN
#define UNDER_ASAN 0
#endif

struct wtensor {
	char name[96];
	int64_t rows, cols;	/* cols 0: a vector */
	int file;		/* 0: embeddings, norms, head; 1: the layers */
};

static int list_tensors(struct wtensor *t)
{
	static const char *const attn[] = { "q_proj", "k_proj", "v_proj", "o_proj" };
	static const char *const mlp[] = { "gate_proj", "up_proj", "down_proj" };
	int n = 0;

	t[n++] = (struct wtensor){ "model.embed_tokens.weight", VOCAB, HIDDEN, 0 };
	t[n++] = (struct wtensor){ "model.norm.weight", HIDDEN, 0, 0 };
	t[n++] = (struct wtensor){ "lm_head.weight", VOCAB, HIDDEN, 0 };
	for (int l = 0; l < LAYERS; l++) {
		snprintf(t[n].name, sizeof(t[n].name), "model.layers.%d.input_layernorm.weight", l);
		t[n].rows = HIDDEN, t[n].cols = 0, t[n++].file = 1;
		snprintf(t[n].name, sizeof(t[n].name), "model.layers.%d.post_attention_layernorm.weight", l);
		t[n].rows = HIDDEN, t[n].cols = 0, t[n++].file = 1;
		for (int i = 0; i < 4; i++) {
			snprintf(t[n].name, sizeof(t[n].name), "model.layers.%d.self_attn.%s.weight", l, attn[i]);
			t[n].rows = i == 3 ? HIDDEN : (i == 0 ? HEADS : KV_HEADS) * HEAD_DIM;
			t[n].cols = i == 3 ? HEADS * HEAD_DIM : HIDDEN;
			t[n++].file = 1;
		}
		for (int i = 0; i < 3; i++) {
			snprintf(t[n].name, sizeof(t[n].name), "model.layers.%d.mlp.%s.weight", l, mlp[i]);
			t[n].rows = i == 2 ? HIDDEN : INTER;
			t[n].cols = i == 2 ? INTER : HIDDEN;
			t[n++].file = 1;
		}
	}
	return n;
}

/* One safetensors file of the tensors of list t in `file`: random bf16 (finite). */
static int write_file(const char *path, const struct wtensor *t, int n, int file, uint64_t *seed)
{
	char *hdr = malloc(1 << 16);
	size_t hl = 0;
	uint64_t off = 0, len;
	uint16_t buf[4096];
	FILE *f;

	if (!hdr)
		return -1;
	hl += (size_t)snprintf(hdr + hl, 65536 - hl, "{");
	for (int i = 0; i < n; i++) {
		uint64_t bytes = (uint64_t)t[i].rows * (uint64_t)(t[i].cols ? t[i].cols : 1) * 2;

		if (t[i].file != file)
			continue;
		if (t[i].cols)
			hl += (size_t)snprintf(hdr + hl, 65536 - hl, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":"
					       "[%lld,%lld],\"data_offsets\":[%llu,%llu]}", off ? "," : "",
					       t[i].name, (long long)t[i].rows, (long long)t[i].cols,
					       (unsigned long long)off, (unsigned long long)(off + bytes));
		else
			hl += (size_t)snprintf(hdr + hl, 65536 - hl, "%s\"%s\":{\"dtype\":\"BF16\",\"shape\":"
					       "[%lld],\"data_offsets\":[%llu,%llu]}", off ? "," : "",
					       t[i].name, (long long)t[i].rows, (unsigned long long)off,
					       (unsigned long long)(off + bytes));
		off += bytes;
	}
	hl += (size_t)snprintf(hdr + hl, 65536 - hl, "}");
	while (hl % 8)
		hdr[hl++] = ' ';
	f = fopen(path, "wb");
	if (!f) {
		free(hdr);
		return -1;
	}
	len = hl;
	for (int i = 0; i < 8; i++)
		fputc((int)(len >> (8 * i)) & 0xff, f);
	fwrite(hdr, 1, hl, f);
	for (uint64_t done = 0; done < off; done += sizeof(buf)) {
		size_t k = off - done < sizeof(buf) ? (size_t)(off - done) : sizeof(buf);

		for (size_t j = 0; j < k / 2; j++) {	/* sign, exponent 120..127: finite */
			*seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
			buf[j] = (uint16_t)(((*seed >> 33) & 0x807f) | (0x3c00 + ((*seed >> 40) & 0x380)));
		}
		fwrite(buf, 1, k, f);
	}
	free(hdr);
	return fclose(f) ? -1 : 0;
}

static int write_model(const char *dir)
{
	struct wtensor *t = calloc(8 + 9 * LAYERS, sizeof(*t));
	char path[1024];
	uint64_t seed = 11;
	FILE *f;
	int n, ret = 0;

	if (!t)
		return -1;
	n = list_tensors(t);
	snprintf(path, sizeof(path), "%s/config.json", dir);
	f = fopen(path, "w");
	if (!f) {
		free(t);
		return -1;
	}
	fprintf(f, "{\"model_type\": \"llama\", \"vocab_size\": %d, \"hidden_size\": %d, "
		"\"intermediate_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d, "
		"\"num_key_value_heads\": %d, \"head_dim\": %d, \"rms_norm_eps\": 1e-5, "
		"\"max_position_embeddings\": 2048, \"tie_word_embeddings\": false, "
		"\"rope_theta\": 500000.0, \"torch_dtype\": \"bfloat16\"}\n", VOCAB, HIDDEN, INTER,
		LAYERS, HEADS, KV_HEADS, HEAD_DIM);
	ret |= fclose(f);
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
	f = fopen(path, "w");
	if (!f) {
		free(t);
		return -1;
	}
	fprintf(f, "{\"weight_map\": {");
	for (int i = 0; i < n; i++)
		fprintf(f, "%s\"%s\": \"model-%05d-of-00002.safetensors\"", i ? ", " : "", t[i].name,
			t[i].file + 1);
	fprintf(f, "}}\n");
	ret |= fclose(f);
	for (int k = 0; k < 2 && !ret; k++) {
		snprintf(path, sizeof(path), "%s/model-%05d-of-00002.safetensors", dir, k + 1);
		ret = write_file(path, t, n, k, &seed);
	}
	free(t);
	return ret;
}

/* The shards of both loads, byte for byte. */
static void check_equal_shards(const char *dir)
{
	struct model_load_opts lo = { .mapped = 1 };
	struct model *whole = NULL, *mapped = NULL;
	char err[512] = "";

	CHECK(model_load(&whole, dir, NULL, err, sizeof(err)) == 0, "load whole: %s", err);
	CHECK(model_load(&mapped, dir, &lo, err, sizeof(err)) == 0, "load mapped: %s", err);
	if (!whole || !mapped)
		goto out;
	CHECK(mapped->mapped && mapped->files.n_files == 2 && mapped->files.files[0].mapped &&
	      !whole->mapped && !whole->files.files[0].mapped, "mapped %d (files %d), whole %d",
	      mapped->mapped, mapped->files.n_files, whole->mapped);
	for (int n = 2; n <= TP; n *= 2)
		for (int r = 0; r < n; r++) {
			struct model *a = NULL, *b = NULL;

			CHECK(model_shard_create(&a, whole, r, n, 0, err, sizeof(err)) == 0 &&
			      model_shard_create(&b, mapped, r, n, 0, err, sizeof(err)) == 0,
			      "tp %d rank %d: %s", n, r, err);
			CHECK(a && b && a->weight_bytes == b->weight_bytes &&
			      !memcmp(a->shard_buf, b->shard_buf, a->weight_bytes),
			      "tp %d rank %d: the shard read from the mapped files differs", n, r);
			CHECK(a && a->weight_bytes < whole->weight_bytes / (size_t)n + ((size_t)1 << 20),
			      "tp %d rank %d: %zu bytes of %zu", n, r, a ? a->weight_bytes : 0,
			      whole->weight_bytes);
			model_destroy(a);
			model_destroy(b);
		}
	fprintf(stderr, "  shards of tp 2 and %d from the mapped files equal those from the model "
		"read whole (%.1f MiB)\n", TP, (double)whole->weight_bytes / (1 << 20));
out:
	model_destroy(whole);
	model_destroy(mapped);
}

static long status_kib(const char *key)
{
	char line[256];
	long v = -1;
	FILE *f = fopen("/proc/self/status", "r");

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, key, strlen(key)))
			v = strtol(line + strlen(key), NULL, 10);
	fclose(f);
	return v;
}

enum how { MAPPED_DROP, MAPPED_KEEP, WHOLE_KEEP };
static const char *const how_name[] = {
	"mapped, each rank's host copy given back (a GPU rank)",
	"mapped, every shard kept (the CPU ranks)",
	"read whole, then every shard (the old way)",
};

/* In a child: the peak resident memory over its start of loading and building tp
 * TP's shards as `how` says, in KiB; -1 where it cannot be measured. */
static long peak_growth(const char *dir, enum how how)
{
	int fd[2];
	long got = -1;
	pid_t pid;

	if (pipe(fd))
		return -1;
	pid = fork();
	if (pid == 0) {
		struct model_load_opts lo = { .mapped = how != WHOLE_KEEP };
		struct model *m = NULL, *s[TP] = { 0 };
		char err[512];
		long base = status_kib("VmRSS:"), peak = -1;

		close(fd[0]);
		if (base >= 0 && model_load(&m, dir, &lo, err, sizeof(err)) == 0) {
			int ok = 1;

			for (int r = 0; r < TP && ok; r++) {
				ok = model_shard_create(&s[r], m, r, TP, 0, err, sizeof(err)) == 0;
				if (ok && how == MAPPED_DROP)
					model_shard_drop_host(s[r]);
			}
			peak = ok ? status_kib("VmHWM:") : -1;
			if (peak >= 0)
				peak -= base;
		}
		if (write(fd[1], &peak, sizeof(peak)) != sizeof(peak))
			_exit(1);
		_exit(0);
	}
	close(fd[1]);
	if (pid > 0 && read(fd[0], &got, sizeof(got)) != sizeof(got))
		got = -1;
	close(fd[0]);
	if (pid > 0)
		waitpid(pid, NULL, 0);
	return got;
}

/* most, least: bounds of the three ways, in models (the weights as bound) */
static void check_peaks(const char *dir, const char *what, const double *most, const double *least)
{
	struct model_load_opts lo = { .mapped = 1 };
	struct model *m = NULL;
	char err[512] = "";
	double model_kib;

	CHECK(model_load(&m, dir, &lo, err, sizeof(err)) == 0, "load mapped: %s", err);
	if (!m)
		return;
	model_kib = (double)m->weight_bytes / 1024.0;
	model_destroy(m);
	if (UNDER_ASAN) {	/* its shadow and quarantine are resident memory too */
		fprintf(stderr, "  peak resident memory not checked under ASan\n");
		return;
	}
	for (int h = MAPPED_DROP; h <= WHOLE_KEEP; h++) {
		long kib = peak_growth(dir, (enum how)h);

		if (kib < 0) {
			fprintf(stderr, "  %s: no VmHWM here, not checked\n", how_name[h]);
			continue;
		}
		CHECK(kib <= most[h] * model_kib && kib >= least[h] * model_kib,
		      "%s tp %d, %s: peak resident memory grew by %.2f models (expected %.2f..%.2f)",
		      what, TP, how_name[h], kib / model_kib, least[h], most[h] < 1e8 ? most[h] : 99.0);
		fprintf(stderr, "  %s tp %d, %s: peak resident memory +%.1f MiB = %.2f models\n", what,
			TP, how_name[h], kib / 1024.0, kib / model_kib);
	}
}

/* A weight file cut short after it was mapped (an operator rewriting the checkpoint
 * while kdecd starts): building a shard fails with one line, -EIO, not SIGBUS; and a
 * fault outside the guard still takes the default action (a child reading past the end
 * of the same mapping dies of SIGBUS). Last: it truncates the model. */
static void check_truncated(const char *dir)
{
	struct model_load_opts lo = { .mapped = 1 };
	struct model *m = NULL, *s = NULL;
	char err[512] = "", path[1200];
	struct stat st;
	int ret, status = 0;
	pid_t pid;

	CHECK(model_load(&m, dir, &lo, err, sizeof(err)) == 0, "load mapped: %s", err);
	if (!m)
		return;
	snprintf(path, sizeof(path), "%s/model-00002-of-00002.safetensors", dir);
	CHECK(stat(path, &st) == 0 && truncate(path, st.st_size / 2) == 0, "truncate %s", path);
	err[0] = 0;
	ret = model_shard_create(&s, m, 0, 2, 0, err, sizeof(err));
	CHECK(ret == -EIO && !s && strstr(err, "shrank"),
	      "a file cut short under the mapping: want -EIO and one line, got %d: %s", ret, err);
	fprintf(stderr, "  truncated under the mapping: %s\n", err);
	pid = fork();
	if (pid == 0) {	/* unguarded: the default action, whatever the guard installed */
		volatile char sink = 0;

		for (int i = 0; i < m->files.n_files; i++)
			if (m->files.files[i].map)
				sink ^= ((const volatile char *)m->files.files[i].map)[m->files.files[i].size - 1];
		_exit(sink == 0x7f ? 3 : 2);
	}
	CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFSIGNALED(status) &&
	      WTERMSIG(status) == SIGBUS, "an unguarded read past the end: want death by SIGBUS, "
	      "got status 0x%x", status);
	model_destroy(m);
}

/* A GGUF: a copy of qwen3.gguf (bf16 matrices, fp32 norms; dequantized to fp32 at
 * load), its peaks as the safetensors model's, then the copy cut short under the
 * mapping: -EIO and one line. */
static void check_gguf(const char *top, const char *dir)
{
	struct model_load_opts lo = { .mapped = 1 };
	struct model *m = NULL, *s = NULL;
	char src[1200], path[1200], err[512] = "", buf[1 << 16];
	FILE *in, *out;
	size_t k;
	int ret;

	snprintf(src, sizeof(src), "%s/tests/data/gguf-golden/qwen3.gguf", top);
	snprintf(path, sizeof(path), "%s/qwen3.gguf", dir);
	in = fopen(src, "rb");
	out = fopen(path, "wb");
	CHECK(in && out, "cannot copy %s to %s", src, path);
	while (in && out && (k = fread(buf, 1, sizeof(buf), in)) > 0)
		CHECK(fwrite(buf, 1, k, out) == k, "write %s", path);
	if (in)
		fclose(in);
	if (out)
		CHECK(fclose(out) == 0, "close %s", path);
	if (test_failures)
		goto out;
	/* A 3 MiB model: the fixed costs weigh more. Read whole, the file's image (0.5
	 * models: bf16) and its fp32 copy (1 model) come before any shard, so the mapped
	 * bounds below (one shard 0.25 at a time, or all four kept) are missed by 0.5. */
	static const double most[] = { 1.0, 1.9, 1e9 }, least[] = { 0, 0, 2.0 };

	check_peaks(path, "gguf", most, least);
	CHECK(model_load(&m, path, &lo, err, sizeof(err)) == 0 && m->mapped && !m->gguf_buf,
	      "gguf: load mapped: %s", err);
	if (!m)
		goto out;
	CHECK(truncate(path, 4096) == 0, "truncate %s", path);
	err[0] = 0;
	ret = model_shard_create(&s, m, 1, 2, 0, err, sizeof(err));
	CHECK(ret == -EIO && !s && strstr(err, "shrank") && !strchr(err, '\n'),
	      "gguf: a file cut short under the mapping: want -EIO and one line, got %d: %s", ret, err);
	fprintf(stderr, "  gguf truncated under the mapping: %s\n", err);
	model_destroy(s);
	model_destroy(m);
out:
	unlink(path);
}

/* A slice of tm, a slot of the mapped mt, against the same elements of tw, the slot's
 * whole copy (fp32) in the model read whole. */
static void check_q8_slice(const struct model *mt, const struct model_tensor *tw,
			   const struct model_tensor *tm, const char *what, int64_t r0, int64_t nr,
			   int64_t c0, int64_t nc)
{
	struct model_gguf_scratch sc = { 0 };
	float *got = malloc(sizeof(float) * (size_t)(nr * nc));
	char err[512] = "";
	int ret, same = 1;

	CHECK(tw->dtype == K_F32 && tm->dtype == K_F32 && got, "q8_0 %s: dtypes %d %d", what,
	      (int)tw->dtype, (int)tm->dtype);
	if (!got || tw->dtype != K_F32)
		goto out;
	ret = model_gguf_slice(mt, tm, r0, nr, c0, nc, got, &sc, err, sizeof(err));
	CHECK(ret == 0, "q8_0 %s: slice rows [%lld, +%lld) columns [%lld, +%lld): %d %s", what,
	      (long long)r0, (long long)nr, (long long)c0, (long long)nc, ret, err);
	for (int64_t i = 0; !ret && i < nr; i++)
		same &= !memcmp(got + i * nc, (const float *)tw->data + (r0 + i) * tw->cols + c0,
				sizeof(float) * (size_t)nc);
	CHECK(!ret && same, "q8_0 %s: the slice differs from the model read whole", what);
out:
	free(sc.buf);
	free(got);
}

static void check_q8(const char *top)
{
	struct model_load_opts lo = { .mapped = 1 };
	struct model *m = NULL, *mt = NULL;
	char path[1200], err[512] = "";

	snprintf(path, sizeof(path), "%s/tests/data/gguf-golden/llama3-q8_0.gguf", top);
	CHECK(model_load(&m, path, NULL, err, sizeof(err)) == 0, "q8_0: load: %s", err);
	CHECK(model_load(&mt, path, &lo, err, sizeof(err)) == 0 && mt->mapped && !mt->gguf_buf,
	      "q8_0: load mapped: %s", err);
	if (!m || !mt)
		goto out;
	check_q8_slice(mt, &m->embed, &mt->embed, "token_embd rows", 100, 37, 0, m->embed.cols);
	check_q8_slice(mt, &m->layers[0].wo, &mt->layers[0].wo, "attn_output columns", 0,
		       m->layers[0].wo.rows, 32, 64);
	check_q8_slice(mt, &m->layers[1].wq, &mt->layers[1].wq, "attn_q (rope rows) block", 40, 50,
		       64, 32);
	check_q8_slice(mt, &m->layers[1].wk, &mt->layers[1].wk, "attn_k (rope rows)", 0,
		       m->layers[1].wk.rows, 0, m->layers[1].wk.cols);
	check_q8_slice(mt, &m->layers[0].w_down, &mt->layers[0].w_down, "ffn_down block", 7, 20,
		       320, 32);
	check_q8_slice(mt, &m->layers[0].w_gate, &mt->layers[0].w_gate, "ffn_gate rows", 176, 176, 0,
		       m->layers[0].w_gate.cols);
	/* columns that start or end inside a 32-element block: the blocks they touch
	 * dequantized, their columns kept (tp 2's [176, 352) of the 352 MLP columns) */
	check_q8_slice(mt, &m->layers[0].w_down, &mt->layers[0].w_down, "ffn_down off blocks", 0, 16,
		       176, 176);
	check_q8_slice(mt, &m->layers[0].w_down, &mt->layers[0].w_down, "ffn_down inside a block", 3,
		       5, 37, 20);
	check_q8_slice(mt, &m->layers[1].wq, &mt->layers[1].wq, "attn_q (rope rows) off blocks", 40,
		       50, 70, 30);
	fprintf(stderr, "  q8_0 slices from the mapping equal the model read whole, on block bounds "
		"and off them\n");
out:
	model_destroy(mt);
	model_destroy(m);
}

int main(void)
{
	const char *top = getenv("top_srcdir") ? getenv("top_srcdir") : ".";
	char tmpl[] = "/tmp/kdec_test_tp_load.XXXXXX", path[1200];

	if (!mkdtemp(tmpl)) {
		perror("mkdtemp");
		return 1;
	}
	CHECK(write_model(tmpl) == 0, "cannot write the model into %s", tmpl);
	if (!test_failures) {
		static const double most[] = { 0.5, 1.35, 1e9 }, least[] = { 0, 0, 1.7 };

		check_peaks(tmpl, "safetensors", most, least);	/* first: the children fork a small process */
		check_equal_shards(tmpl);
		check_truncated(tmpl);
	}
	check_gguf(top, tmpl);
	check_q8(top);
	for (int k = 0; k < 2; k++) {
		snprintf(path, sizeof(path), "%s/model-%05d-of-00002.safetensors", tmpl, k + 1);
		unlink(path);
	}
	snprintf(path, sizeof(path), "%s/model.safetensors.index.json", tmpl);
	unlink(path);
	snprintf(path, sizeof(path), "%s/config.json", tmpl);
	unlink(path);
	rmdir(tmpl);
	return test_result("test_tp_load");
}
