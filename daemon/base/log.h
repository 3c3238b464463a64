/* Level-gated logging to stderr with a timestamp and level; the level check happens
 * before any formatting, so a disabled debug line costs one compare. Every line is
 * escaped (log_escape): what a client sends (a session name, a path) cannot start a
 * forged line or reach the operator's terminal as a control sequence. */
#ifndef KD_DAEMON_LOG_H
#define KD_DAEMON_LOG_H

#include <stddef.h>

enum log_level {
	LOG_ERROR = 0,
	LOG_WARN,
	LOG_INFO,
	LOG_DEBUG,
};

extern enum log_level log_threshold;

/* Parses "error", "warn", "info", "debug"; returns 0 or -EINVAL. */
int log_level_parse(const char *s, enum log_level *out);

/* Copies src[0..n) to dst (NUL-terminated, at most dst_len bytes with it) with every
 * byte that is not printable shown as \xNN: control bytes (newline, ESC), DEL, a
 * backslash (so the text reads back unambiguously), bytes of invalid UTF-8 and C1
 * controls; valid UTF-8 above U+009F passes. Stops before an escape or character
 * that would not fit. Returns the length written. */
size_t log_escape(char *dst, size_t dst_len, const char *src, size_t n);

void log_write(enum log_level level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#define log_error(...) log_write(LOG_ERROR, __VA_ARGS__)
#define log_warn(...)							\
	do {								\
		if (log_threshold >= LOG_WARN)				\
			log_write(LOG_WARN, __VA_ARGS__);		\
	} while (0)
#define log_info(...)							\
	do {								\
		if (log_threshold >= LOG_INFO)				\
			log_write(LOG_INFO, __VA_ARGS__);		\
	} while (0)
#define log_debug(...)							\
	do {								\
		if (log_threshold >= LOG_DEBUG)				\
			log_write(LOG_DEBUG, __VA_ARGS__);		\
	} while (0)

#endif
