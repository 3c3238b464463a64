/* kdctl: the operator's tool. It talks to kdecd over the control socket, which lands
 * with the IPC layer; this release reports versions and says so. */
#include <stdio.h>
#include <string.h>

#include "client/kdclient.h"

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kdctl --version | --help\n"
		"\n"
		"Control-socket commands (status, sessions, snapshot) need a kdecd that serves\n"
		"clients; that arrives with kdec's IPC layer and is not in this release.\n");
}

int main(int argc, char **argv)
{
	if (argc == 2 && !strcmp(argv[1], "--version")) {
		printf("kdctl (kdec) %s, protocol %u\n", kd_version(), kd_protocol_version());
		return 0;
	}
	if (argc == 2 && !strcmp(argv[1], "--help")) {
		usage(stdout);
		return 0;
	}
	if (argc >= 2)
		fprintf(stderr, "kdctl: '%s': no such command in this release\n", argv[1]);
	usage(stderr);
	return 2;
}
