/* Log lines: "2026-11-29T14:00:00.123Z info  message". One write per line so that
 * lines from different threads do not interleave; the message escaped, so that one
 * call is one line of plain text whatever the strings in it. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "daemon/base/log.h"

enum log_level log_threshold = LOG_INFO;

static const char *const level_names[] = { "error", "warn", "info", "debug" };

int log_level_parse(const char *s, enum log_level *out)
{
	for (unsigned i = 0; i < sizeof(level_names) / sizeof(level_names[0]); i++) {
		if (!strcmp(s, level_names[i])) {
			*out = (enum log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

/* The length of the valid UTF-8 character at s (n bytes left) that is not a C1
 * control, or 0 (the byte is escaped). */
static size_t utf8_printable(const unsigned char *s, size_t n)
{
	size_t len;
	unsigned lo = 0x80, hi = 0xbf;

	if (s[0] >= 0xc2 && s[0] <= 0xdf)
		len = 2;
	else if (s[0] >= 0xe0 && s[0] <= 0xef)
		len = 3;
	else if (s[0] >= 0xf0 && s[0] <= 0xf4)
		len = 4;
	else
		return 0;
	if (len > n)
		return 0;
	/* the second byte's range rules out overlong forms, surrogates, > U+10FFFF and
	 * (after 0xc2) the C1 controls U+0080..U+009F */
	if (s[0] == 0xc2)
		lo = 0xa0;
	else if (s[0] == 0xe0)
		lo = 0xa0;
	else if (s[0] == 0xed)
		hi = 0x9f;
	else if (s[0] == 0xf0)
		lo = 0x90;
	else if (s[0] == 0xf4)
		hi = 0x8f;
	if (s[1] < lo || s[1] > hi)
		return 0;
	for (size_t i = 2; i < len; i++)
		if (s[i] < 0x80 || s[i] > 0xbf)
			return 0;
	return len;
}

size_t log_escape(char *dst, size_t dst_len, const char *src, size_t n)
{
	const unsigned char *s = (const unsigned char *)src;
	size_t o = 0;

	if (!dst_len)
		return 0;
	for (size_t i = 0; i < n;) {
		size_t u = s[i] >= 0x80 ? utf8_printable(s + i, n - i) : 0;

		if (s[i] >= 0x20 && s[i] < 0x7f && s[i] != '\\')
			u = 1;
		if (u) {
			if (o + u >= dst_len)
				break;
			memcpy(dst + o, s + i, u);
			o += u;
			i += u;
			continue;
		}
		if (o + 4 >= dst_len)
			break;
		snprintf(dst + o, 5, "\\x%02x", s[i]);
		o += 4;
		i++;
	}
	dst[o] = '\0';
	return o;
}

void log_write(enum log_level level, const char *fmt, ...)
{
	char msg[2048], line[4096];
	struct timespec ts;
	struct tm tm;
	va_list ap;
	int n, m;

	if (level > log_threshold)
		return;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	n = snprintf(line, sizeof(line), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s ",
		     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
		     tm.tm_sec, ts.tv_nsec / 1000000, level_names[level]);
	va_start(ap, fmt);
	m = vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	if (m < 0)
		m = 0;
	if (m >= (int)sizeof(msg))
		m = (int)sizeof(msg) - 1;
	/* room for the newline: log_escape NUL-terminates where it goes */
	n += (int)log_escape(line + n, sizeof(line) - (size_t)n, msg, (size_t)m);
	line[n++] = '\n';
	if (write(STDERR_FILENO, line, (size_t)n) < 0)
		return;
}
