/* kdrun: sends a prompt to kdecd and streams the answer. Streaming needs the IPC
 * layer, which is not in this release; use `kdbench generate` to run a model now. */
#include <stdio.h>
#include <string.h>

#include "client/kdclient.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kdrun --version | --help\n"
		"\n"
		"Sending prompts to kdecd needs kdec's IPC layer, which is not in this release.\n"
		"To run a model now: kdbench generate --model DIR --prompt 1,2,3 --max-tokens N\n");
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "--version")) {
		printf("kdrun (kdec) %s, protocol %u\n", kd_version(), kd_protocol_version());
		return 0;
	}
	if (argc == 2 && !strcmp(argv[1], "--help")) {
		usage(stdout);
		return 0;
	}
	if (argc >= 2)
		fprintf(stderr, "kdrun: '%s': not available in this release\n", argv[1]);
	usage(stderr);
	return 2;
}
