/* kdbench's subcommands that live in files of their own: each takes the arguments
 * after "kdbench" (argv[0] is the subcommand) and returns the exit status. */
#ifndef KD_DAEMON_KDBENCH_H
#define KD_DAEMON_KDBENCH_H

int kdbench_decode_main(int argc, char **argv);		/* kdbench_decode.c */
int kdbench_kvcache_main(int argc, char **argv);		/* kdbench_kvcache.c */
int kdbench_ipc_main(int argc, char **argv);		/* kdbench_ipc.c */

#endif
