/* libFuzzer target: control_parse on arbitrary bytes (a line from the socket) must
 * not crash; what it accepts is a known command with in-range fields, and every
 * refusal leaves one line of reason. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "daemon/serve/control.h"
#include "daemon/base/log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct control_cmd cmd;
	char err[256];

	if (size > 4096)	/* the server never hands over a longer line */
		return 0;
	err[0] = '\0';
	if (control_parse((const char *)data, size, &cmd, err, sizeof(err)) == 0) {
		if (cmd.kind < CTL_HELLO || cmd.kind >= CTL_N_KINDS)
			__builtin_trap();
		if (cmd.kind == CTL_SESSION_CLOSE &&
		    (!cmd.name[0] || !memchr(cmd.name, '\0', sizeof(cmd.name))))
			__builtin_trap();
		if (cmd.kind == CTL_LOG_LEVEL && (cmd.level < LOG_ERROR || cmd.level > LOG_DEBUG))
			__builtin_trap();
		if (cmd.kind == CTL_DRAIN && cmd.on != 0 && cmd.on != 1)
			__builtin_trap();
	} else if (!err[0] || !memchr(err, '\0', sizeof(err))) {
		__builtin_trap();
	}
	return 0;
}
