/* kd_tokenizer_open/close, the per-thread error line and the vocabulary facts; the
 * work is in tokenizer_{vocab,pre,encode,gguf,json,chat,stream}.c. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "client/tokenizer.h"
#include "format/gguf.h"

static __thread char tok_error[512];

void tok_set_error(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(tok_error, sizeof(tok_error), fmt, ap);
	va_end(ap);
}

const char *kd_tokenizer_error(void)
{
	return tok_error[0] ? tok_error : "no error";
}

void kd_tokenizer_close(struct kd_tokenizer *t)
{
	if (!t)
		return;
	free(t->tokens);
	free(t->strings);
	free(t->vocab_slots);
	free(t->merges);
	free(t->special);
	free(t->chat_system);
	free(t->path);
	free(t);
}

int kd_tokenizer_open(struct kd_tokenizer **out, const char *path)
{
	struct kd_tokenizer *t;
	struct stat st;
	int ret;

	*out = NULL;
	if (!path) {
		tok_set_error("kd_tokenizer_open: no path");
		return -EINVAL;
	}
	if (stat(path, &st)) {
		ret = -errno;
		tok_set_error("%s: %s", path, strerror(errno));
		return ret;
	}
	t = calloc(1, sizeof(*t));
	if (!t || !(t->path = strdup(path))) {
		free(t);
		tok_set_error("%s: out of memory", path);
		return -ENOMEM;
	}
	t->bos = t->eos = t->eot = -1;
	if (S_ISDIR(st.st_mode)) {
		ret = tok_load_hf_dir(t, path);
	} else if (gguf_is_gguf(path)) {
		ret = tok_load_gguf(t, path);
	} else {
		tok_set_error("%s: neither a GGUF file nor a directory with tokenizer.json", path);
		ret = -EINVAL;
	}
	if (ret == -ENOMEM)
		tok_set_error("%s: out of memory", path);
	if (ret) {
		kd_tokenizer_close(t);
		return ret;
	}
	*out = t;
	return 0;
}

int32_t kd_tokenizer_n_vocab(const struct kd_tokenizer *t) { return (int32_t)t->n_vocab; }
int32_t kd_tokenizer_bos(const struct kd_tokenizer *t) { return t->bos; }
int32_t kd_tokenizer_eos(const struct kd_tokenizer *t) { return t->eos; }
int32_t kd_tokenizer_eot(const struct kd_tokenizer *t) { return t->eot; }

int32_t kd_tokenizer_token_id(const struct kd_tokenizer *t, const char *text)
{
	return text && *text ? tok_find(t, text, strlen(text)) : -1;
}
